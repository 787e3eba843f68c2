"""Triton kernel of the decode step's linear layers: out[M, N] = x[M, K] @ w[N, K]^T (+ bias), M small.

At decode batch sizes (M <= 256 rows) a projection is a read of its weight, and the small ones of a
1.5B model (qkv 6.3 MB, o 4.7 MB) leave most SMs idle in cuBLAS's tiling (~1 TB/s on an H200).
`decode_linear_kernel` runs one program per (BLOCK_N columns, BLOCK_M rows, K split): each reads its
[BLOCK_N, K / SPLIT_K] slice of w once and the matching [BLOCK_M, K / SPLIT_K] slice of x (L2-resident).

With SPLIT_K > 1 the splits' fp32 partial tiles go to a workspace and a per-tile counter counts the
arrivals; the program that arrives last (atomic add, acquire-release at GPU scope, after a CTA barrier
so every thread's partial store is ordered before it) sums the SPLIT_K partials in split order, adds
the bias, rounds once to the output dtype and resets the counter to 0, so one launch does the work of
cuBLAS's split-K GEMM plus its separate reduce kernel, and the counters are zero again for the next
launch (CUDA-graph replays included). The partials are read with `.cg` (L2, not the SM's L1, which
may hold lines of an earlier launch). The sum order is fixed (split 0, 1, ...), so results do not
depend on which program arrives last.

Math: fp32 accumulation of exact bf16/fp16 products (`tl.dot` on the 16-bit tiles; fp32 inputs take
"ieee"); UPCAST runs the same products from fp32 copies for the interpreter, whose bf16 `tl.dot` is wrong
(see kernels/paged_attention.py). The launcher, checks, reference and launch plan are in
`hybridengine.linear`.
"""

import triton
import triton.language as tl

from .elementwise import _round


@triton.jit
def decode_linear_kernel(
    X, W, Bias, Out, Part, Count,
    M, N, K, stride_xm, stride_wn, stride_om, k_per_split, m_pad, n_pad,
    HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    split = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    k_lo = split * k_per_split
    k_hi = tl.minimum(K, k_lo + k_per_split)
    x_rows = X + rm.to(tl.int64)[:, None] * stride_xm
    w_rows = W + rn.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < k_hi
        x = tl.load(x_rows + rk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_rows + rk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if UPCAST:
            acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)

    if SPLIT_K > 1:
        tile = pid_m * tl.num_programs(0) + pid_n
        cell = rm[:, None] * n_pad + rn[None, :]  # [m_pad, n_pad] per split: every tile is in bounds
        tl.store(Part + split * m_pad * n_pad + cell, acc)
        tl.debug_barrier()  # every thread's partial is stored before this program's arrival is counted
        arrived = tl.atomic_add(Count + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:  # the last split of this tile: merge in split order
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for s in range(SPLIT_K):
                acc += tl.load(Part + s * m_pad * n_pad + cell, cache_modifier=".cg")
            tl.atomic_xchg(Count + tile, 0)
            if HAS_BIAS:
                acc += tl.load(Bias + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            tl.store(Out + rm.to(tl.int64)[:, None] * stride_om + rn[None, :], _round(acc, Out.dtype.element_ty),
                     mask=m_ok[:, None] & n_ok[None, :])
    else:
        if HAS_BIAS:
            acc += tl.load(Bias + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(Out + rm.to(tl.int64)[:, None] * stride_om + rn[None, :], _round(acc, Out.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])
