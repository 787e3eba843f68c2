"""Triton kernels of paged decode attention: one query token per sequence over its paged K/V.

`paged_decode_kernel` runs one program per (kv head, sequence, context partition). The GQA group
(the `GROUP` query heads that share one kv head) is the M dimension of both `tl.dot`s, padded to
at least 16 rows, so every K/V tile is read once per kv head and feeds the tensor cores:
S = Q[GROUP_PAD, D] @ K^T[D, BLOCK_N], O += P[GROUP_PAD, BLOCK_N] @ V[BLOCK_N, D]. A K/V tile of
BLOCK_N tokens may span several cache blocks (pages): each token's address comes from its own
block-table entry, so BLOCK_N and the page size are independent.

With `SPLIT`, each program covers one partition of the context (flash-decoding) and writes its
unnormalised accumulator, running max and exp-sum; `paged_decode_reduce_kernel` merges the
partitions. Without it, the one partition is the whole context and the output is written directly.

Math: loads are upcast to fp32. `tl.dot` on fp32 operands runs TF32 tensor cores on GPU
(`DOT_PRECISION="tf32"`, chosen by the launcher for bf16/fp16 inputs): bf16 and fp16 values are
exact in TF32, so Q.K^T is exact products with fp32 accumulation, and only P is rounded to TF32
(flash-attn rounds it to bf16). fp32 inputs use "ieee". Softmax is online, in base 2 with the
scale folded into log2(e).

The launcher, its checks and the reference are in `hybridengine.attention`.
"""

import triton
import triton.language as tl


@triton.jit
def paged_decode_kernel(
    Q, K_cache, V_cache, Block_tables, Context_lens,
    Out, Acc_part, M_part, L_part,
    stride_qb, stride_qh,
    stride_kc_block, stride_kc_slot, stride_kc_head,
    stride_vc_block, stride_vc_slot, stride_vc_head,
    stride_bt_b, stride_ob, stride_oh,
    scale_log2, window, max_blocks, partition_size, num_partitions,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    kv_head = tl.program_id(0)
    seq = tl.program_id(1).to(tl.int64)
    part = tl.program_id(2)

    ctx = tl.load(Context_lens + seq)
    # Sliding window: the query at position ctx-1 sees keys ctx-window .. ctx-1 (no window: 2^30).
    start = tl.maximum(ctx - window, 0)
    part_lo = part * partition_size
    # The last partition runs to the end of the context, so a max_context_len hint that is too small
    # costs time, never keys.
    part_hi = tl.where(part == num_partitions - 1, ctx, part_lo + partition_size)
    hi = tl.minimum(part_hi, ctx)
    # Tiles are aligned to BLOCK_N; partition_size is a multiple of BLOCK_N, so a tile never straddles
    # two partitions and every tile the loop visits holds at least one visible key.
    lo = tl.maximum(part_lo, (start // BLOCK_N) * BLOCK_N)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g
    row_ok = g < GROUP
    d_ok = d < HEAD_DIM
    q = tl.load(Q + seq * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)

    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
    bt_row = Block_tables + seq * stride_bt_b
    for t0 in range(lo, hi, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        page_idx = t // PAGE_SIZE
        t_ok = (t >= start) & (t < hi) & (page_idx < max_blocks)  # entries past the context are never read
        page = tl.load(bt_row + page_idx, mask=t_ok, other=0).to(tl.int64)
        slot = t % PAGE_SIZE
        kv_mask = t_ok[:, None] & d_ok[None, :]
        k = tl.load(K_cache + page[:, None] * stride_kc_block + slot[:, None] * stride_kc_slot
                    + kv_head * stride_kc_head + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        s = tl.where(t_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet stays 0
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l = l * alpha + tl.sum(p, 1)
        v = tl.load(V_cache + page[:, None] * stride_vc_block + slot[:, None] * stride_vc_slot
                    + kv_head * stride_vc_head + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
        m = m_new

    out_mask = row_ok[:, None] & d_ok[None, :]
    if SPLIT:
        # [B, num_q_heads, num_partitions(, D)] fp32, contiguous; an empty partition writes m=-inf, l=0.
        row = (seq * (GROUP * tl.num_programs(0)) + heads) * num_partitions + part
        tl.store(Acc_part + row[:, None] * BLOCK_D + d[None, :], acc, mask=out_mask)
        tl.store(M_part + row, m, mask=row_ok)
        tl.store(L_part + row, l, mask=row_ok)
    else:
        out = acc / tl.where(l == 0.0, 1.0, l)[:, None]  # context 0 (a padding row): zeros
        tl.store(Out + seq * stride_ob + heads[:, None] * stride_oh + d[None, :],
                 out.to(Out.dtype.element_ty), mask=out_mask)


@triton.jit
def paged_decode_reduce_kernel(
    Acc_part, M_part, L_part, Out,
    stride_ob, stride_oh, num_partitions, num_q_heads,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DR: tl.constexpr, CHUNK_P: tl.constexpr,
):
    """One program per (sequence, query head, BLOCK_DR slice of head_dim):
    out = sum_p w_p acc_p / sum_p w_p l_p with w_p = 2^(m_p - max m). Up to CHUNK_P partitions are
    merged per load, so the usual 4..128 partitions take one or two dependent loads, and the grid has
    BLOCK_D / BLOCK_DR times more programs than heads (B = 1: 28 heads alone would leave the GPU idle)."""
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    d = tl.program_id(2) * BLOCK_DR + tl.arange(0, BLOCK_DR)
    row0 = (seq * num_q_heads + head) * num_partitions
    # pass 1: the global max over the partitions' running maxima
    m_max = tl.full([CHUNK_P], float("-inf"), tl.float32)
    for c0 in range(0, num_partitions, CHUNK_P):
        c = c0 + tl.arange(0, CHUNK_P)
        m_max = tl.maximum(m_max, tl.load(M_part + row0 + c, mask=c < num_partitions, other=float("-inf")))
    m_top = tl.max(m_max, 0)
    m_top = tl.where(m_top == float("-inf"), 0.0, m_top)  # every partition empty (context 0)
    # pass 2: weighted sums of the accumulators and the exp-sums
    total = tl.zeros([CHUNK_P], tl.float32)
    out = tl.zeros([BLOCK_DR], tl.float32)
    for c0 in range(0, num_partitions, CHUNK_P):
        c = c0 + tl.arange(0, CHUNK_P)
        c_ok = c < num_partitions
        w = tl.exp2(tl.load(M_part + row0 + c, mask=c_ok, other=float("-inf")) - m_top)
        total += w * tl.load(L_part + row0 + c, mask=c_ok, other=0.0)
        acc = tl.load(Acc_part + (row0 + c)[:, None] * BLOCK_D + d[None, :], mask=c_ok[:, None], other=0.0)
        out += tl.sum(acc * w[:, None], 0)
    norm = tl.sum(total, 0)
    out = out / tl.where(norm == 0.0, 1.0, norm)
    tl.store(Out + seq * stride_ob + head * stride_oh + d, out.to(Out.dtype.element_ty), mask=d < HEAD_DIM)
