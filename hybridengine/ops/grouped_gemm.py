"""Grouped GEMM over experts, and the routed-experts MLP built on it: the ops and their plain-torch references.

A mixture-of-experts layer routes each token to k of E experts. `route_tokens` sorts the N * k
(token, expert) assignments by expert, so that each expert's rows are contiguous; `grouped_gemm_ref`
multiplies each expert's rows by that expert's weight (one GEMM per expert); `grouped_mlp_ref` is the whole
routed SwiGLU MLP: sort, gate/up grouped GEMM, SiLU * up, down grouped GEMM, scale by the routing weight and
sum each token's k rows back. Every step is differentiable (autograd through indexing and matmuls).

The ops: `grouped_gemm` (checks, then one of three paths, differentiable in x and weight) and `grouped_mlp`
(`grouped_mlp_ref`'s semantics on `grouped_gemm`, with a deterministic sum over each token's k rows).
Paths, picked per call: the Triton kernels of `kernels.grouped_gemm` where `_launch.use_kernel` says so (CUDA;
the tests patch it to run them on CPU under TRITON_INTERPRET=1); elsewhere, with `exact`, one `linear_exact`
per expert (its batch-invariant torch path: the CPU's exact mode, as for the dense projections); elsewhere,
`grouped_gemm_ref`. In exact mode the kernel's launch is one fixed configuration (`EXACT_CONFIG`: no choice
by M or by the routing), so a row's output bits depend only on the row, its expert's weight and K.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from hybridengine.checks import FLOAT_DTYPES, describe, is_int, tensor
from hybridengine.ops import _launch
from hybridengine.ops.exact_linear import linear_exact


@dataclass(frozen=True, slots=True)
class Routing:
    """A batch's (token, expert) assignments sorted by expert."""

    order: torch.Tensor
    """int64 [N * k]: the flat assignment index (token * k + slot) of each sorted row."""
    tokens: torch.Tensor
    """int64 [N * k]: the token of each sorted row."""
    group_sizes: list[int]
    """Rows per expert, in expert order (host ints: the GEMM loop's bounds)."""


def route_tokens(experts: torch.Tensor, num_experts: int) -> Routing:
    """experts int64 [N, k] (each token's experts) -> the assignments sorted by expert (stable: rows of one
    expert keep token order)."""
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    sizes = torch.bincount(flat, minlength=num_experts)
    return Routing(order=order, tokens=order // experts.shape[-1], group_sizes=sizes.tolist())


def grouped_gemm_ref(x: torch.Tensor, weight: torch.Tensor, group_sizes: list[int]) -> torch.Tensor:
    """x [M, K] with rows grouped by expert (group_sizes[e] rows of expert e, in order), weight [E, N, K]
    -> [M, N]: each group times its expert's weight transposed (as `F.linear`)."""
    assert x.dim() == 2 and weight.dim() == 3 and x.shape[1] == weight.shape[2], (x.shape, weight.shape)
    assert len(group_sizes) == weight.shape[0] and sum(group_sizes) == x.shape[0], (group_sizes, x.shape)
    outs, start = [], 0
    for e, n in enumerate(group_sizes):
        if n:
            outs.append(torch.nn.functional.linear(x[start:start + n], weight[e]))
        start += n
    if not outs:
        return x.new_zeros(0, weight.shape[1])
    return torch.cat(outs)


def grouped_mlp_ref(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, experts: torch.Tensor,
                    weights: torch.Tensor, silu_mul=None) -> torch.Tensor:
    """The routed experts' SwiGLU MLP: x [N, H], gate_up [E, 2I, H] (each expert's gate rows, then its up
    rows), down [E, H, I], experts int64 [N, k], weights [N, k] (the routing weights) -> [N, H]:
    sum_j weights[n, j] * down_e(silu(gate_e(x_n)) * up_e(x_n)) with e = experts[n, j].
    `silu_mul(gate, up)`: the activation (default silu(gate) * up)."""
    num_experts, inter = gate_up.shape[0], gate_up.shape[1] // 2
    routing = route_tokens(experts, num_experts)
    rows = x[routing.tokens]
    gu = grouped_gemm_ref(rows, gate_up, routing.group_sizes)
    gate, up = gu[:, :inter], gu[:, inter:]
    act = silu_mul(gate, up) if silu_mul is not None else torch.nn.functional.silu(gate) * up
    y = grouped_gemm_ref(act, down, routing.group_sizes)
    y = y * weights.reshape(-1)[routing.order].unsqueeze(1)
    return torch.zeros_like(x).index_add_(0, routing.tokens, y)


# -- the Triton path ------------------------------------------------------------------------------------------

EXACT_CONFIG = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3)
"""The CUDA forward's launch in exact mode, for every M, routing and shape (fp32 inputs take 2 stages for
shared memory): BLOCK_K fixes the summation order, and BLOCK_M, BLOCK_N and warps stay fixed too, so nothing
about the launch depends on the batch. Chosen without a GPU measurement. At decode sizes a tile holds one
or a few rows: its weight reads are the ones any kernel needs, the unused rows cost tensor-core work only."""

INTERPRETER_CONFIG = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=1)
"""The launch under the interpreter (exact or not): small tiles keep the CPU tests fast and make a few rows
per expert span several row tiles."""

DW_CONFIG = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3)
DW_INTERPRETER_CONFIG = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, num_warps=4, num_stages=1)
"""The weight-gradient kernel's launches (BLOCK_M: rows reduced per step; BLOCK_N x BLOCK_K: the dW tile)."""


def _config(M: int, E: int, N: int, device: torch.device, dtype: torch.dtype, exact: bool) -> dict:
    """The forward kernel's launch. Outside exact mode the tiles follow the shape (a heuristic, not tuned on a
    GPU): BLOCK_M from the mean rows per expert (an expert's last tile is partial, and with few rows per
    expert a smaller tile wastes fewer rows), 128 columns for wide outputs; fp32 tiles take 2 pipeline
    stages (shared memory)."""
    if device.type != "cuda":
        return dict(INTERPRETER_CONFIG)
    if exact:
        return dict(EXACT_CONFIG, num_stages=2) if dtype == torch.float32 else dict(EXACT_CONFIG)
    rows = M / max(E, 1)
    block_m = 16 if rows <= 16 else 32 if rows <= 32 else 64 if rows <= 64 else 128
    block_n = 128 if N >= 128 else 64
    warps = 8 if block_m * block_n >= 128 * 128 else 4
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=64, num_warps=warps,
                num_stages=2 if dtype == torch.float32 else 3)


def _sum_dot(t: torch.Tensor) -> bool:
    return t.device.type != "cuda"


def row_tile_slots(M: int, E: int, block_m: int) -> int:
    """Axis 0 of the forward grid: an upper bound on the row tiles of any routing of M rows to E experts,
    min(cdiv(M, block_m) + E - 1, M). Each tile holds at least one row (so at most M), and
    cdiv(a, B) + cdiv(b, B) <= cdiv(a + b, B) + 1, so E groups cut into at most cdiv(M, B) + E - 1 tiles.
    A decode step (M = tokens * k rows) gets M slots, not E: no program per idle expert."""
    return min(-(-M // block_m) + E - 1, M)


def grouped_gemm_triton(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, *, exact: bool = False,
                        out_dtype: torch.dtype | None = None, config: dict | None = None) -> torch.Tensor:
    """The forward launcher: x [M, K] (unit stride along K), weight [E, N, K] of x's dtype (any strides: the
    input gradient passes the transposed view [E, K, N]), offsets int32 [E + 1] on x's device -> [M, N] in
    `out_dtype` (default x's). `config` overrides `_config` (tuning sweeps, the tests)."""
    from hybridengine.kernels.grouped_gemm import grouped_gemm_kernel

    M, K = x.shape
    E, N = weight.shape[0], weight.shape[1]
    assert weight.shape[2] == K and weight.dtype == x.dtype, (x.dtype, weight.shape)
    assert offsets.dtype == torch.int32 and offsets.shape == (E + 1,) and offsets.device == x.device
    y = torch.empty(M, N, dtype=out_dtype or x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    assert x.stride(-1) == 1, x.stride()
    cfg = _launch.launch_config(_config(M, E, N, x.device, x.dtype, exact), config)
    block_m, block_n, block_k = (cfg.pop(key) for key in ("BLOCK_M", "BLOCK_N", "BLOCK_K"))
    grid = (row_tile_slots(M, E, block_m), -(-N // block_n))
    grouped_gemm_kernel[grid](
        x, weight, y, offsets, M, N, K, E, x.stride(0), *weight.stride(), y.stride(0),
        SUM_DOT=_sum_dot(x), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        BLOCK_E=max(16, 1 << max(E - 1, 0).bit_length()), **cfg)
    return y


def grouped_gemm_dw_triton(grad: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor, num_experts: int, *,
                           dtype: torch.dtype | None = None, config: dict | None = None) -> torch.Tensor:
    """The weight-gradient launcher: grad [M, N], x [M, K] (both unit stride along the last dim, one dtype),
    offsets int32 [E + 1] -> dW [E, N, K] in `dtype` (default x's): dW[e] = grad_e^T @ x_e, zeros for an
    expert without rows."""
    from hybridengine.kernels.grouped_gemm import grouped_gemm_dw_kernel

    M, N = grad.shape
    K = x.shape[1]
    assert x.shape[0] == M and grad.dtype == x.dtype, (x.shape, grad.shape, x.dtype, grad.dtype)
    if M == 0:
        return torch.zeros(num_experts, N, K, dtype=dtype or x.dtype, device=x.device)
    assert grad.stride(-1) == 1 and x.stride(-1) == 1, (grad.stride(), x.stride())
    dw = torch.empty(num_experts, N, K, dtype=dtype or x.dtype, device=x.device)
    if dw.numel() == 0:
        return dw
    defaults = DW_CONFIG if x.device.type == "cuda" else DW_INTERPRETER_CONFIG
    cfg = _launch.launch_config(dict(defaults), config)
    block_m, block_n, block_k = (cfg.pop(key) for key in ("BLOCK_M", "BLOCK_N", "BLOCK_K"))
    grid = (-(-N // block_n), -(-K // block_k), num_experts)
    grouped_gemm_dw_kernel[grid](
        grad, x, dw, offsets, N, K, grad.stride(0), x.stride(0), dw.stride(0), dw.stride(1),
        SUM_DOT=_sum_dot(x), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, **cfg)
    return dw


class _GroupedGemm(torch.autograd.Function):
    """The kernel's forward; the backward's dX is the same kernel over weight^T (a view, no copy) and its dW the
    weight-gradient kernel, both deterministic. The gradient is rounded to x's dtype first (as F.linear's
    backward sees it), so an fp32 output's gradient feeds 16-bit GEMMs."""

    @staticmethod
    def forward(ctx, x, weight, offsets, exact, out_dtype):
        ctx.save_for_backward(x, weight, offsets)
        ctx.exact = exact
        return grouped_gemm_triton(x, weight, offsets, exact=exact, out_dtype=out_dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight, offsets = ctx.saved_tensors
        g = grad.to(x.dtype).contiguous()
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = grouped_gemm_triton(g, weight.transpose(1, 2), offsets, exact=ctx.exact)
        if ctx.needs_input_grad[1]:
            grad_w = grouped_gemm_dw_triton(g, x, offsets, weight.shape[0], dtype=weight.dtype)
        return grad_x, grad_w, None, None, None


# -- the torch paths -------------------------------------------------------------------------------------------


def _grouped_ref(x: torch.Tensor, weight: torch.Tensor, sizes: list[int], out_dtype: torch.dtype) -> torch.Tensor:
    """`grouped_gemm_ref` with an output dtype: computed in the wider of x's and `out_dtype` (16-bit inputs with
    an fp32 output: fp32 sums of their exact products, unrounded), then cast."""
    if out_dtype == x.dtype:
        return grouped_gemm_ref(x, weight, sizes)
    compute = torch.promote_types(x.dtype, out_dtype)
    return grouped_gemm_ref(x.to(compute), weight.to(compute), sizes).to(out_dtype)


def _grouped_exact_torch(x: torch.Tensor, weight: torch.Tensor, sizes: list[int],
                         out_dtype: torch.dtype) -> torch.Tensor:
    """Exact mode without the kernel: `linear_exact` per expert (batch-invariant; differentiable)."""
    outs, start = [], 0
    for e, n in enumerate(sizes):
        if n:
            w = weight[e] if weight[e].stride(-1) == 1 else weight[e].contiguous()
            outs.append(linear_exact(x[start:start + n], w, out_dtype=out_dtype))
        start += n
    if not outs:
        return x.new_zeros(0, weight.shape[1], dtype=out_dtype)
    return torch.cat(outs)


# -- the ops -----------------------------------------------------------------------------------------------------


def _run(x: torch.Tensor, weight: torch.Tensor, group_sizes, exact: bool, out_dtype: torch.dtype) -> torch.Tensor:
    """The checked op's body: group_sizes a list of ints or an integer tensor (any device)."""
    if _launch.use_kernel(x):
        if x.dtype not in FLOAT_DTYPES:
            raise ValueError(f"grouped_gemm: x must be one of {FLOAT_DTYPES} for the Triton kernel, got {x.dtype}")
        if isinstance(group_sizes, torch.Tensor):
            ends = group_sizes.to(device=x.device).cumsum(0)
            offsets = torch.cat([ends.new_zeros(1), ends]).to(torch.int32)
        else:
            offsets = torch.tensor([0, *itertools.accumulate(group_sizes)], dtype=torch.int32, device=x.device)
        if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
            return _GroupedGemm.apply(x, weight, offsets, exact, out_dtype)
        return grouped_gemm_triton(x, weight, offsets, exact=exact, out_dtype=out_dtype)
    sizes = group_sizes.tolist() if isinstance(group_sizes, torch.Tensor) else list(group_sizes)
    if x.shape[0] == 0:  # no GEMM runs: an empty product that still reaches x and weight in autograd
        return torch.nn.functional.linear(x.to(out_dtype), weight.sum(0).to(out_dtype))
    if exact:
        return _grouped_exact_torch(x, weight, sizes, out_dtype)
    return _grouped_ref(x, weight, sizes, out_dtype)


def _check(x, weight, group_sizes, exact, out_dtype) -> None:
    op = "grouped_gemm"
    dtypes = FLOAT_DTYPES if exact else (*FLOAT_DTYPES, torch.float64)
    tensor(op, "x", x, dim=2, dtypes=dtypes)
    M, K = x.shape
    tensor(op, "weight", weight, dim=3, dtypes=(x.dtype,), device=x.device)
    if weight.shape[2] != K:
        raise ValueError(f"{op}: weight must be [E, N, K] with K = x.shape[1] = {K}, got shape "
                         f"{tuple(weight.shape)}")
    E = weight.shape[0]
    if isinstance(group_sizes, torch.Tensor):
        if group_sizes.dim() != 1 or group_sizes.dtype.is_floating_point or group_sizes.dtype == torch.bool:
            raise ValueError(f"{op}: group_sizes must be a 1-D integer tensor or a list of ints, got "
                             f"{describe(group_sizes)}")
        # A device tensor's values are not read here: that would cost a host sync every call.
        sizes = group_sizes.tolist() if group_sizes.device.type == "cpu" else None
    elif isinstance(group_sizes, (list, tuple)) and all(is_int(n) for n in group_sizes):
        sizes = list(group_sizes)
    else:
        raise ValueError(f"{op}: group_sizes must be a 1-D integer tensor or a list of ints, got "
                         f"{describe(group_sizes)}")
    if len(group_sizes) != E:
        raise ValueError(f"{op}: group_sizes must have one entry per expert (weight.shape[0] = {E}), got "
                         f"{len(group_sizes)}")
    if sizes is not None and (any(n < 0 for n in sizes) or sum(sizes) != M):
        raise ValueError(f"{op}: group_sizes must be >= 0 and sum to x.shape[0] = {M}, got {sizes}")
    if M >= 2**31:
        raise ValueError(f"{op}: x must have fewer than 2^31 rows (int32 group offsets), got {M}")
    if not isinstance(exact, bool):
        raise ValueError(f"{op}: exact must be a bool, got {describe(exact)}")
    if out_dtype is not None and out_dtype not in dtypes:
        raise ValueError(f"{op}: out_dtype must be None or one of {dtypes}, got {out_dtype!r}")


def grouped_gemm(x: torch.Tensor, weight: torch.Tensor, group_sizes, *, exact: bool = False,
                 out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """y = x_e @ weight[e]^T for each expert's rows: x [M, K] sorted by expert (group_sizes[e] rows of expert e,
    in order), weight [E, N, K] of x's dtype and device (any strides: a view into the flat buffer will do)
    -> [M, N] in `out_dtype` (default x's; fp32 for 16-bit x is the unrounded fp32 sum).

    group_sizes: a list of ints, or a 1-D integer tensor. A list or a CPU tensor is checked (>= 0, summing to
    M); a CUDA tensor is not (its values would need a host sync) and the kernel then never reads or writes
    outside x and y, but rows past the groups' sum are left unwritten. With `exact` the output rows are
    batch-invariant: each row's bits depend on the row, its expert's weight and K, not on the other rows or
    the routing (fp32 accumulation in a fixed K order, one fixed launch, one rounding). Differentiable in x
    and weight (deterministic kernels on the Triton path)."""
    _check(x, weight, group_sizes, exact, out_dtype)
    if x.stride(-1) != 1:
        x = x.contiguous()
    return _run(x, weight, group_sizes, exact, out_dtype or x.dtype)


def _check_mlp(x, gate_up, down, experts, weights, exact, out_dtype, first, num_experts, expert_splits) -> None:
    op = "grouped_mlp"
    tensor(op, "x", x, dim=2, dtypes=FLOAT_DTYPES if exact else (*FLOAT_DTYPES, torch.float64))
    num_tokens, hidden = x.shape
    tensor(op, "gate_up", gate_up, dim=3, dtypes=(x.dtype,), device=x.device)
    E, two_inter = gate_up.shape[0], gate_up.shape[1]
    if two_inter % 2 or gate_up.shape[2] != hidden:
        raise ValueError(f"{op}: gate_up must be [E, 2I, H] with H = x.shape[1] = {hidden}, got shape "
                         f"{tuple(gate_up.shape)}")
    tensor(op, "down", down, shape=(E, hidden, two_inter // 2), dtypes=(x.dtype,), device=x.device)
    tensor(op, "experts", experts, dim=2, dtypes=(torch.int64,), device=x.device)
    if experts.shape[0] != num_tokens or experts.shape[1] < 1:
        raise ValueError(f"{op}: experts must be [N, k] with N = x.shape[0] = {num_tokens} and k >= 1, got shape "
                         f"{tuple(experts.shape)}")
    tensor(op, "weights", weights, shape=tuple(experts.shape), device=x.device, floating=True)
    if not (is_int(num_experts) and is_int(first) and 0 <= first and first + E <= num_experts):
        raise ValueError(f"{op}: first={first!r} and num_experts={num_experts!r} must be ints with 0 <= first and "
                         f"first + gate_up.shape[0] ({E}) <= num_experts")
    # On the CPU the ids are checked; a CUDA tensor's are not (a host sync): an id outside [0, num_experts)
    # there leaves its token's row out of every expert.
    if experts.device.type == "cpu" and experts.numel() and (experts.min() < 0 or experts.max() >= num_experts):
        raise ValueError(f"{op}: experts must be in [0, {num_experts}), got values in "
                         f"[{int(experts.min())}, {int(experts.max())}]")
    if not isinstance(exact, bool):
        raise ValueError(f"{op}: exact must be a bool, got {describe(exact)}")
    if out_dtype not in (None, x.dtype, torch.float32):
        raise ValueError(f"{op}: out_dtype must be None, x's dtype or torch.float32, got {out_dtype}")
    if not (is_int(expert_splits) and 1 <= expert_splits <= num_experts):
        raise ValueError(f"{op}: expert_splits must be an int in [1, num_experts={num_experts}], got "
                         f"{describe(expert_splits)}")


def split_bounds(num_experts: int, splits: int) -> list[int]:
    """The expert ranges [b[s], b[s + 1]) of `grouped_mlp`'s `expert_splits` partial sums."""
    return [num_experts * s // splits for s in range(splits + 1)]


def grouped_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, experts: torch.Tensor,
                weights: torch.Tensor, silu_mul=None, *, exact: bool = False, out_dtype: torch.dtype | None = None,
                first: int = 0, num_experts: int | None = None, expert_splits: int = 1) -> torch.Tensor:
    """`grouped_mlp_ref`'s routed SwiGLU MLP on `grouped_gemm` (same arguments; `exact` as there) -> [N, H].

    Rounding: gate/up is rounded to x's dtype (the activation's input, as in the reference); the down
    projection stays an unrounded fp32 sum (fp64 for fp64 x), is scaled by the routing weight in that
    dtype, and each token's k rows are added in slot order, (r0 + r1) + r2 ..., then rounded once to
    `out_dtype` (default x's dtype; torch.float32 keeps the unrounded sum for a caller that adds more fp32
    terms before it rounds, as exact mode's shared expert).
    No atomics: the rows go back to token order by the inverse permutation, so the result is the same
    bits on every call, and in exact mode a token's output depends only on the token. The routing runs on
    the device without a host sync (a sort and a search over the sorted expert ids).

    Expert parallelism: gate_up/down may hold only the experts [first, first + E') of the router's
    `num_experts` (default E'): experts stays over all of them, and a token's slots routed elsewhere add zero
    (the partial that the expert-parallel all-reduce sums). Running only the own experts' rows reads their
    count on the host (one sync per call). `expert_splits` = S > 1: the slot-order sum runs per range of
    `split_bounds(num_experts, S)` (a slot outside the range adds zero) and the S partials are added in range
    order: the sum's tree when S ranks each hold one range, on a single device too."""
    num_experts = gate_up.shape[0] if num_experts is None else num_experts
    _check_mlp(x, gate_up, down, experts, weights, exact, out_dtype, first, num_experts, expert_splits)
    num_tokens, top_k = experts.shape
    E, hidden = gate_up.shape[0], x.shape[1]
    flat = experts.reshape(-1)
    partial = first != 0 or E != num_experts
    if partial:  # the other ranks' experts sort last, as one more group that no GEMM runs
        local = flat - first
        flat = torch.where((local >= 0) & (local < E), local, E)
    order = torch.argsort(flat, stable=True)
    bounds = torch.searchsorted(flat[order], torch.arange(E + 1, device=flat.device))
    sizes = bounds.diff()
    # Repeat each token k times, then sort: the gather's backward is a permutation (exact) plus a sum over k.
    rows = x.unsqueeze(1).expand(-1, top_k, -1).reshape(-1, hidden)[order]
    if partial:
        rows = rows[:int(bounds[-1])]
    y = expert_mlp(rows, gate_up, down, sizes, silu_mul, exact=exact)
    if partial:
        y = torch.cat([y, y.new_zeros(order.numel() - y.shape[0], hidden)])
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    out = combine_slots(y[inverse].view(num_tokens, top_k, hidden), experts, weights, num_experts, expert_splits)
    return out.to(out_dtype or x.dtype)


def expert_mlp(rows: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, group_sizes, silu_mul=None, *,
               exact: bool = False) -> torch.Tensor:
    """Each expert's SwiGLU MLP on its rows: rows [M, H] grouped by expert (group_sizes[e] rows of expert e, in
    order; a list or an integer tensor), gate_up [E', 2I, H], down [E', H, I] -> the unweighted down projections
    [M, H], unrounded in fp32 (fp64 for fp64 rows); gate/up is rounded to the rows' dtype (the activation's
    input). `grouped_mlp` runs it on the sorted assignments, expert-parallel training on the rows its
    all-to-all brings."""
    inter = gate_up.shape[1] // 2
    gu = _run(rows, gate_up, group_sizes, exact, rows.dtype)
    gate, up = gu[:, :inter], gu[:, inter:]
    act = silu_mul(gate, up) if silu_mul is not None else torch.nn.functional.silu(gate) * up
    acc = torch.float64 if rows.dtype == torch.float64 else torch.float32
    return _run(act.contiguous(), down, group_sizes, exact, acc)


def combine_slots(y: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, num_experts: int,
                  expert_splits: int = 1) -> torch.Tensor:
    """`grouped_mlp`'s sum: y [N, k, H] (each slot's unweighted expert output, fp32 or fp64; zero for a slot
    computed elsewhere), experts int64 [N, k], weights [N, k] -> [N, H] in y's dtype, unrounded: each slot
    times its weight, the slots added in order, (r0 + r1) + r2 ...; with `expert_splits` = S > 1 per range of
    `split_bounds(num_experts, S)` (a slot outside the range adds zero), the S partials added in range order.
    Expert-parallel training combines the rows its all-to-all brings back by the same function."""
    y = y * weights.to(y.dtype).unsqueeze(-1)
    top_k = y.shape[1]
    if expert_splits == 1:
        out = y[:, 0]
        for j in range(1, top_k):
            out = out + y[:, j]
        return out
    inner = torch.tensor(split_bounds(num_experts, expert_splits)[1:-1], device=experts.device)
    split = torch.bucketize(experts.contiguous(), inner, right=True).unsqueeze(-1)  # [N, k, 1]: each slot's range
    out = None
    for s in range(expert_splits):
        part = torch.where(split[:, 0] == s, y[:, 0], 0.0)
        for j in range(1, top_k):
            part = part + torch.where(split[:, j] == s, y[:, j], 0.0)
        out = part if out is None else out + part
    return out


def implementations(device_type: str) -> dict[str, str]:
    """Which implementation each op of this module runs on this device type (for `hybridengine info`)."""
    if device_type == "cuda":
        return {"grouped_gemm": "Triton", "grouped_mlp": "Triton grouped GEMMs"}
    return {"grouped_gemm": "torch reference (exact: linear_exact per expert)",
            "grouped_mlp": "torch reference GEMMs, fixed-order k-sum"}
