"""Triton kernels of the grouped GEMM over experts: y = x_e @ W[e]^T for each expert's rows (forward and the
input gradient), and dW[e] = dY_e^T @ X_e (the weight gradient).

x [M, K] holds the rows of expert 0, then of expert 1, ... ; `Offsets` (int32 [E + 1], on the device) are
the cumulative row counts, offsets[e]..offsets[e + 1] being expert e's rows. The group sizes stay on the
device: nothing in a launch needs them on the host, so a launch costs no host sync and its grid depends on
M, N and E alone, the same launch for every routing of M rows (what a CUDA graph's replay needs).

`grouped_gemm_kernel` runs a 2-D grid: axis 0 over row-tile slots, axis 1 over BLOCK_N column tiles. The
row tiles are each expert's rows cut into BLOCK_M-row tiles, expert by expert; an expert of m rows has
cdiv(m, BLOCK_M) of them, so whatever the routing there are at most min(cdiv(M, BLOCK_M) + E - 1, M) tiles,
and that is axis 0 (`ops.grouped_gemm.row_tile_slots`). A program finds its expert from `Offsets` alone
(`_expert_tile`: every expert's tile count, their running sum, the first expert whose running sum passes
the slot) and returns at once when the slot is past the last tile. Tiles never straddle two experts, so a
tile reads one expert's weight. Few rows (a decode step: M = tokens * k) need no kernel of their own: the
grid is then M slots, each row's tile reads its expert's weight once per column tile, and no program runs
for an expert without rows.

Summation order (what exact mode's batch invariance rests on): one fp32 accumulator from zero, K walked in
k order BLOCK_K columns at a time (the last step masked to zeros), one rounding to the output dtype at the
end. An output element's bits then depend on its x row, its weight row, K and BLOCK_K: not on the other
rows, the tile the row lands in, or the grid, as in `kernels.exact_matmul`. Math as there: bf16/fp16 tiles
feed `tl.dot` with the fp32 accumulator, fp32 tiles take "ieee" dots, and `SUM_DOT` (the interpreter, whose
`tl.dot` sums in a position-dependent order and reads bf16 bits as integers) sums fp32 products with
`tl.sum`. Rounding is `_round` (round to nearest even, also under the interpreter).

`grouped_gemm_dw_kernel` runs one program per (N tile, K tile, expert) and reduces that expert's rows in
row order, BLOCK_M at a time, into one fp32 accumulator: deterministic (no atomics, no split over rows);
an expert without rows gets zeros.

The launchers, checks, autograd and the plain-torch references are in `hybridengine.ops.grouped_gemm`.
"""

import triton
import triton.language as tl

from hybridengine.kernels.elementwise import _round


@triton.jit
def _expert_tile(Offsets, E, slot, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    """Row-tile slot `slot` -> (its expert, the tile's first row, the expert's end row). The expert is E or
    more when the slot is past the last tile."""
    re = tl.arange(0, BLOCK_E)
    live = re < E
    starts = tl.load(Offsets + re, mask=live, other=0)
    ends = tl.load(Offsets + re + 1, mask=live, other=0)
    tiles = (ends - starts + BLOCK_M - 1) // BLOCK_M
    tile_ends = tl.cumsum(tiles, axis=0)
    expert = tl.sum((tile_ends <= slot).to(tl.int32), axis=0)
    mine = re == expert
    first_tile = tl.sum(tl.where(mine, tile_ends - tiles, 0), axis=0)
    row0 = tl.sum(tl.where(mine, starts, 0), axis=0) + (slot - first_tile) * BLOCK_M
    row_end = tl.sum(tl.where(mine, ends, 0), axis=0)
    return expert, row0, row_end


@triton.jit
def _dot_acc(acc, a, b, SUM_DOT: tl.constexpr):
    """acc + a [P, R] @ b [R, Q] in fp32 (see the module docstring for SUM_DOT)."""
    if SUM_DOT:
        acc += tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
    elif a.dtype == tl.float32:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def grouped_gemm_kernel(
    X, W, Y, Offsets, M, N, K, E, stride_xm, stride_we, stride_wn, stride_wk, stride_ym,
    SUM_DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """Y[rows of e] = round(X[rows of e] @ W[e]^T) for every expert e. X [M, K] and Y [M, N] have unit
    stride along K and N; W [E, N, K] any strides (the input gradient passes W[e]^T as a view). Grid:
    (row_tile_slots(M, E, BLOCK_M), cdiv(N, BLOCK_N)); BLOCK_E >= E."""
    expert, row0, row_end = _expert_tile(Offsets, E, tl.program_id(0), BLOCK_M, BLOCK_E)
    if expert >= E:
        return
    rm = row0 + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    row_ok = (rm < row_end) & (rm < M)
    col_ok = rn < N
    # int64 offsets: E * N * K and M * K pass 2^31 at model sizes.
    x_ptrs = X + rm.to(tl.int64)[:, None] * stride_xm + rk[None, :]
    w_ptrs = (W + expert.to(tl.int64) * stride_we + rn.to(tl.int64)[None, :] * stride_wn
              + rk.to(tl.int64)[:, None] * stride_wk)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        k_ok = rk < K - k
        a = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = _dot_acc(acc, a, b, SUM_DOT)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk
    y_ptrs = Y + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :]
    tl.store(y_ptrs, _round(acc, Y.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def grouped_gemm_dw_kernel(
    DY, X, DW, Offsets, N, K, stride_dym, stride_xm, stride_dwe, stride_dwn,
    SUM_DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """DW[e] = round(DY[rows of e]^T @ X[rows of e]) for every expert e: DY [M, N], X [M, K], DW [E, N, K],
    unit stride along N, K and K. Grid: (cdiv(N, BLOCK_N), cdiv(K, BLOCK_K), E)."""
    expert = tl.program_id(2)
    start = tl.load(Offsets + expert)
    end = tl.load(Offsets + expert + 1)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    col_n, col_k = rn < N, rk < K
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for m in range(start, end, BLOCK_M):
        rm = m + tl.arange(0, BLOCK_M)
        row_ok = rm < end
        dy_t = tl.load(DY + rm.to(tl.int64)[None, :] * stride_dym + rn[:, None],
                       mask=col_n[:, None] & row_ok[None, :], other=0.0)
        x = tl.load(X + rm.to(tl.int64)[:, None] * stride_xm + rk[None, :],
                    mask=row_ok[:, None] & col_k[None, :], other=0.0)
        acc = _dot_acc(acc, dy_t, x, SUM_DOT)
    dw_ptrs = DW + expert.to(tl.int64) * stride_dwe + rn.to(tl.int64)[:, None] * stride_dwn + rk[None, :]
    tl.store(dw_ptrs, _round(acc, DW.dtype.element_ty), mask=col_n[:, None] & col_k[None, :])
