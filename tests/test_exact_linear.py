"""`linear_exact` (hybridengine.ops.exact_linear): batch invariance (a row's bits whatever the other rows and
columns of the call), the tensor-parallel split identity, closeness to a float64 reference, gradients and the
argument checks. Each invariance test runs both paths: the Triton kernel (on the GPU, or on CPU under the
interpreter with `_launch.use_kernel` patched) and the torch path (chunk products). The two paths are each
batch-invariant and are not compared with each other bit for bit (their dots sum a tile's products in their
own orders).

Tolerance against the float64 reference: the op rounds once, as torch's same-dtype F.linear does, and only the
fp32 summation order differs. bf16/fp16 outputs: the error is the final rounding (half an ulp) plus an fp32 sum
error far below the 16-bit ulp, so at most the rounding flips one way where torch's flips the other: within 2x
torch's own largest error. fp32 outputs show the summation order itself, and torch's GEMMs sum in other
(blocked) orders with smaller errors than the kernel's k-ordered chain (on the H200, 2.3x cuBLAS's largest
error at K = 160 for fp32 inputs, 3x for bf16 inputs with fp32 outputs): they are held to the error bound of
their own order instead (see the test).
"""

import pytest
import torch
import torch.nn.functional as F

from hybridengine.ops import _launch, exact_linear
from hybridengine.ops.exact_linear import (EXACT_BLOCK_K, linear_exact, linear_exact_cublas, linear_exact_ref,
                                           linear_exact_torch, linear_exact_triton)
from hybridengine.ops.stacked_rows import stacked_rows

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# The GPU variant is marked `gpu`; on a machine without one, CPU (the kernel under the Triton interpreter).
DEVICES = [pytest.param("cuda", marks=pytest.mark.gpu)] + ([] if torch.cuda.is_available() else ["cpu"])
K = 160
"""Two and a half `EXACT_BLOCK_K` tiles: full tiles and a masked last one, with one split or two (80 each)."""
N = 72
"""Output columns: several 16-column kernel tiles (interpreter) and two 64-row chunks of the torch path, the
last ones partial."""


@pytest.fixture(params=DEVICES)
def device(request) -> torch.device:
    return torch.device(request.param)


@pytest.fixture(params=["triton", "torch", "cublas"])
def path(request, monkeypatch) -> str:
    """Which implementation `linear_exact` runs: the kernel (the interpreter on CPU), the torch path, or (CUDA,
    16-bit inputs; fp32 inputs take the kernel) cuBLAS with split-K forbidden."""
    if request.param == "cublas" and not torch.cuda.is_available():
        pytest.skip("cuBLAS needs CUDA")
    monkeypatch.setattr(_launch, "use_kernel", lambda t: request.param != "torch")
    monkeypatch.setattr(exact_linear, "CUBLAS", request.param == "cublas")
    return request.param


def _inputs(device, dtype, rows: int = 40, k: int = K, n: int = N, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g).to(dtype).to(device)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype).to(device)
    b = torch.randn(n, generator=g).to(dtype).to(device)
    return x, w, b


def test_block_k_covers_the_test_shapes():
    assert K % EXACT_BLOCK_K and K > 2 * EXACT_BLOCK_K and (K // 2) % EXACT_BLOCK_K  # masked last tiles


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k_splits", [1, 2])
def test_rows_are_batch_invariant(device, path, dtype, k_splits):
    """A row's output is the same bits for any number of rows (1, 3, 17, 40), any subset and order of the other
    rows, and any position among unrelated rows (another place in another row tile)."""
    x, w, b = _inputs(device, dtype)
    full = linear_exact(x, w, b, k_splits=k_splits)
    g = torch.Generator().manual_seed(1)
    perm = torch.randperm(40, generator=g).to(device)
    assert torch.equal(linear_exact(x[perm], w, b, k_splits=k_splits), full[perm])
    for m in (1, 3, 17, 40):
        rows = torch.randperm(40, generator=g)[:m].to(device)
        assert torch.equal(linear_exact(x[rows], w, b, k_splits=k_splits), full[rows]), m
        before = torch.randn(5, K, generator=g).to(dtype).to(device)
        after = torch.randn(2, K, generator=g).to(dtype).to(device)
        embedded = linear_exact(torch.cat([before, x[rows], after]), w, b, k_splits=k_splits)
        assert torch.equal(embedded[5:5 + m], full[rows]), m


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_stacked_weights_equal_separate_calls(device, path, dtype, with_bias):
    """q/k/v stored back to back in one flat buffer: one call over the stacked view gives, column for column,
    the three separate calls' bits (40/24/24 rows: the stacked call's tile and chunk edges fall elsewhere)."""
    g = torch.Generator().manual_seed(2)
    sizes = (40, 24, 24)
    flat = (torch.randn(sum(sizes) * K + sum(sizes), generator=g) / K ** 0.5).to(dtype).to(device)
    weights, biases, offset = [], [], 0
    for n in sizes:
        weights.append(flat[offset:offset + n * K].view(n, K))
        offset += n * K
    for n in sizes:
        biases.append(flat[offset:offset + n])
        offset += n
    stacked_w = stacked_rows(*weights)
    stacked_b = stacked_rows(*biases) if with_bias else None
    x = torch.randn(17, K, generator=g).to(dtype).to(device)
    one = linear_exact(x, stacked_w, stacked_b)
    separate = [linear_exact(x, wi, bi if with_bias else None) for wi, bi in zip(weights, biases)]
    assert torch.equal(one, torch.cat(separate, dim=-1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_tensor_parallel_partials(device, path, dtype, with_bias):
    """A rank holding K-range s of x and weight (`k_splits=1, out_dtype=fp32`) computes exactly partial s of
    the single-device split call: for S = 2, (p0 + p1 + bias) rounded is the `k_splits=2` call; for S = 2
    and 3 the fp32 split call is the partials added in order (then the bias)."""
    x, w, b = _inputs(device, dtype, rows=17, k=K * 3 // 2)  # 240 = 2 x 120 = 3 x 80
    bias = b if with_bias else None
    k = x.shape[1]
    for s_count in (2, 3):
        cols = [slice(s * k // s_count, (s + 1) * k // s_count) for s in range(s_count)]
        parts = [linear_exact(x[:, c], w[:, c], k_splits=1, out_dtype=torch.float32) for c in cols]
        total = parts[0]
        for p in parts[1:]:
            total = total + p
        if with_bias:
            total = total + bias.float()
        assert torch.equal(linear_exact(x, w, bias, k_splits=s_count, out_dtype=torch.float32), total)
        assert torch.equal(linear_exact(x, w, bias, k_splits=s_count), total.to(dtype))
    p0, p1 = (linear_exact(x[:, c], w[:, c], out_dtype=torch.float32) for c in (slice(0, k // 2), slice(k // 2, k)))
    tp = (p0 + p1 + bias.float()) if with_bias else (p0 + p1)
    assert torch.equal(tp.to(dtype), linear_exact(x, w, bias, k_splits=2))


@pytest.mark.parametrize("rows,n", [(17, 32), (3, N), (16, 64), (1, 40)])
@pytest.mark.parametrize("out_dtype", [None, torch.float32])
def test_output_is_contiguous(device, path, rows, n, out_dtype):
    """The result is a contiguous [M, N] for any M and N, not a slice of the torch path's padded chunk products:
    a row-parallel partial (`k_splits=1, out_dtype=fp32`) goes straight into the TP all-reduce, which reduces
    `numel` elements from the data pointer whatever the strides."""
    x, w, _ = _inputs(device, torch.bfloat16, rows=rows, k=K // 2, n=n)
    y = linear_exact(x, w, out_dtype=out_dtype)
    assert y.shape == (rows, n) and y.is_contiguous(), y.stride()


@pytest.mark.parametrize("dtype", DTYPES)
def test_leading_dims_and_strides(device, path, dtype):
    """x [B, T, K] is its rows flattened; x with a non-unit last stride is made contiguous; a weight that is a
    row-strided view (rows of a wider buffer) gives its contiguous copy's bits."""
    x, w, b = _inputs(device, dtype, rows=12)
    y = linear_exact(x, w, b)
    assert torch.equal(linear_exact(x.view(3, 4, K), w, b), y.view(3, 4, N))
    assert torch.equal(linear_exact(x.t().contiguous().t(), w, b), y)
    wide = torch.zeros(N, K + 24, dtype=dtype, device=device)
    wide[:, 8:8 + K] = w
    view = wide[:, 8:8 + K]
    assert view.stride() == (K + 24, 1)
    assert torch.equal(linear_exact(x, view, b), y)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k_splits", [1, 2])
def test_close_to_float64_reference(device, path, dtype, k_splits):
    """Against the float64 sum (module docstring): 16-bit outputs within 2x torch's own F.linear error; fp32
    outputs within the bound of their summation order, gamma_n * (|x| @ |w|^T + |b|)."""
    x, w, b = _inputs(device, dtype, seed=3)
    exact = linear_exact_ref(x, w, b, out_dtype=torch.float64)
    if dtype != torch.float32:
        torch_err = (F.linear(x, w, b).double() - exact).abs().max().item()
        err = (linear_exact(x, w, b, k_splits=k_splits).double() - exact).abs().max().item()
        assert err <= 2 * torch_err, (err, torch_err)
    # Each split adds its K / S products one at a time (k order), then S - 1 partial adds and the bias: at most
    # n = K / S + S + 1 roundings on any path from a product to the output, each within a relative u, so
    # |error| <= gamma_n * sum |terms| with gamma_n = n u / (1 - n u) (Higham, recursive summation). u = 2^-24
    # (round to nearest) or 2^-23 where the GPU's tensor cores add 16-bit products (they truncate).
    u = 2.0 ** -23 if (device.type == "cuda" and path == "triton" and dtype != torch.float32) else 2.0 ** -24
    n = K // k_splits + k_splits + 1
    bound = n * u / (1 - n * u) * (x.double().abs() @ w.double().abs().t() + b.double().abs())
    err32 = (linear_exact(x, w, b, k_splits=k_splits, out_dtype=torch.float32).double() - exact).abs()
    assert (err32 <= bound).all(), (err32 / bound).max().item()


@pytest.mark.gpu
@pytest.mark.parametrize("k,n,k_splits,with_bias,out_dtype", [
    (1536, 2048, 1, True, None), (1536, 1536, 2, False, None), (8960, 1536, 2, False, None),
    (1536, 17920, 1, False, None), (768, 1536, 1, False, torch.float32), (K, N, 2, True, None),
    (256, 50264, 1, False, None)])
def test_cublas_without_split_k_gives_the_kernels_bits(k, n, k_splits, with_bias, out_dtype):
    """cuBLAS with split-K forbidden (`linear_exact_cublas`) against the Triton kernel, bit for bit, at every
    row count from CUBLAS_MIN_ROWS (fewer go to the kernel) to 300 and at training sizes: whatever kernel
    cuBLAS picks for M, it sums K in k order into one fp32 accumulator, as the kernel does (the model's qkv,
    o, down and gate/up shapes of Qwen2.5-1.5B, a tensor-parallel half with an fp32 output, and the tests'
    masked K)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    x, w, b = _inputs("cuda", torch.bfloat16, rows=4096, k=k, n=n)
    b = b if with_bias else None
    unequal = [m for m in [*range(exact_linear.CUBLAS_MIN_ROWS, 301), 512, 1000, 4096]
               if not torch.equal(linear_exact_cublas(x[:m], w, b, k_splits=k_splits, out_dtype=out_dtype),
                                  linear_exact_triton(x[:m], w, b, k_splits=k_splits, out_dtype=out_dtype))]
    assert not unequal, unequal


@pytest.mark.gpu
def test_unaligned_shapes_keep_the_kernels_bits():
    """An odd vocabulary (N = 50257, GPT-2's) is not cuBLAS's: `linear_exact` routes it to the Triton kernel,
    so a row's logits are the same bits at every row count, one row (the sampler's) included."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    x, w, _ = _inputs("cuda", torch.bfloat16, rows=512, k=256, n=50257)
    assert not exact_linear._cublas_aligned(x, w, 1)
    want = linear_exact_triton(x, w, None)
    unequal = [m for m in (1, 15, 16, 17, 60, 128, 180, 512) if not torch.equal(linear_exact(x[:m], w), want[:m])]
    assert not unequal, unequal


def test_cublas_takes_only_aligned_layouts():
    """K per split, N and the row strides must be multiples of CUBLAS_ALIGN (and the data 16-byte aligned)."""
    x = torch.zeros(32, 64, dtype=torch.bfloat16)
    w = torch.zeros(48, 64, dtype=torch.bfloat16)
    assert exact_linear._cublas_aligned(x, w, 1) and exact_linear._cublas_aligned(x, w, 2)
    assert not exact_linear._cublas_aligned(x, w[:47], 1)  # N = 47
    assert not exact_linear._cublas_aligned(x[:, :60], w[:, :60], 1)  # K = 60 (and a stride of 64: fine alone)
    assert not exact_linear._cublas_aligned(x, w, 16)  # K per split = 4
    assert not exact_linear._cublas_aligned(torch.zeros(32, 65, dtype=torch.bfloat16)[:, 1:], w, 1)  # 2-byte offset


@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_tiles_keep_the_order(device, dtype):
    """BLOCK_M, BLOCK_N, GROUP_M and warps do not enter the summation order (BLOCK_K fixed): the kernel's
    outputs are the same bits under other tilings. On the GPU this is the probe of the tensor-core dots."""
    x, w, b = _inputs(device, dtype, rows=40)
    if device.type == "cuda":
        configs = [dict(BLOCK_M=128, BLOCK_N=128, num_warps=8), dict(BLOCK_M=64, BLOCK_N=128, num_warps=4),
                   dict(BLOCK_M=128, BLOCK_N=64, num_warps=4), dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, GROUP_M=1),
                   dict(BLOCK_M=16, BLOCK_N=64, num_warps=4)]
    else:
        configs = [dict(BLOCK_M=16, BLOCK_N=16), dict(BLOCK_M=32, BLOCK_N=16, GROUP_M=1),
                   dict(BLOCK_M=16, BLOCK_N=32, GROUP_M=2)]
    outs = [linear_exact_triton(x, w, b, k_splits=2, config=c) for c in configs]
    for c, out in zip(configs[1:], outs[1:]):
        assert torch.equal(out, outs[0]), c


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("out_dtype", [None, torch.float32])
def test_gradients_match_f_linear(device, path, dtype, out_dtype):
    """Gradients in x, weight and bias are F.linear's (close: the same matmuls), and two runs give the same bits."""
    x, w, b = _inputs(device, dtype, rows=12)
    x3 = x.view(3, 4, K)
    g = torch.Generator().manual_seed(4)
    grad_y = torch.randn(3, 4, N, generator=g).to(out_dtype or dtype).to(device)

    def grads(fn):
        leaves = [t.detach().clone().requires_grad_() for t in (x3, w, b)]
        fn(*leaves).backward(grad_y)
        return [t.grad for t in leaves]

    runs = [grads(lambda xi, wi, bi: linear_exact(xi, wi, bi, k_splits=2, out_dtype=out_dtype)) for _ in range(2)]
    expected = grads(lambda xi, wi, bi: F.linear(xi, wi, bi).to(out_dtype or dtype))
    for a, b2, e in zip(*runs, expected):
        assert torch.equal(a, b2)
        torch.testing.assert_close(a, e)
    assert linear_exact(x3, w, b).requires_grad is False


def test_paths_agree_where_sums_are_exact(device):
    """The kernel and the torch path need not agree bit for bit (their dots sum in their own orders), but
    where every partial sum is exact (small integers) both give the exact product."""
    x = torch.randint(-4, 5, (9, K), device=device).float()
    w = torch.randint(-4, 5, (N, K), device=device).float()
    assert torch.equal(linear_exact_triton(x, w), linear_exact_torch(x, w))
    assert torch.equal(linear_exact_triton(x, w), x @ w.t())


@pytest.mark.parametrize("shape", [(0, K), (2, 0, K)])
def test_empty_rows(device, path, shape):
    x = torch.empty(shape, device=device, requires_grad=True)
    w = torch.randn(N, K, device=device, requires_grad=True)
    y = linear_exact(x, w, torch.zeros(N, device=device), k_splits=2)
    assert y.shape == (*shape[:-1], N)
    y.sum().backward()
    assert x.grad.shape == shape and torch.equal(w.grad, torch.zeros_like(w))


@pytest.mark.parametrize("call,match", [
    (lambda x, w: linear_exact(x[0, 0], w), r"linear_exact: x must be \[\.\.\., K\], got a 0-D tensor"),
    (lambda x, w: linear_exact(x.tolist(), w), "linear_exact: x must be a torch.Tensor, got list"),
    (lambda x, w: linear_exact(x.double(), w.double()), "x must be torch.bfloat16 or torch.float16 or "
                                                         "torch.float32, got torch.float64"),
    (lambda x, w: linear_exact(x, w[0]), "weight must be 2-D, got shape \\(8,\\)"),
    (lambda x, w: linear_exact(x, w.half()), "weight must be torch.float32, got torch.float16"),
    (lambda x, w: linear_exact(x, w.to("meta")), "weight is on meta, expected cpu"),
    (lambda x, w: linear_exact(x, w[:, :7]), r"weight must be \[N, K\] with K = x.shape\[-1\] = 8, got shape "
                                             r"\(6, 7\)"),
    (lambda x, w: linear_exact(x, w.t().contiguous().t()), "weight must have unit stride in its last dim"),
    (lambda x, w: linear_exact(x, w, w[0]), r"bias must have shape \(6,\), got \(8,\)"),
    (lambda x, w: linear_exact(x, w, w[:, 0].half()), "bias must be torch.float32, got torch.float16"),
    (lambda x, w: linear_exact(x, w, w[:, 0].to("meta")), "bias is on meta, expected cpu"),
    (lambda x, w: linear_exact(x, w, k_splits=0), r"k_splits must be in \[1, inf\), got 0"),
    (lambda x, w: linear_exact(x, w, k_splits=2.0), "k_splits must be a finite integer, got 2.0"),
    (lambda x, w: linear_exact(x, w, k_splits=True), "k_splits must be a finite integer, got True"),
    (lambda x, w: linear_exact(x, w, k_splits=3), r"k_splits \(3\) must divide K \(8\) into equal splits"),
    (lambda x, w: linear_exact(x, w, out_dtype=torch.float64), "out_dtype must be None or one of .*, got "
                                                               "torch.float64"),
    (lambda x, w: linear_exact(x, w, out_dtype="float32"), "out_dtype must be None or one of .*, got 'float32'"),
])
def test_bad_input(call, match):
    """The op checks its arguments (on CPU tensors; the launchers only assert)."""
    x, w = torch.randn(4, 8), torch.randn(6, 8)
    with pytest.raises(ValueError, match=match):
        call(x, w)
