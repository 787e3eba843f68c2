"""Triton kernels of the KV store: write each token's K/V rows into its paged-cache slot, alone
(`store_kv_kernel`) or after the rotary embedding of the token's q and k (`rope_store_kv_kernel`, the
rollout's decode and prefill steps: one kernel where rope and the store were two).

The launchers, their checks and the plain-torch references are in `hybridengine.ops.kv_store`
(`store_kv`, `rope_store_kv` and their `_triton` / `_ref`).
"""

import triton
import triton.language as tl

from .elementwise import rope_angles, rope_heads_


@triton.jit
def store_kv_kernel(
    Key, Value, K_cache, V_cache, Slot_mapping,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kc_block, stride_kc_slot, stride_kc_head,
    stride_vc_block, stride_vc_slot, stride_vc_head,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One program per token: its [num_kv_heads, head_dim] rows of K and V, a plain copy.

    Slot -1 (a padding token) writes nothing. No arithmetic is done on the values, so they are
    stored bit for bit in the cache dtype (which the launcher requires to equal the input dtype).
    """
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(Slot_mapping + token)
    if slot < 0:  # a padding token
        return
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)
    block = slot // PAGE_SIZE
    offset = slot % PAGE_SIZE

    k = tl.load(Key + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    v = tl.load(Value + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    k_dst = (K_cache + block * stride_kc_block + offset * stride_kc_slot
             + heads[:, None] * stride_kc_head + dims[None, :])
    v_dst = (V_cache + block * stride_vc_block + offset * stride_vc_slot
             + heads[:, None] * stride_vc_head + dims[None, :])
    tl.store(k_dst, k, mask=mask)
    tl.store(v_dst, v, mask=mask)


@triton.jit
def rope_store_kv_kernel(
    Q, K, V, Cos, Sin, K_cache, V_cache, Slot_mapping,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ct, stride_st,
    stride_kc_block, stride_kc_slot, stride_kc_head,
    stride_vc_block, stride_vc_slot, stride_vc_head,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    """One program per token: the rotary embedding of its q and k heads in place (`rope_heads_`, rounded as
    eager), then the rotated K rows and the V rows copied into the token's cache slot. Slot -1 (a padding
    token) is rotated and stores nothing. The cache gets k's rotated values bit for bit."""
    token = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)
    d_ok = d < HALF
    cos1, sin1, cos2, sin2 = rope_angles(Cos + token * stride_ct, Sin + token * stride_st, d, d_ok, HALF)
    qh = tl.arange(0, BLOCK_QH)
    rope_heads_(Q + token * stride_qt + qh[:, None] * stride_qh + d[None, :],
                (qh[:, None] < NUM_Q_HEADS) & d_ok[None, :], cos1, sin1, cos2, sin2, HALF)
    kh = tl.arange(0, BLOCK_KH)
    ok = (kh[:, None] < NUM_KV_HEADS) & d_ok[None, :]
    k1, k2 = rope_heads_(K + token * stride_kt + kh[:, None] * stride_kh + d[None, :], ok,
                         cos1, sin1, cos2, sin2, HALF)
    slot = tl.load(Slot_mapping + token)
    if slot >= 0:
        block = slot // PAGE_SIZE
        offset = slot % PAGE_SIZE
        k_dst = K_cache + block * stride_kc_block + offset * stride_kc_slot + kh[:, None] * stride_kc_head + d[None, :]
        tl.store(k_dst, k1, mask=ok)
        tl.store(k_dst + HALF, k2, mask=ok)
        v_src = V + token * stride_vt + kh[:, None] * stride_vh + d[None, :]
        v_dst = V_cache + block * stride_vc_block + offset * stride_vc_slot + kh[:, None] * stride_vc_head + d[None, :]
        tl.store(v_dst, tl.load(v_src, mask=ok), mask=ok)
        tl.store(v_dst + HALF, tl.load(v_src + HALF, mask=ok), mask=ok)
