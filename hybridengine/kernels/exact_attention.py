"""Triton kernels of exact attention: the training forward, the rollout prefill and the rollout decode give a
query the same bits, whatever else is in the batch and however long its sequence runs on.

Both forward kernels feed one shared tile function, `_online_softmax_tile`, with a [BLOCK_M, BLOCK_D] tile of
query rows and a K/V tile of BLOCK_N keys, and differ only in what the rows are and where the keys come from:

- `exact_varlen_kernel`: one program per (query tile, sequence, query head); the rows are BLOCK_M
  consecutive query positions of one head; K/V are dense packed rows, the sequence's own tokens or a
  longer context whose last tokens are the queries (a prefill after a cached prefix: the query tile then
  starts anywhere, the key tiles stay at multiples of BLOCK_N from the context's start).
- `exact_decode_kernel`: one program per (sequence, kv head, block of the GQA group); the rows are the
  group's query heads (padded to BLOCK_M), all at the sequence's last position; K/V come from the paged cache,
  each token's page from its own block-table entry (`paged_attention._kv_tile`). No split-K: one program
  visits the whole context.

A row's result then depends on nothing but the row itself:
- Key tiles sit at fixed positions from the sequence's start (multiples of BLOCK_N) and are visited in
  increasing order, from a tile at or before the row's first visible key to one at or after its own position.
- A tile with no visible key for a row leaves its (m, l, acc) bit for bit as they were: before any visible key
  m = -inf, so m_safe = 0, alpha = exp2(-inf) = 0, p = 0, and l = 0 * 0 + 0, acc = 0 * 0 + sum of 0 * v stay
  zero; after one, the row max is -inf, so m_new = m, alpha = exp2(m - m) = exp2(0) = 1 exactly, p = 0, and
  l + 0, acc + sum of 0 * v are l and acc. The one thing a zero product can move is the sign of an exact zero
  (-0 + +0 = +0), so the output maps -0 to +0 (`tl.where(out == 0, 0, out)`).
- Each element of a `tl.dot` is its row of A against its column of B, summed in an order that the launch's
  constexprs fix, not the row's index; the row reductions (max, sum) follow the same layout in both kernels.
  Both kernels therefore take the same BLOCK_M, BLOCK_N, BLOCK_D and num_warps (the MMA instruction and
  layouts), and compute the mask in the tile function from per-row positions, so the mask, scale and
  softmax compile alike. num_stages may differ: pipelining moves loads, not arithmetic.

Math: fp32 after the loads; S = Q.K^T with 16-bit operands straight into `tl.dot` (exact products, fp32 sums)
or "ieee" fp32 dots for fp32 inputs (`_dot_in`; the interpreter takes elementwise products instead); online
softmax in base 2 with the scale folded into log2(e); P enters P.V rounded once to the input dtype (8 significant
bits for bf16, flash-attention's training numerics; the exactness comes from the order, so `paged_attention`'s
hi/lo split of P would buy accuracy for a second P.V MMA in every tile of the training forward too); acc / l
rounded once to the output dtype.
The varlen kernel also writes each row's base-2 logsumexp m + log2(l) for the backward.

Backward (no exactness contract, deterministic: no atomics): `exact_bwd_dkdv_kernel`, one program per
(key tile, sequence, kv head), sums dK and dV over the group's query heads and the query tiles in a fixed
order; `exact_bwd_dq_kernel`, one program per (query tile, sequence, query head), sums dQ over the key tiles.
Both recompute P = exp2(S - lse) and dS = P * (dP - delta) with delta = rowsum(dO * O) (FA2).

The launchers, checks and references are in `hybridengine.ops.exact_attention`.
"""

import triton
import triton.language as tl

from .paged_attention import _kv_tile


@triton.jit
def _dot_in(a, b, acc, DOT_16BIT: tl.constexpr, ROWWISE_DOT: tl.constexpr):
    """acc + a @ b with fp32 accumulation (acc None: from zero): 16-bit operands straight into `tl.dot` (exact
    products, fp32 sums), or fp32 ones in "ieee" dots (on the GPU a chain of FMAs per element, in k order).
    ROWWISE_DOT (the interpreter): fp32 products and a sum over k per element instead, the same products: the
    interpreter's `tl.dot` is numpy's BLAS sgemm, whose sum for a row depends on the row's index in the tile (an
    edge micro-kernel), and its bf16 dot is wrong."""
    if ROWWISE_DOT:
        out = tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], 1)
        if acc is not None:
            out = acc + out
    elif DOT_16BIT:
        out = tl.dot(a, b, acc)
    else:
        out = tl.dot(a, b, acc, input_precision="ieee")
    return out


@triton.jit
def _online_softmax_tile(m, l, acc, q, k, v, t, pos, window, scale_log2,
                         DOT_16BIT: tl.constexpr, ROWWISE_DOT: tl.constexpr):
    """One tile of keys at positions t [BLOCK_N] (K, V [BLOCK_N, BLOCK_D]) into the online softmax (m, l, acc)
    of query rows at positions pos [BLOCK_M]: a row sees keys pos - window < t <= pos."""
    s = _dot_in(q, tl.trans(k), None, DOT_16BIT, ROWWISE_DOT)
    visible = (t[None, :] <= pos[:, None]) & (t[None, :] > pos[:, None] - window)
    s = tl.where(visible, s * scale_log2, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet: -inf - 0
    alpha = tl.exp2(m - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l = l * alpha + tl.sum(p, 1)
    acc = _dot_in(p.to(v.dtype), v, acc * alpha[:, None], DOT_16BIT, ROWWISE_DOT)
    return m_new, l, acc


@triton.jit
def _normalised(acc, l):
    """acc / l (a row that saw nothing: zeros), with -0 mapped to +0 (see the module docstring)."""
    out = acc / tl.where(l == 0.0, 1.0, l)[:, None]
    return tl.where(out == 0.0, 0.0, out)


@triton.jit
def exact_varlen_kernel(
    Q, K, V, Cu_seqlens, Cu_seqlens_k, Out, Lse,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_lse_h,
    scale_log2, window,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_16BIT: tl.constexpr, ROWWISE_DOT: tl.constexpr,
):
    m_block = tl.program_id(0)
    seq = tl.program_id(1).to(tl.int64)
    head = tl.program_id(2)
    start = tl.load(Cu_seqlens + seq)
    seq_len = tl.load(Cu_seqlens + seq + 1) - start  # queries
    k_start = tl.load(Cu_seqlens_k + seq)
    k_len = tl.load(Cu_seqlens_k + seq + 1) - k_start  # keys: the queries are the last seq_len of them
    m0 = m_block * BLOCK_M
    if m0 >= seq_len:  # the grid covers the longest sequence; shorter ones have idle tiles
        return
    kv_head = head // GROUP

    i = m0 + tl.arange(0, BLOCK_M)
    row_ok = i < seq_len
    pos = k_len - seq_len + i  # the rows' key positions
    p0 = k_len - seq_len + m0
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    rows = (start + i).to(tl.int64)
    q = tl.load(Q + rows[:, None] * stride_qt + head * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    lo = tl.maximum(p0 - window + 1, 0) // BLOCK_N * BLOCK_N  # the tile of the first row's first visible key
    hi = tl.minimum(k_len, p0 + BLOCK_M)                       # one past the last row's own position
    for t0 in range(lo, hi, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        keys = (k_start + t).to(tl.int64)
        kv_mask = (t < k_len)[:, None] & d_ok[None, :]
        k = tl.load(K + keys[:, None] * stride_kt + kv_head * stride_kh + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(V + keys[:, None] * stride_vt + kv_head * stride_vh + d[None, :], mask=kv_mask, other=0.0)
        m, l, acc = _online_softmax_tile(m, l, acc, q, k, v, t, pos, window, scale_log2,
                                         DOT_16BIT, ROWWISE_DOT)

    out = _normalised(acc, l)
    tl.store(Out + rows[:, None] * stride_ot + head * stride_oh + d[None, :], out.to(Out.dtype.element_ty),
             mask=row_ok[:, None] & d_ok[None, :])
    # every row of a self-attention sees its own key, so l > 0
    tl.store(Lse + head * stride_lse_h + rows, m + tl.log2(tl.where(l == 0.0, 1.0, l)), mask=row_ok)


@triton.jit
def exact_decode_kernel(
    Q, K_cache, V_cache, Block_tables, Context_lens, Out,
    stride_qb, stride_qh,
    stride_kc_block, stride_kc_slot, stride_kc_head,
    stride_vc_block, stride_vc_slot, stride_vc_head,
    stride_bt_b, stride_ob, stride_oh,
    scale_log2, window, max_blocks,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_16BIT: tl.constexpr, ROWWISE_DOT: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    g = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)  # rows: the group's query heads

    ctx = tl.load(Context_lens + seq)
    pos = tl.zeros([BLOCK_M], tl.int32) + (ctx - 1)  # every row at the sequence's last position
    first = tl.maximum(ctx - window, 0)
    row_ok = g < GROUP
    heads = kv_head * GROUP + g
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(Q + seq * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_row = Block_tables + seq * stride_bt_b
    k_base = K_cache + kv_head * stride_kc_head
    v_base = V_cache + kv_head * stride_vc_head
    for t0 in range(first // BLOCK_N * BLOCK_N, ctx, BLOCK_N):  # context 0 (a padding row): no tile, zeros
        k, v, _ = _kv_tile(k_base, v_base, bt_row, t0, first, ctx, max_blocks, d, d_ok,
                           stride_kc_block, stride_kc_slot, stride_vc_block, stride_vc_slot, PAGE_SIZE, BLOCK_N)
        t = t0 + tl.arange(0, BLOCK_N)
        m, l, acc = _online_softmax_tile(m, l, acc, q, k, v, t, pos, window, scale_log2,
                                         DOT_16BIT, ROWWISE_DOT)

    out = _normalised(acc, l)
    tl.store(Out + seq * stride_ob + heads[:, None] * stride_oh + d[None, :], out.to(Out.dtype.element_ty),
             mask=row_ok[:, None] & d_ok[None, :])


# --------------------------------------------------------------------------------------------------
# backward


@triton.jit
def _probs_and_dscores(q, k, v, do, lse, delta, pos, row_ok, t, t_ok, window, scale_log2,
                       DOT_16BIT: tl.constexpr, ROWWISE_DOT: tl.constexpr):
    """P [BLOCK_M, BLOCK_N] recomputed from the forward's logsumexp (zero where masked) and
    dS = P * (dP - delta), dP = dO.V^T: the gradient with respect to the unscaled scores q.k."""
    s = _dot_in(q, tl.trans(k), None, DOT_16BIT, ROWWISE_DOT) * scale_log2
    visible = (row_ok[:, None] & t_ok[None, :] & (t[None, :] <= pos[:, None])
               & (t[None, :] > pos[:, None] - window))
    p = tl.where(visible, tl.exp2(s - lse[:, None]), 0.0)
    dp = _dot_in(do, tl.trans(v), None, DOT_16BIT, ROWWISE_DOT)
    return p, p * (dp - delta[:, None])


@triton.jit
def exact_bwd_dkdv_kernel(
    Q, K, V, DO, Lse, Delta, Cu_seqlens, DK, DV,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_dkt, stride_dkh, stride_dvt, stride_dvh, stride_lse_h,
    scale, scale_log2, window,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_16BIT: tl.constexpr, ROWWISE_DOT: tl.constexpr,
):
    n_block = tl.program_id(0)
    seq = tl.program_id(1).to(tl.int64)
    kv_head = tl.program_id(2)
    start = tl.load(Cu_seqlens + seq)
    seq_len = tl.load(Cu_seqlens + seq + 1) - start
    n0 = n_block * BLOCK_N
    if n0 >= seq_len:
        return
    t = n0 + tl.arange(0, BLOCK_N)
    t_ok = t < seq_len
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    keys = (start + t).to(tl.int64)
    kv_mask = t_ok[:, None] & d_ok[None, :]
    k = tl.load(K + keys[:, None] * stride_kt + kv_head * stride_kh + d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(V + keys[:, None] * stride_vt + kv_head * stride_vh + d[None, :], mask=kv_mask, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    # queries that see a key of this tile: n0 <= i < n0 + BLOCK_N - 1 + window
    lo = n0 // BLOCK_M * BLOCK_M
    hi = tl.minimum(seq_len, n0 + BLOCK_N - 1 + window)
    for g in range(GROUP):
        head = kv_head * GROUP + g
        for m0 in range(lo, hi, BLOCK_M):
            pos = m0 + tl.arange(0, BLOCK_M)
            row_ok = pos < seq_len
            rows = (start + pos).to(tl.int64)
            q_mask = row_ok[:, None] & d_ok[None, :]
            q = tl.load(Q + rows[:, None] * stride_qt + head * stride_qh + d[None, :], mask=q_mask, other=0.0)
            do = tl.load(DO + rows[:, None] * stride_dot + head * stride_doh + d[None, :], mask=q_mask, other=0.0)
            lse = tl.load(Lse + head * stride_lse_h + rows, mask=row_ok, other=0.0)
            delta = tl.load(Delta + head * stride_lse_h + rows, mask=row_ok, other=0.0)
            p, ds = _probs_and_dscores(q, k, v, do, lse, delta, pos, row_ok, t, t_ok, window, scale_log2,
                                       DOT_16BIT, ROWWISE_DOT)
            dv = _dot_in(tl.trans(p.to(do.dtype)), do, dv, DOT_16BIT, ROWWISE_DOT)
            dk = _dot_in(tl.trans(ds.to(q.dtype)), q, dk, DOT_16BIT, ROWWISE_DOT)
    tl.store(DK + keys[:, None] * stride_dkt + kv_head * stride_dkh + d[None, :],
             (dk * scale).to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + keys[:, None] * stride_dvt + kv_head * stride_dvh + d[None, :],
             dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def exact_bwd_dq_kernel(
    Q, K, V, DO, Lse, Delta, Cu_seqlens, DQ,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_dqt, stride_dqh, stride_lse_h,
    scale, scale_log2, window,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_16BIT: tl.constexpr, ROWWISE_DOT: tl.constexpr,
):
    m_block = tl.program_id(0)
    seq = tl.program_id(1).to(tl.int64)
    head = tl.program_id(2)
    start = tl.load(Cu_seqlens + seq)
    seq_len = tl.load(Cu_seqlens + seq + 1) - start
    m0 = m_block * BLOCK_M
    if m0 >= seq_len:
        return
    kv_head = head // GROUP
    pos = m0 + tl.arange(0, BLOCK_M)
    row_ok = pos < seq_len
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    rows = (start + pos).to(tl.int64)
    q_mask = row_ok[:, None] & d_ok[None, :]
    q = tl.load(Q + rows[:, None] * stride_qt + head * stride_qh + d[None, :], mask=q_mask, other=0.0)
    do = tl.load(DO + rows[:, None] * stride_dot + head * stride_doh + d[None, :], mask=q_mask, other=0.0)
    lse = tl.load(Lse + head * stride_lse_h + rows, mask=row_ok, other=0.0)
    delta = tl.load(Delta + head * stride_lse_h + rows, mask=row_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    lo = tl.maximum(m0 - window + 1, 0) // BLOCK_N * BLOCK_N
    hi = tl.minimum(seq_len, m0 + BLOCK_M)
    for t0 in range(lo, hi, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        t_ok = t < seq_len
        keys = (start + t).to(tl.int64)
        kv_mask = t_ok[:, None] & d_ok[None, :]
        k = tl.load(K + keys[:, None] * stride_kt + kv_head * stride_kh + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(V + keys[:, None] * stride_vt + kv_head * stride_vh + d[None, :], mask=kv_mask, other=0.0)
        _, ds = _probs_and_dscores(q, k, v, do, lse, delta, pos, row_ok, t, t_ok, window, scale_log2,
                                   DOT_16BIT, ROWWISE_DOT)
        dq = _dot_in(ds.to(k.dtype), k, dq, DOT_16BIT, ROWWISE_DOT)
    tl.store(DQ + rows[:, None] * stride_dqt + head * stride_dqh + d[None, :],
             (dq * scale).to(DQ.dtype.element_ty), mask=q_mask)
