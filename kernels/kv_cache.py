"""Triton kernel of the KV store: write each token's K/V rows into its paged-cache slot.

The launcher, its checks and the plain-torch reference are in `hybridengine.attention`
(`store_kv`, `store_kv_triton`, `store_kv_ref`).
"""

import triton
import triton.language as tl


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
    k_dst = K_cache + block * stride_kc_block + offset * stride_kc_slot + heads[:, None] * stride_kc_head + dims[None, :]
    v_dst = V_cache + block * stride_vc_block + offset * stride_vc_slot + heads[:, None] * stride_vc_head + dims[None, :]
    tl.store(k_dst, k, mask=mask)
    tl.store(v_dst, v, mask=mask)
