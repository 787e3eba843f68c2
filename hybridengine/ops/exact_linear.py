"""`linear_exact`: a batch-invariant linear, y = x @ weight^T (+ bias), for log-probs that the rollout and the
trainer compute bit for bit alike.

The rollout runs a layer's projections on a few rows at a time with stacked weights (q/k/v as one GEMM,
gate/up as one), the trainer on thousands of packed rows with separate weights. A library GEMM picks its
kernel, tiling and split-K from M, N and K, so the same row's output changes bits between the two. Here
each output element is defined by one summation order that depends only on K and `k_splits`: K is cut
into `k_splits` equal consecutive ranges, each reduced in fp32 from zero in k order, the partials added in
order ((p0 + p1) + p2 ...), then the bias (fp32), then one rounding to the output dtype (round to nearest
even). An fp32 output is that unrounded sum, so a tensor-parallel rank holding K-range s of x and weight
gets, with `k_splits=1, out_dtype=torch.float32`, exactly partial s of the single-device `k_splits=S` call.

Layers: `linear_exact_ref` (float64 math rounded once: the value the op approximates, for tests and
benchmarks), `linear_exact_torch` (the torch path: sums of fp32 products, no BLAS), `linear_exact_triton` (the
launcher of `kernels.exact_matmul.exact_matmul_kernel`), and the op `linear_exact` (checks, then the
kernel where `_launch.use_kernel` says so, else the torch path; differentiable through `_LinearExact`).

The two paths are each batch-invariant; they are not bitwise equal to each other (the GPU's tensor-core
dots and the CPU reduction sum a tile's products in their own orders), so a rollout and a trainer that must
agree run the same path.
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch

from hybridengine.checks import FLOAT_DTYPES, number, tensor
from hybridengine.ops import _launch

EXACT_BLOCK_K = 64
"""K columns per `tl.dot` step of the kernel: part of the summation order, so one value for every launch
(every M, N and device), whatever the tile's BLOCK_M and BLOCK_N."""

ROW_CHUNK = 16
"""Rows of x per chunk product of the torch path (the last chunk padded with zero rows)."""

COL_CHUNK = 64
"""Weight rows (output columns) per chunk product of the torch path (the last chunk padded with zero rows)."""

CHUNK_ELEMENTS = 1 << 22
"""Products held at once by the torch path: (row chunk, column chunk) pairs per step = this // (16 * 64 * k)."""


def _config(M: int, N: int, K: int, device: torch.device, dtype: torch.dtype) -> dict:
    """The kernel's launch: tile sizes, grouped order, warps and pipeline stages, by shape. Every tile shape,
    warp count and stage count gives the same bits (the order is K's alone; tested, and probed on the H200
    over 16-256 row and 64-256 column tiles), so the launch is free to follow speed: 64 x 64 tiles where few
    rows would leave most SMs idle under larger ones (decode), 128-row tiles for many rows, 256 columns for
    wide outputs (gate/up, the LM head). fp32 inputs take 2 stages: four of their 128 x 64 and 64 x 128
    fp32 tiles (256 KiB) pass the H200's 227 KiB of shared memory. Under the interpreter, 32 x 32 tiles keep
    the tests fast (its cost is per program and per op)."""
    if device.type != "cuda":
        return dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=EXACT_BLOCK_K, GROUP_M=2, num_warps=4, num_stages=1)
    stages = 2 if dtype == torch.float32 else None
    if M <= 64 or (M <= 256 and N <= 8192):
        return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=EXACT_BLOCK_K, GROUP_M=8, num_warps=4, num_stages=stages or 4)
    if M > 256 and N >= 16384 and dtype != torch.float32:
        return dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=EXACT_BLOCK_K, GROUP_M=8, num_warps=8, num_stages=3)
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=EXACT_BLOCK_K, GROUP_M=8, num_warps=8, num_stages=stages or 4)


def linear_exact_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                     out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Plain-torch reference: x @ weight^T (+ bias) in float64, rounded once to `out_dtype` (default x's)."""
    y = torch.einsum("...k,nk->...n", x.double(), weight.double())
    if bias is not None:
        y = y + bias.double()
    return y.to(out_dtype or x.dtype)


def _chunk_products(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, k] @ weight[N, k]^T in fp32: every output element is `torch.sum` over k of its fp32 products,
    contiguous along k. No BLAS: a CPU BLAS may sum an element's products in an order that depends on the
    element's place in its tile (one with AVX-512 kernels does), while torch's reduction over a contiguous
    last dimension reduces every row alike from its start and never splits it across threads; so an element's
    sum depends only on its row, its weight row and k. Row and column chunks of fixed shape (zero padded),
    several pairs a step, bound the memory."""
    M, N, k = x.shape[0], weight.shape[0], x.shape[1]
    num_m, num_n = -(-M // ROW_CHUNK), -(-N // COL_CHUNK)
    xs = x.new_zeros(num_m * ROW_CHUNK, k, dtype=torch.float32)
    xs[:M] = x
    ws = weight.new_zeros(num_n * COL_CHUNK, k, dtype=torch.float32)
    ws[:N] = weight
    xs, ws = xs.view(num_m, ROW_CHUNK, 1, k), ws.view(num_n, 1, COL_CHUNK, k)
    num_pairs = num_m * num_n
    per_step = max(1, CHUNK_ELEMENTS // (ROW_CHUNK * COL_CHUNK * k))
    pair = torch.arange(num_pairs, device=x.device)
    rows, cols = pair // num_n, pair % num_n
    out = torch.empty(num_pairs, ROW_CHUNK, COL_CHUNK, dtype=torch.float32, device=x.device)
    for first in range(0, num_pairs, per_step):
        sel = slice(first, first + per_step)
        torch.sum(xs[rows[sel]] * ws[cols[sel]], dim=-1, out=out[sel])
    out = out.view(num_m, num_n, ROW_CHUNK, COL_CHUNK).transpose(1, 2)
    return out.reshape(num_m * ROW_CHUNK, num_n * COL_CHUNK)[:M, :N]


def linear_exact_torch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                       k_splits: int = 1, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """`linear_exact` of x [M, K] in torch ops (the exact mode's path without the kernel): per K split,
    fp32 sums of products (`_chunk_products`); the partials added in split order, then the bias as fp32,
    then one rounding to `out_dtype`. Returns a contiguous [M, N], as the kernel does, not the slice of the
    zero-padded chunk products [16 * ceil(M / 16), 64 * ceil(N / 64)]: a row-parallel partial goes straight
    into the TP all-reduce, and gloo reduces `numel` elements from the data pointer whatever the strides."""
    M, K = x.shape
    if M == 0 or weight.shape[0] == 0:
        return torch.empty(M, weight.shape[0], dtype=out_dtype or x.dtype, device=x.device)
    split = K // k_splits
    total = _chunk_products(x[:, :split], weight[:, :split])
    for s in range(1, k_splits):
        total = total + _chunk_products(x[:, s * split:(s + 1) * split], weight[:, s * split:(s + 1) * split])
    if bias is not None:
        total = total + bias.float()
    return total.to(out_dtype or x.dtype).contiguous()


def linear_exact_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                        k_splits: int = 1, out_dtype: torch.dtype | None = None,
                        config: dict | None = None) -> torch.Tensor:
    """`linear_exact` of x [M, K] with the Triton kernel (CUDA, or CPU under TRITON_INTERPRET=1).

    `config` overrides `_config`'s launch: BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages (tuning
    sweeps and the invariance probes use it). BLOCK_M, BLOCK_N, GROUP_M, warps and stages leave the summation
    order as it is; BLOCK_K is part of it (the default is `EXACT_BLOCK_K`)."""
    from hybridengine.kernels.exact_matmul import exact_matmul_kernel

    M, K = x.shape
    N = weight.shape[0]
    assert x.stride(-1) == 1 and weight.stride(-1) == 1 and weight.shape[1] == K and weight.dtype == x.dtype
    assert bias is None or (bias.shape == (N,) and bias.stride(0) == 1)
    assert K % k_splits == 0
    y = torch.empty(M, N, dtype=out_dtype or x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    cfg = _launch.launch_config(_config(M, N, K, x.device, x.dtype), config)
    block_m, block_n, block_k, group_m = (cfg.pop(key) for key in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M"))
    assert block_k >= 16 and block_k & (block_k - 1) == 0, f"BLOCK_K must be a power of 2 >= 16, got {block_k}"
    split = K // k_splits
    grid = (-(-M // block_m) * -(-N // block_n),)
    exact_matmul_kernel[grid](
        x, weight, bias if bias is not None else weight, y, M, N, split, k_splits,
        x.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, EVEN_K=split % block_k == 0, SUM_DOT=x.device.type != "cuda",
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m, **cfg,
    )
    return y


@contextlib.contextmanager
def _no_split_k():
    """cuBLASLt without split-K for 16-bit GEMMs for the duration of the block (torch's process-wide
    switches, restored on exit): every kernel it may pick then sums K from zero in k order into one fp32
    accumulator, as `exact_matmul_kernel` does."""
    matmul = torch.backends.cuda.matmul
    saved = [(getattr(matmul, name), getattr(matmul, f"{name}_split_k")) for name in _REDUCTION_SWITCHES]
    backend = torch.backends.cuda.preferred_blas_library()
    try:
        torch.backends.cuda.preferred_blas_library("cublaslt")  # the switch binds cuBLASLt's calls only
        for name in _REDUCTION_SWITCHES:
            setattr(matmul, name, (False, False))
        yield
    finally:
        for name, value in zip(_REDUCTION_SWITCHES, saved):
            setattr(matmul, name, value)
        torch.backends.cuda.preferred_blas_library(backend)


_REDUCTION_SWITCHES = ("allow_bf16_reduced_precision_reduction", "allow_fp16_reduced_precision_reduction")


@functools.cache
def cublas_available() -> bool:
    """Whether this torch can forbid cuBLAS's split-K (`allow_*_reduced_precision_reduction = (False, False)`)."""
    return hasattr(torch._C, "_get_cublas_allow_bf16_reduced_precision_reduction") and isinstance(
        torch._C._get_cublas_allow_bf16_reduced_precision_reduction(), tuple)


def linear_exact_cublas(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                        k_splits: int = 1, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """`linear_exact` of 16-bit x [M, K] by cuBLAS with split-K forbidden: the first K split's fp32 product
    (`aten.mm.dtype`), each further split's added onto it in cuBLAS's epilogue (`aten.addmm.dtype`, beta 1:
    p + acc rounded once in fp32, the kernel's (p0 + p1) + p2 order), the bias in fp32, one rounding. Up to
    BATCHED_SPLITS_MAX_ROWS rows the splits' products are one batched GEMM instead (`aten.bmm.dtype`: the
    splits run side by side, where one split's tiles alone leave SMs idle) and are added in the same order.
    One split to the input dtype is `F.linear` with its bias epilogue (acc + bias in fp32, rounded once)."""
    out_dtype = out_dtype or x.dtype
    with _no_split_k():
        if k_splits == 1 and out_dtype == x.dtype:
            return torch.nn.functional.linear(x, weight, bias)
        split = x.shape[1] // k_splits
        if k_splits > 1 and x.shape[0] <= BATCHED_SPLITS_MAX_ROWS:
            parts = torch.ops.aten.bmm.dtype(x.unflatten(1, (k_splits, split)).transpose(0, 1),
                                             weight.unflatten(1, (k_splits, split)).permute(1, 2, 0), torch.float32)
            total = parts[0] + parts[1]
            for s in range(2, k_splits):
                total += parts[s]
        else:
            total = torch.ops.aten.mm.dtype(x[:, :split], weight[:, :split].t(), torch.float32)
            for s in range(1, k_splits):
                cols = slice(s * split, (s + 1) * split)
                torch.ops.aten.addmm.dtype_out(total, x[:, cols], weight[:, cols].t(), torch.float32, out=total)
    if bias is not None:
        total = total + bias.float()
    return total.to(out_dtype)


def _cublas_aligned(x: torch.Tensor, weight: torch.Tensor, k_splits: int) -> bool:
    """K (per split), N and the row strides are multiples of CUBLAS_ALIGN elements and the data 16-byte
    aligned: the layouts whose cuBLAS kernels the GPU test holds to the Triton kernel's bits."""
    k, n = x.shape[1] // k_splits, weight.shape[0]
    return (k % CUBLAS_ALIGN == 0 and n % CUBLAS_ALIGN == 0 and x.stride(0) % CUBLAS_ALIGN == 0
            and weight.stride(0) % CUBLAS_ALIGN == 0 and x.data_ptr() % 16 == 0 and weight.data_ptr() % 16 == 0)


def _impl(x: torch.Tensor, weight: torch.Tensor, k_splits: int):
    if not _launch.use_kernel(x):
        return linear_exact_torch
    if (CUBLAS and x.device.type == "cuda" and x.dtype != torch.float32 and x.shape[0] >= CUBLAS_MIN_ROWS
            and _cublas_aligned(x, weight, k_splits) and cublas_available()):
        return linear_exact_cublas
    return linear_exact_triton


CUBLAS = True
"""Whether 16-bit CUDA inputs of `CUBLAS_MIN_ROWS` rows or more take `linear_exact_cublas` (where torch can
forbid split-K) rather than the Triton kernel: the two give the same bits (the GPU test compares them over
every M from 16 to 300 and at training sizes, for the model's projection shapes), cuBLAS faster."""

CUBLAS_ALIGN = 8
"""cuBLAS takes only shapes and strides that are multiples of 8 elements: at an odd vocabulary (N = 50257)
it picks kernels whose bits differ from the Triton kernel's, and those shapes go to the kernel."""

BATCHED_SPLITS_MAX_ROWS = 512
"""Row-parallel products (k_splits > 1) of at most this many rows (decode steps, small prefills) take one
batched GEMM over the splits in `linear_exact_cublas`: there one split's tiles leave SMs idle, and below 128
rows cuBLASLt without split-K picks a far slower kernel for the long-K down_proj split. From 1,024 rows on
the two GEMMs are faster (the o_proj and down_proj shapes of Qwen2.5-1.5B and Qwen2-7B; docs/exact.md)."""

CUBLAS_MIN_ROWS = 16
"""Fewer rows go to the Triton kernel: cuBLAS may take a GEMV-like kernel there, with another order (a single
row of a K = 4480 half did); the kernel costs little at that size."""


def _forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, k_splits: int,
             out_dtype: torch.dtype) -> torch.Tensor:
    """The kernel or the torch path over x's rows flattened to [M, K]; returns [..., N]."""
    shape = x.shape
    x2 = x.reshape(math.prod(shape[:-1]), shape[-1])
    impl = _impl(x2, weight, k_splits)
    y = impl(x2, weight, bias, k_splits=k_splits, out_dtype=out_dtype)
    return y.view(*shape[:-1], weight.shape[0])


class _LinearExact(torch.autograd.Function):
    """The batch-invariant forward; a backward of plain matmuls in the input dtype, as F.linear's
    (deterministic, not batch-invariant: training gradients need not match anything bit for bit)."""

    @staticmethod
    def forward(ctx, x, weight, bias, k_splits, out_dtype):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _forward(x, weight, bias, k_splits, out_dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        g = grad.reshape(-1, weight.shape[0]).to(x.dtype)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = (g @ weight).view(x.shape)
        if ctx.needs_input_grad[1]:
            grad_w = g.t() @ x.reshape(-1, x.shape[-1])
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g.sum(0)
        return grad_x, grad_w, grad_b, None, None


def _check(op: str, x, weight, bias, k_splits, out_dtype) -> None:
    if isinstance(x, torch.Tensor) and x.dim() == 0:
        raise ValueError(f"{op}: x must be [..., K], got a 0-D tensor")
    tensor(op, "x", x, dtypes=FLOAT_DTYPES)
    K = x.shape[-1]
    tensor(op, "weight", weight, dim=2, dtypes=(x.dtype,), device=x.device, contiguous_last=True)
    if weight.shape[1] != K:
        raise ValueError(f"{op}: weight must be [N, K] with K = x.shape[-1] = {K}, got shape {tuple(weight.shape)}")
    if bias is not None:
        tensor(op, "bias", bias, shape=(weight.shape[0],), dtypes=(x.dtype,), device=x.device, contiguous_last=True)
    number(op, "k_splits", k_splits, low=1, integer=True)
    if K % k_splits:
        raise ValueError(f"{op}: k_splits ({k_splits}) must divide K ({K}) into equal splits")
    if out_dtype is not None and out_dtype not in FLOAT_DTYPES:
        raise ValueError(f"{op}: out_dtype must be None or one of {FLOAT_DTYPES}, got {out_dtype!r}")


def linear_exact(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                 k_splits: int = 1, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """y = x @ weight^T (+ bias) with each element's bits fixed by its x row, weight row, bias, K and
    `k_splits` alone: never by the number of rows, the other rows, or the other columns of the call (a
    weight of stacked rows gives, column for column, the separate calls' results).

    x [..., K] (bf16, fp16 or fp32; made contiguous along K if it is not), weight [N, K] of x's dtype and
    device with unit stride along K (any row stride: a view into a flat buffer will do), bias [N] or None.
    K is cut into `k_splits` equal ranges, each summed in fp32 from zero in k order, the partials added in
    order, the bias added in fp32, and the sum rounded once to `out_dtype` (default x's dtype; fp32 returns
    the unrounded sum). Returns a contiguous [..., N]. The Triton kernel runs where `_launch.use_kernel` says so
    (CUDA), the torch path elsewhere: each is batch-invariant, the two need not agree bit for bit.
    Differentiable in x, weight and bias (the backward is F.linear's matmuls in x's dtype)."""
    _check("linear_exact", x, weight, bias, k_splits, out_dtype)
    if x.stride(-1) != 1:
        x = x.contiguous()
    out_dtype = out_dtype or x.dtype
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                    or (bias is not None and bias.requires_grad)):
        return _LinearExact.apply(x, weight, bias, k_splits, out_dtype)
    return _forward(x, weight, bias, k_splits, out_dtype)


def implementations(device_type: str) -> dict[str, str]:
    """Which implementation `linear_exact` runs on this device type (for `hybridengine info`)."""
    if device_type != "cuda":
        return {"linear_exact": "torch chunked (batch-invariant)"}
    return {"linear_exact": "cuBLAS without split-K (16-bit), Triton (fp32)" if CUBLAS and cublas_available()
            else "Triton"}
