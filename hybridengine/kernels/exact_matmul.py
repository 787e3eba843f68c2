"""Triton kernel of `linear_exact`: y = x @ w^T (+ bias) whose every output element's bits depend only on
its x row, its weight row, its bias, K and the number of K splits.

`exact_matmul_kernel` runs one program per [BLOCK_M, BLOCK_N] output tile, in grouped order (GROUP_M
row tiles share each run of column tiles, so their weight tiles are reused from L2). A tile's K range is
cut into `k_splits` equal consecutive splits. Each split starts a fresh fp32 accumulator at zero and
walks its range in k order, BLOCK_K columns at a time (`tl.dot` with the accumulator; the last tile of a
split is masked to zeros when BLOCK_K does not divide the split's length); the splits' sums are added in
split order, (p0 + p1) + p2 ..., then the bias (as fp32), then one rounding to the output dtype. Nothing
in that order depends on BLOCK_M, BLOCK_N, the grid or the other rows and columns: there is no split-K
across programs and no atomics, and a row's tiles are the same whatever tile and position it lands in.
BLOCK_K is part of the order and is fixed by the launcher (`EXACT_BLOCK_K`).

Because each split is reduced from zero relative to its own start, a rank that holds columns
[s * K / S, (s + 1) * K / S) of x and w computes, with one split and an fp32 output, exactly split s's
sum of the single-device S-split launch (tensor parallelism over K).

Math: bf16/fp16 tiles feed `tl.dot` directly with the fp32 accumulator (the products are exact in fp32);
fp32 tiles take "ieee" dots. `SUM_DOT` (set under the interpreter) replaces the dot by fp32 products of
upcast tiles summed over k with `tl.sum`: the interpreter's `tl.dot` is numpy's BLAS matmul, whose sum
order for one element changes with the row's place in the tile (and its bf16 dot reads the operands'
bits as integers), while numpy sums a [BLOCK_M, BLOCK_K, BLOCK_N] product over its middle axis k by k
for every element alike. The output is rounded to nearest even as torch rounds
(`kernels.elementwise._round`, exact also under the interpreter, whose bf16 cast truncates).

The launcher, its checks, the batch-invariant torch path and the reference are in
`hybridengine.ops.exact_linear`.
"""

import triton
import triton.language as tl

from hybridengine.kernels.elementwise import _round


@triton.jit
def _split_sum(x_ptrs, w_ptrs, rk, split_k, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, SUM_DOT: tl.constexpr):
    """One split's fp32 sum from zero: x tiles [BLOCK_M, BLOCK_K] at x_ptrs times w^T tiles
    [BLOCK_K, BLOCK_N] at w_ptrs, k ascending over split_k columns (EVEN_K: BLOCK_K divides split_k,
    no mask). SUM_DOT (the interpreter): each tile's products summed over k by `tl.sum`, see the
    module docstring."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, split_k, BLOCK_K):
        if EVEN_K:
            a = tl.load(x_ptrs)
            b = tl.load(w_ptrs)
        else:
            a = tl.load(x_ptrs, mask=rk[None, :] < split_k - k, other=0.0)
            b = tl.load(w_ptrs, mask=rk[:, None] < split_k - k, other=0.0)
        if SUM_DOT:
            acc += tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
        elif a.dtype == tl.float32:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    return acc


@triton.jit
def exact_matmul_kernel(
    X, W, Bias, Y, M, N, split_k, k_splits, stride_xm, stride_wn, stride_ym,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, SUM_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """Y[M, N] = round(sum over splits of X[M, split] @ W[N, split]^T, + Bias) with K = k_splits * split_k;
    X and W have unit stride along K, Y along N. A 1-D grid of cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N)
    programs, GROUP_M row tiles per group."""
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pids_per_group = GROUP_M * num_pid_n
    first_pid_m = (pid // pids_per_group) * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (pid % pids_per_group) % group_rows
    pid_n = (pid % pids_per_group) // group_rows

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    # Rows and columns past the end wrap around to the first ones (unmasked loads of valid addresses);
    # their results are never stored. Offsets in int64: the LM head's rows x K and M x N pass 2^31.
    x_ptrs = X + (rm % M).to(tl.int64)[:, None] * stride_xm + rk[None, :]
    w_ptrs = W + (rn % N).to(tl.int64)[None, :] * stride_wn + rk[:, None]

    total = _split_sum(x_ptrs, w_ptrs, rk, split_k, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, SUM_DOT)
    for s in range(1, k_splits):
        start = s * split_k  # < K, which fits int32
        total = total + _split_sum(x_ptrs + start, w_ptrs + start, rk, split_k, BLOCK_M, BLOCK_N, BLOCK_K,
                                   EVEN_K, SUM_DOT)
    if HAS_BIAS:
        total = total + tl.load(Bias + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    y_ptrs = Y + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :]
    tl.store(y_ptrs, _round(total, Y.dtype.element_ty), mask=(rm < M)[:, None] & (rn < N)[None, :])
