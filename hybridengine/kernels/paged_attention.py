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

Math: fp32 math after the loads, with the tiles fed to the tensor cores in their stored dtype.
`DOT_16BIT` (bf16/fp16 inputs): both `tl.dot`s take 16-bit operands and accumulate in fp32. A
product of two bf16 (8-bit significand) or fp16 (11-bit) values is exact in fp32 (24 bits), so
S = Q.K^T is exact products summed in fp32, the numbers an fp32 upcast gives, with the K and V
tiles in half the registers. V enters P.V exact. P (fp32, from the online softmax) is split in the
input dtype, p_hi = p.to(dtype), p_lo = (p - p_hi).to(dtype): p_hi is 0 or within a factor 2 of p,
so p - p_hi is exact in fp32 (Sterbenz) whatever the cast's rounding, and P.V = P_hi.V + P_lo.V
(exact products, fp32 sums) carries P to 16 significant bits for bf16 (relative error <= 2^-16 with
the GPU's round-to-nearest, < 2^-14 with the interpreter's truncating bf16 cast; TF32 would keep
11 bits, flash-attn's bf16 P 8) and to 22 for fp16 (plus at most 2^-25 absolute where p_lo or p
falls among fp16's subnormals). The cost is a second, [GROUP_PAD, BLOCK_N] x [BLOCK_N, D], MMA per
tile. The only 16-bit arithmetic is inside the dots (the interpreter's bf16 arithmetic is wrong:
`_dot_16bit` runs its fp32 equivalent there). fp32 inputs (`DOT_16BIT` False) take fp32 "ieee"
dots. Softmax is online, in base 2 with the scale folded into log2(e).

`PREFETCH`: each K/V tile is loaded one loop iteration ahead into registers (`_kv_tile`), the same tiles
meeting the same math in the same order (outputs bit-identical to the plain loop). Triton already
software-pipelines the plain loop on Hopper (cp.async, `num_stages`); the prefetch helps only launches of
few programs per SM, with 8 warps (`DECODE_PREFETCH_PROGRAMS`).

The launcher, its checks and the reference are in `hybridengine.ops.paged_attention`.
"""

import triton
import triton.language as tl


@triton.jit
def _dot_16bit(a, b, acc, UPCAST: tl.constexpr):
    """acc + a @ b for bf16/fp16 a and b: exact products, fp32 accumulation (acc None: from zero).
    UPCAST: the same products from fp32 copies of a and b with "ieee", for the interpreter, whose
    tl.dot multiplies bf16 operands' raw bits as integers (Triton 3.9; its fp16 dot is right)."""
    if UPCAST:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        out = tl.dot(a, b, acc)
    return out


@triton.jit
def _kv_tile(k_base, v_base, bt_row, t0, start, hi, max_blocks, d, d_ok,
             stride_kc_block, stride_kc_slot, stride_vc_block, stride_vc_slot,
             PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """The K and V tiles of tokens t0 .. t0 + BLOCK_N - 1 ([BLOCK_N, BLOCK_D], zeros where masked) and the
    tokens' visibility mask: each token's page comes from its own block-table entry; entries past the
    context are never read."""
    t = t0 + tl.arange(0, BLOCK_N)
    page_idx = t // PAGE_SIZE
    t_ok = (t >= start) & (t < hi) & (page_idx < max_blocks)
    page = tl.load(bt_row + page_idx, mask=t_ok, other=0).to(tl.int64)
    slot = t % PAGE_SIZE
    kv_mask = t_ok[:, None] & d_ok[None, :]
    k = tl.load(k_base + page[:, None] * stride_kc_block + slot[:, None] * stride_kc_slot + d[None, :],
                mask=kv_mask, other=0.0)
    v = tl.load(v_base + page[:, None] * stride_vc_block + slot[:, None] * stride_vc_slot + d[None, :],
                mask=kv_mask, other=0.0)
    return k, v, t_ok


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
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
    DOT_16BIT: tl.constexpr, UPCAST_BF16_DOT: tl.constexpr, PREFETCH: tl.constexpr,
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
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
    bt_row = Block_tables + seq * stride_bt_b
    k_base = K_cache + kv_head * stride_kc_head
    v_base = V_cache + kv_head * stride_vc_head
    if PREFETCH:
        # Register double buffering: the K/V tile of the next iteration is loaded before this one's math,
        # so its memory latency hides behind the dots and the softmax, without the shared-memory stages
        # of Triton's pipeline (launched with num_stages=1). Past `hi` the loads are masked off and read
        # nothing.
        k_nxt, v_nxt, ok_nxt = _kv_tile(k_base, v_base, bt_row, lo, start, hi, max_blocks, d, d_ok,
                                        stride_kc_block, stride_kc_slot, stride_vc_block, stride_vc_slot,
                                        PAGE_SIZE, BLOCK_N)
    for t0 in range(lo, hi, BLOCK_N):
        if PREFETCH:
            k, v, t_ok = k_nxt, v_nxt, ok_nxt
            k_nxt, v_nxt, ok_nxt = _kv_tile(k_base, v_base, bt_row, t0 + BLOCK_N, start, hi, max_blocks, d, d_ok,
                                            stride_kc_block, stride_kc_slot, stride_vc_block, stride_vc_slot,
                                            PAGE_SIZE, BLOCK_N)
        else:
            k, v, t_ok = _kv_tile(k_base, v_base, bt_row, t0, start, hi, max_blocks, d, d_ok,
                                  stride_kc_block, stride_kc_slot, stride_vc_block, stride_vc_slot,
                                  PAGE_SIZE, BLOCK_N)
        if DOT_16BIT:
            s = _dot_16bit(q, tl.trans(k), None, UPCAST_BF16_DOT)
        else:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")  # fp32 inputs
        s = tl.where(t_ok[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet stays 0
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l = l * alpha + tl.sum(p, 1)
        if DOT_16BIT:
            p_hi = p.to(v.dtype)
            p_lo = (p - p_hi.to(tl.float32)).to(v.dtype)  # p - p_hi is exact (see the module docstring)
            acc = _dot_16bit(p_hi, v, acc * alpha[:, None], UPCAST_BF16_DOT)
            acc = _dot_16bit(p_lo, v, acc, UPCAST_BF16_DOT)
        else:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
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
