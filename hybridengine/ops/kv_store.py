"""Writes into the paged KV cache: `store_kv` (each token's K and V rows into its slot) and `rope_store_kv`
(the rotary embedding of q and k, then the store, in one kernel: the rollout's attention layers).

Cache layout (vLLM / nano-vllm): per layer `k_cache`, `v_cache` of shape
[num_blocks, block_size, num_kv_heads, head_dim], the last dim contiguous (per-layer views of one
allocation are fine: only the last stride must be 1). Token j of a sequence lives in block
`block_tables[b, j // block_size]` at offset `j % block_size`; its slot is
`block_id * block_size + offset`. `slot_mapping` is int64 (slots of a large cache pass 2^31).

Layers per op: the plain-torch reference (`*_ref`), the Triton launcher (`*_triton`, kernels in
`hybridengine.kernels.kv_cache`) and the op, which checks its arguments (shapes, dtypes, devices:
`ValueError` naming the argument) and runs the launcher on CUDA, the reference elsewhere. The *values*
of `slot_mapping` are checked by the references only, since reading them would synchronise with the
GPU and break CUDA-graph capture: the kernels trust them (an out-of-range slot is a wild write).
"""

from __future__ import annotations

import torch

from hybridengine.checks import FLOAT_DTYPES, tensor
from hybridengine.ops import _launch
from hybridengine.ops.rope import check_rope, rope_ref


def check_cache(op: str, k_cache, v_cache, like: torch.Tensor, *, head_dim: int,
                num_kv_heads: int | None = None) -> tuple[int, int]:
    """A K/V cache pair in `like`'s dtype and device with this head_dim (and number of kv heads, when
    given); returns (block_size, num_kv_heads)."""
    tensor(op, "k_cache", k_cache, dim=4, dtypes=(like.dtype,), device=like.device, contiguous_last=True)
    tensor(op, "v_cache", v_cache, shape=k_cache.shape, dtypes=(like.dtype,), device=like.device,
           contiguous_last=True)
    _, block_size, cache_kv_heads, cache_head_dim = k_cache.shape
    if cache_head_dim != head_dim:
        raise ValueError(f"{op}: k_cache has head_dim {cache_head_dim}, the inputs have head_dim {head_dim}")
    if num_kv_heads is not None and cache_kv_heads != num_kv_heads:
        raise ValueError(f"{op}: k_cache has {cache_kv_heads} kv heads, the inputs have {num_kv_heads}")
    if block_size < 1:
        raise ValueError(f"{op}: k_cache block_size (dim 1) must be >= 1, got {block_size}")
    return block_size, cache_kv_heads


def _check_store(op: str, key, value, k_cache, v_cache, slot_mapping, names: tuple[str, str] = ("key", "value")):
    """`names`: what the op calls key and value (rope_store_kv: k and v)."""
    kn, vn = names
    tensor(op, kn, key, dim=3, dtypes=FLOAT_DTYPES, contiguous_last=True)
    tensor(op, vn, value, shape=key.shape, dtypes=(key.dtype,), device=key.device, contiguous_last=True)
    check_cache(op, k_cache, v_cache, key, head_dim=key.shape[2], num_kv_heads=key.shape[1])
    tensor(op, "slot_mapping", slot_mapping, shape=key.shape[:1], dtypes=(torch.int64,), device=key.device)


# --------------------------------------------------------------------------------------------------
# store_kv


def store_kv_ref(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """Plain-torch reference of `store_kv` (any float dtype); checks the slot values (ValueError when
    out of range or repeated)."""
    block_size = k_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    capacity = k_cache.shape[0] * block_size
    if slots.numel() and int(slots.max()) >= capacity:
        raise ValueError(f"slot_mapping has slot {int(slots.max())} but the cache holds {capacity} slots")
    if slots.unique().numel() != slots.numel():
        raise ValueError("slot_mapping writes one slot twice")
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = key[keep]
    v_cache[blocks, offsets] = value[keep]


def store_kv_triton(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
    """`store_kv` with the Triton kernel (CUDA, or CPU under TRITON_INTERPRET=1); one program per token."""
    import triton

    from hybridengine.kernels.kv_cache import store_kv_kernel

    assert key.shape == value.shape and k_cache.shape[2:] == key.shape[1:] and k_cache.dtype == key.dtype
    assert slot_mapping.dtype == torch.int64 and key.stride(-1) == 1 and k_cache.stride(-1) == 1
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    store_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, PAGE_SIZE=k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=4,
    )


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write each token's K and V rows into its cache slot, in place.

    Args:
        key, value: [num_tokens, num_kv_heads, head_dim], fp16/bf16/fp32, last dim contiguous (a view
            of a fused QKV projection is fine), the cache's dtype.
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], last dim contiguous.
        slot_mapping: int64 [num_tokens]; slot = block_id * block_size + offset; -1 skips the token
            (padding) and writes nothing. Slots must be distinct and < num_blocks * block_size
            (checked by the reference only).

    A copy: the stored values equal the inputs bit for bit. CUDA: Triton; elsewhere: the reference.
    """
    _check_store("store_kv", key, value, k_cache, v_cache, slot_mapping)
    if _launch.use_kernel(key):
        store_kv_triton(key, value, k_cache, v_cache, slot_mapping)
    else:
        store_kv_ref(key, value, k_cache, v_cache, slot_mapping)


# --------------------------------------------------------------------------------------------------
# rope_store_kv


def rope_store_kv_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch reference of `rope_store_kv`: `rope_ref`, then `store_kv_ref` of the rotated k and v.
    Returns the rotated (q, k) as new tensors."""
    q, k = rope_ref(q, k, cos, sin)
    store_kv_ref(k, v, k_cache, v_cache, slot_mapping)
    return q, k


def rope_store_kv_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         k_cache: torch.Tensor, v_cache: torch.Tensor,
                         slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`rope_store_kv` with the Triton kernel (one program per token): q and k rotated in place; returns (q, k)."""
    import triton

    from hybridengine.kernels.kv_cache import rope_store_kv_kernel

    assert k.shape == v.shape and k_cache.shape[2:] == k.shape[1:] and k_cache.dtype == q.dtype == k.dtype
    assert cos.shape == (q.shape[0], q.shape[2]) and slot_mapping.dtype == torch.int64
    num_tokens, num_q_heads, head_dim = q.shape
    if num_tokens == 0:
        return q, k
    num_kv_heads = k.shape[1]
    rope_store_kv_kernel[(num_tokens,)](
        q, k, v, cos, sin, k_cache, v_cache, slot_mapping,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0), sin.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads, HALF=head_dim // 2, PAGE_SIZE=k_cache.shape[1],
        BLOCK_QH=triton.next_power_of_2(num_q_heads), BLOCK_KH=triton.next_power_of_2(num_kv_heads),
        BLOCK_HALF=triton.next_power_of_2(head_dim // 2),
        # no FMA contraction: each product rounds before the sum, as eager (see rope.rope_triton_)
        num_warps=4, enable_fp_fusion=False,
    )
    return q, k


def rope_store_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding of q and k, then the rotated k and v stored in the paged cache: `rope_ref` followed
    by `store_kv`, in one kernel on CUDA (the rollout's attention layers; one launch instead of two per layer).

    Args:
        q: [num_tokens, num_q_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim] (views of a fused
            QKV projection are fine), one dtype, last dim contiguous; head_dim even.
        cos, sin: [num_tokens, head_dim] in q's dtype (HF half-split layout).
        k_cache, v_cache, slot_mapping: as for `store_kv` (-1 skips a token: it is rotated, not stored).

    Returns the rotated (q, k): the same tensors, rotated in place, on CUDA; new tensors elsewhere (the
    reference). Equal bit for bit to `rope_ref` + `store_kv_ref`, cache included.
    """
    check_rope("rope_store_kv", q, k, cos, sin)
    _check_store("rope_store_kv", k, v, k_cache, v_cache, slot_mapping, names=("k", "v"))
    if _launch.use_kernel(q):
        return rope_store_kv_triton(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)
    return rope_store_kv_ref(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)


def implementations(device_type: str) -> dict[str, str]:
    """Which implementation each op of this module runs on this device type (for `hybridengine info`)."""
    kind = "Triton" if device_type == "cuda" else "torch reference"
    return {"store_kv": kind, "rope_store_kv": kind}
