"""Triton kernel of prefill attention over packed variable-length sequences (flash-attention 2 style).

One program per (query tile of BLOCK_M rows, sequence, query head). Sequence b owns query rows
cu_seqlens_q[b] .. cu_seqlens_q[b+1] and keys K, V [total_k, num_kv_heads, D] at rows
cu_seqlens_k[b] .. cu_seqlens_k[b+1]; the mask is causal and bottom-right aligned: query row i sits at
key position len_k - len_q + i and sees keys j with i + len_k - len_q - window < j <= i + len_k - len_q
(window 2^30 when there is none).

Math as in `paged_attention`, online base-2 softmax in fp32. `DOT_16BIT` (bf16/fp16 inputs): both
`tl.dot`s on the 16-bit tiles with fp32 accumulation, S = Q.K^T exact products; P enters P.V rounded
once to the input dtype (flash-attention's P, 8 significant bits for bf16; the decode kernel splits P
in two instead). fp32 inputs (`DOT_16BIT` False) take fp32 "ieee" dots.
The launcher, checks and reference are in `hybridengine.ops.prefill_attention`.
"""

import triton
import triton.language as tl

from .paged_attention import _dot_16bit


@triton.jit
def _tile(m, l, acc, q, t0, pos, d, d_ok, len_k, window, K, V, k_start, kv_head,
          stride_kt, stride_kh, stride_vt, stride_vh, scale_log2,
          MASKED: tl.constexpr, BLOCK_N: tl.constexpr, DOT_16BIT: tl.constexpr, UPCAST_BF16_DOT: tl.constexpr):
    """One K/V tile of keys t0 .. t0 + BLOCK_N - 1 into the online softmax (m, l, acc). MASKED: the causal /
    window / length mask per (row, key); without it every key of the tile is visible to every row."""
    t = t0 + tl.arange(0, BLOCK_N)
    t_ok = (t >= 0) & (t < len_k)
    k_off = (k_start + t).to(tl.int64) * stride_kt
    v_off = (k_start + t).to(tl.int64) * stride_vt
    kv_mask = t_ok[:, None] & d_ok[None, :]
    k = tl.load(K + k_off[:, None] + kv_head * stride_kh + d[None, :], mask=kv_mask, other=0.0)
    if DOT_16BIT:
        s = _dot_16bit(q, tl.trans(k), None, UPCAST_BF16_DOT) * scale_log2
    else:
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale_log2  # fp32 inputs
    if MASKED:
        visible = t_ok[None, :] & (t[None, :] <= pos[:, None]) & (t[None, :] > pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet stays 0
    alpha = tl.exp2(m - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l = l * alpha + tl.sum(p, 1)
    v = tl.load(V + v_off[:, None] + kv_head * stride_vh + d[None, :], mask=kv_mask, other=0.0)
    if DOT_16BIT:
        acc = _dot_16bit(p.to(v.dtype), v, acc * alpha[:, None], UPCAST_BF16_DOT)
    else:
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
    return m_new, l, acc


@triton.jit
def prefill_attention_kernel(
    Q, K, V, Cu_seqlens_q, Cu_seqlens_k, Out,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    scale_log2, window,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_16BIT: tl.constexpr, UPCAST_BF16_DOT: tl.constexpr,
):
    m_block = tl.program_id(0)
    seq = tl.program_id(1).to(tl.int64)
    head = tl.program_id(2)
    q_start = tl.load(Cu_seqlens_q + seq)
    len_q = tl.load(Cu_seqlens_q + seq + 1) - q_start
    m0 = m_block * BLOCK_M
    if m0 >= len_q:  # the grid covers the longest sequence; shorter ones have idle tiles
        return
    k_start = tl.load(Cu_seqlens_k + seq)
    len_k = tl.load(Cu_seqlens_k + seq + 1) - k_start
    shift = len_k - len_q  # bottom-right alignment: earlier keys (a cached prefix, earlier chunks) come first
    kv_head = head // GROUP

    rows = m0 + tl.arange(0, BLOCK_M)
    row_ok = rows < len_q
    pos = rows + shift
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q_rows = (q_start + rows).to(tl.int64)
    q = tl.load(Q + q_rows[:, None] * stride_qt + head * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    hi = tl.minimum(len_k, m0 + BLOCK_M + shift)  # one past the last row's own position
    lo = tl.maximum(m0 + shift - window + 1, 0)   # the first row's first visible key
    lo = (lo // BLOCK_N) * BLOCK_N
    # Tiles [full_lo, full_hi) are visible to every row of this query tile (past each row's window start,
    # at or before each row's own position): they skip the mask. The ones before and after take it.
    full_lo = tl.minimum(tl.maximum(lo, tl.cdiv(m0 + BLOCK_M - 1 + shift - window + 1, BLOCK_N) * BLOCK_N), hi)
    full_hi = tl.maximum(tl.minimum((m0 + shift + 1) // BLOCK_N * BLOCK_N, hi), full_lo)
    full_hi = tl.where(m0 + shift + 1 > 0, full_hi, full_lo)  # rows that see no key (len_k < len_q): no full tile
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for t0 in range(lo, full_lo, BLOCK_N):
        m, l, acc = _tile(m, l, acc, q, t0, pos, d, d_ok, len_k, window, K, V, k_start, kv_head,
                          stride_kt, stride_kh, stride_vt, stride_vh, scale_log2, True, BLOCK_N,
                          DOT_16BIT, UPCAST_BF16_DOT)
    for t0 in range(full_lo, full_hi, BLOCK_N):
        m, l, acc = _tile(m, l, acc, q, t0, pos, d, d_ok, len_k, window, K, V, k_start, kv_head,
                          stride_kt, stride_kh, stride_vt, stride_vh, scale_log2, False, BLOCK_N,
                          DOT_16BIT, UPCAST_BF16_DOT)
    for t0 in range(tl.maximum(full_hi, lo), hi, BLOCK_N):
        m, l, acc = _tile(m, l, acc, q, t0, pos, d, d_ok, len_k, window, K, V, k_start, kv_head,
                          stride_kt, stride_kh, stride_vt, stride_vh, scale_log2, True, BLOCK_N,
                          DOT_16BIT, UPCAST_BF16_DOT)

    out = acc / tl.where(l == 0.0, 1.0, l)[:, None]  # a row that sees no key (len_k < len_q): zeros
    tl.store(Out + q_rows[:, None] * stride_ot + head * stride_oh + d[None, :], out.to(Out.dtype.element_ty),
             mask=row_ok[:, None] & d_ok[None, :])
