"""Attention ops of rollout generation over the paged KV cache: KV store, decode, prefill.

Three layers per op, as for every op in the package: a deliberately naive plain-torch reference
(`*_ref`), a Triton launcher (`*_triton`: checks, output allocation, block sizes; the kernels are in
`hybridengine.kernels`), and the op itself, which picks one by device: CUDA runs Triton (prefill runs
flash-attn's varlen kernel instead when it is installed and applies), CPU runs the reference.
Tests run the Triton launchers on CPU tensors under `TRITON_INTERPRET=1`.

Cache layout (vLLM / nano-vllm): per layer `k_cache`, `v_cache` of shape
[num_blocks, block_size, num_kv_heads, head_dim], the last dim contiguous (per-layer views of one
allocation are fine: only the last stride must be 1). Token j of a sequence lives in block
`block_tables[b, j // block_size]` at offset `j % block_size`; its slot is
`block_id * block_size + offset`.

Index tensors are int32 (block tables, context and cu_seqlens) except `slot_mapping`, which is
int64 (slots of a large cache pass 2^31). Shapes, dtypes and devices are checked on every call
(`ValueError` naming the argument); the *values* of index tensors are not, since that would
synchronise with the GPU and break CUDA-graph capture: the references check them, the kernels trust
them (an out-of-range block id or slot is a wild memory access).
"""

from __future__ import annotations

import functools
import math

import torch

NO_WINDOW = 2**30
"""Window passed to the kernels when there is none: larger than any context, small enough that
`position - window` stays inside int32."""

DECODE_MIN_PARTITION = 128
"""Split-K partitions are at least this many tokens: a partition costs a program's fixed work (load Q,
write 2 x head_dim + 2 floats per head) and a share of the reduce kernel."""
DECODE_MAX_SPLITS = 512
"""Upper bound on a forced `num_splits` (the reduce kernel holds one max and one sum per partition)."""
DECODE_REDUCE_BLOCK_D = 32
"""head_dim slice per program of the split-K merge kernel."""
DECODE_REDUCE_CHUNK = 64
"""Partitions merged per load by the split-K merge kernel ([64, 32] fp32 tile: 16 values a thread at 4 warps)."""
DECODE_TARGET_WAVES = 2
"""Split into as many partitions as fit in this many full waves of one program per SM: programs =
B * num_kv_heads * splits <= 2 x SMs. A split launch takes 128-token K/V tiles in 3 stages
(`_decode_config(split=True)`), whose shared memory holds one program per SM, so a grid just over a
multiple of the SMs would pay a whole extra wave. Split sweep on an H200 (run 20261130T201033Z-1199,
Qwen2-7B heads, cold L2; rows case sweep="splits"), 128-token tiles: B = 1, 16k: 64 partitions (256
programs) 22.0-23.1 us, 43 (172) 24.9, 128 (512) 25.5, against 23.9 us for the previous plan (128
partitions of 32-token tiles); B = 1, 4k: 32 partitions 14.3-15.4 us against 16.4; B = 16, 4k: 4
partitions (256 programs) 48.2 us against 52.4 (9 of 32-token tiles), 6 (384) 55.1; B = 16, 16k: 4
partitions 149 us against 158.5, 5 (320: a third wave) 204 in the next run. A merge by each head's
last partition program in the same launch (no merge kernel) was slower in every case (B = 1, 16k:
29-42 us): one program's dependent loads of all the partials cost more than the second launch."""
DECODE_SPLIT_BELOW = 0.5
"""No split while B * num_kv_heads >= this fraction of the SMs: the plan is fixed at CUDA-graph capture
for the cache's capacity, so at decode batch sizes (B = 64, 2 kv heads: 128 programs) a split would
mostly add empty partitions and the merge kernel."""

DECODE_PREFETCH_PROGRAMS = 2
"""A one-pass launch of at most this many programs per SM (B * num_kv_heads <= 2 x SMs: Qwen2.5-1.5B, and
Qwen2-7B at tg = 2, have 2 kv heads per rank, so B <= 132 on an H200) takes 64-token tiles, 8 warps and the
register prefetch (config PREFETCH) instead of 32-token tiles in Triton's 4-stage pipeline. Kernel sweep
(`--suite paged_attention_prefetch`, H200, cold L2, 2 kv heads, run 20261130T231453Z-2d02): B = 64 at 512
tokens 20.7 us against 25.4, B = 128 at 256 17.6 against 18.1, at 512 28.5 against 29.9; with 4 kv heads
at B = 128 (512 programs) it loses (30.6 against 23.5). On the real decode step (`profile_decode
--kernel-configs`, bench/results/profiles/decode_kernel_configs_*_prefetch_s9call3.json): 1.5B at 64
sequences 1.986 ms against 2.026; 1.5B at 128, 7B at 64, and 7B tg = 2 at 128 within 0.3%."""

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# --------------------------------------------------------------------------------------------------
# argument checks


def _output(out: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor:
    """A new output shaped like q, or the caller's `out` checked for q's shape, dtype and device."""
    if out is None:
        return torch.empty(q.shape, dtype=q.dtype, device=q.device)
    _check_tensor("out", out, dtypes=(q.dtype,), device=q.device)
    _check_shape("out", out, q.shape, "the shape of q")
    if out.stride(-1) != 1:
        raise ValueError(f"out must be contiguous in its last dimension, got strides {out.stride()}")
    return out


def _check_tensor(name: str, t, *, dim: int | None = None, dtypes=None, device=None) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dim is not None and t.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        names = " or ".join(str(d) for d in dtypes)
        raise ValueError(f"{name} must be {names}, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} (the device of the query/key)")


def _check_shape(name: str, t: torch.Tensor, expected: tuple, what: str) -> None:
    if tuple(t.shape) != tuple(expected):
        raise ValueError(f"{name} must have shape {tuple(expected)} ({what}), got {tuple(t.shape)}")


def _check_cache(q_like: torch.Tensor, k_cache, v_cache, *, head_dim: int, num_heads: int | None) -> tuple[int, int]:
    """Checks a K/V cache pair against the query-side tensor; returns (block_size, num_kv_heads)."""
    _check_tensor("k_cache", k_cache, dim=4, device=q_like.device)
    _check_tensor("v_cache", v_cache, dim=4, device=q_like.device)
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must have one shape, got {tuple(k_cache.shape)} and "
                         f"{tuple(v_cache.shape)}")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.dtype != q_like.dtype:
            raise ValueError(f"{name} is {c.dtype} but the inputs are {q_like.dtype}: one dtype is expected")
        if c.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last (head_dim) dimension, got strides {c.stride()}")
    _, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    if cache_head_dim != head_dim:
        raise ValueError(f"k_cache has head_dim {cache_head_dim}, the inputs have head_dim {head_dim}")
    if num_heads is not None and num_kv_heads != num_heads:
        raise ValueError(f"k_cache has {num_kv_heads} kv heads, the inputs have {num_heads}")
    if block_size < 1:
        raise ValueError(f"k_cache block_size (dim 1) must be >= 1, got {block_size}")
    return block_size, num_kv_heads


def _check_heads(num_q_heads: int, num_kv_heads: int) -> int:
    if num_kv_heads < 1 or num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    return num_q_heads // num_kv_heads


def _check_scale_window(scale, sliding_window) -> None:
    if not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a positive finite number, got {scale!r}")
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
        raise ValueError(f"sliding_window must be None or an int >= 1, got {sliding_window!r}")


def _check_float(name: str, t: torch.Tensor, *, reference: bool) -> None:
    allowed = _FLOAT_DTYPES + ((torch.float64,) if reference else ())
    _check_tensor(name, t, dtypes=allowed)


def _compute_dtype(dtype: torch.dtype, compute_dtype: torch.dtype | None) -> torch.dtype:
    if compute_dtype is not None:
        return compute_dtype
    return torch.float64 if dtype == torch.float64 else torch.float32


def _dot_precision(dtype: torch.dtype) -> str:
    # bf16/fp16 values are exact in TF32, so TF32 tensor cores lose nothing on Q.K^T; fp32 inputs are not.
    return "ieee" if dtype == torch.float32 else "tf32"


def _gather_keys(cache: torch.Tensor, blocks: torch.Tensor, n: int) -> torch.Tensor:
    """The first n tokens [n, num_kv_heads, head_dim] of a sequence whose blocks are `blocks`."""
    return cache[blocks.long()].reshape(-1, *cache.shape[2:])[:n]


def _check_block_ids(name: str, blocks: torch.Tensor, num_blocks: int) -> None:
    if blocks.numel() and (int(blocks.min()) < 0 or int(blocks.max()) >= num_blocks):
        raise ValueError(f"{name} has block ids {blocks.tolist()} outside [0, {num_blocks}) among the used blocks")


# --------------------------------------------------------------------------------------------------
# KV store


def _check_store_args(key, value, k_cache, v_cache, slot_mapping, *, reference: bool,
                      names: tuple[str, str] = ("key", "value")) -> None:
    """`names`: what the caller calls key and value (rope_store_kv: k and v)."""
    kn, vn = names
    _check_float(kn, key, reference=reference)
    _check_tensor(kn, key, dim=3)
    _check_tensor(vn, value, dim=3, device=key.device)
    _check_shape(vn, value, key.shape, f"the shape of {kn}")
    if value.dtype != key.dtype:
        raise ValueError(f"{vn} is {value.dtype} but {kn} is {key.dtype}")
    for name, t in ((kn, key), (vn, value)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last (head_dim) dimension, got strides {t.stride()}")
    _check_cache(key, k_cache, v_cache, head_dim=key.shape[2], num_heads=key.shape[1])
    _check_tensor("slot_mapping", slot_mapping, dim=1, dtypes=(torch.int64,), device=key.device)
    _check_shape("slot_mapping", slot_mapping, key.shape[:1], f"one slot per token of {kn}")


def store_kv_ref(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """Plain-torch reference of `store_kv`; also checks the slot values (ValueError when out of range)."""
    _check_store_args(key, value, k_cache, v_cache, slot_mapping, reference=True)
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
    """`store_kv` with the Triton kernel (CUDA, or CPU under TRITON_INTERPRET=1)."""
    import triton

    from hybridengine.kernels.kv_cache import store_kv_kernel

    _check_store_args(key, value, k_cache, v_cache, slot_mapping, reference=False)
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

    A copy: the stored values equal the inputs bit for bit. CUDA: Triton; CPU: the reference.
    """
    if key.device.type == "cuda":
        store_kv_triton(key, value, k_cache, v_cache, slot_mapping)
    else:
        store_kv_ref(key, value, k_cache, v_cache, slot_mapping)


def rope_store_kv_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch reference of `rope_store_kv`: `fused.rope_ref`, then `store_kv_ref` of the rotated k and v.
    Returns the rotated (q, k) as new tensors."""
    from hybridengine.ops import fused

    fused._check_rope("rope_store_kv", q, k, cos, sin)
    _check_store_args(k, v, k_cache, v_cache, slot_mapping, reference=True, names=("k", "v"))
    q, k = fused.rope_ref(q, k, cos, sin)
    store_kv_ref(k, v, k_cache, v_cache, slot_mapping)
    return q, k


def rope_store_kv_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         k_cache: torch.Tensor, v_cache: torch.Tensor,
                         slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`rope_store_kv` with the Triton kernel (one program per token): q and k rotated in place; returns (q, k)."""
    import triton

    from hybridengine.ops import fused
    from hybridengine.kernels.kv_cache import rope_store_kv_kernel

    fused._check_rope("rope_store_kv", q, k, cos, sin)
    _check_store_args(k, v, k_cache, v_cache, slot_mapping, reference=False, names=("k", "v"))
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
        # no FMA contraction: each product rounds before the sum, as eager (see fused.rope_triton_)
        num_warps=4, enable_fp_fusion=False,
    )
    return q, k


def rope_store_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding of q and k, then the rotated k and v stored in the paged cache: `fused.rope` followed
    by `store_kv`, in one kernel on CUDA (the rollout's attention layers; one launch instead of two per layer).

    Args:
        q: [num_tokens, num_q_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim] (views of a fused
            QKV projection are fine), one dtype, last dim contiguous; head_dim even.
        cos, sin: [num_tokens, head_dim] in q's dtype (HF half-split layout).
        k_cache, v_cache, slot_mapping: as for `store_kv` (-1 skips a token: it is rotated, not stored).

    Returns the rotated (q, k): the same tensors, rotated in place, on CUDA; new tensors on CPU (the
    reference). Equal bit for bit to `fused.rope_ref` + `store_kv_ref`, cache included.
    """
    if q.device.type == "cuda":
        return rope_store_kv_triton(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)
    return rope_store_kv_ref(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)


# --------------------------------------------------------------------------------------------------
# paged decode attention


def _check_decode_args(q, k_cache, v_cache, block_tables, context_lens, scale, sliding_window, *,
                       reference: bool) -> tuple[int, int, int]:
    """Returns (block_size, num_kv_heads, group)."""
    _check_float("q", q, reference=reference)
    _check_tensor("q", q, dim=3)
    if q.stride(-1) != 1:
        raise ValueError(f"q must be contiguous in its last (head_dim) dimension, got strides {q.stride()}")
    batch, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = _check_cache(q, k_cache, v_cache, head_dim=head_dim, num_heads=None)
    group = _check_heads(num_q_heads, num_kv_heads)
    _check_tensor("block_tables", block_tables, dim=2, dtypes=(torch.int32,), device=q.device)
    if block_tables.shape[0] != batch:
        raise ValueError(f"block_tables must have one row per sequence of q ({batch}), got shape "
                         f"{tuple(block_tables.shape)}")
    if block_tables.stride(-1) != 1:
        raise ValueError(f"block_tables must be contiguous in its last dimension, got strides {block_tables.stride()}")
    _check_tensor("context_lens", context_lens, dim=1, dtypes=(torch.int32,), device=q.device)
    _check_shape("context_lens", context_lens, (batch,), "one length per sequence of q")
    _check_scale_window(scale, sliding_window)
    return block_size, num_kv_heads, group


def paged_decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor, *, scale: float,
                               sliding_window: int | None = None,
                               compute_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Plain-torch reference of `paged_decode_attention`: per sequence, gather its K/V from the blocks
    and run softmax attention in `compute_dtype` (default fp32; fp64 for fp64 inputs). Checks the
    index values (context length within the block table, block ids within the cache)."""
    block_size, num_kv_heads, group = _check_decode_args(q, k_cache, v_cache, block_tables, context_lens, scale,
                                                         sliding_window, reference=True)
    dtype = _compute_dtype(q.dtype, compute_dtype)
    out = torch.zeros(q.shape, dtype=dtype, device=q.device)
    for b, n in enumerate(context_lens.tolist()):
        if n < 0 or n > block_tables.shape[1] * block_size:
            raise ValueError(f"context_lens[{b}] = {n} is outside [0, {block_tables.shape[1] * block_size}] "
                             f"(block_tables width x block_size)")
        if n == 0:  # a padding row
            continue
        blocks = block_tables[b, :math.ceil(n / block_size)]
        _check_block_ids(f"block_tables[{b}]", blocks, k_cache.shape[0])
        start = 0 if sliding_window is None else max(0, n - sliding_window)
        k = _gather_keys(k_cache, blocks, n)[start:].to(dtype).repeat_interleave(group, dim=1)  # [n, Hq, D]
        v = _gather_keys(v_cache, blocks, n)[start:].to(dtype).repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[b].to(dtype), k) * scale
        out[b] = torch.einsum("hn,nhd->hd", torch.softmax(scores, dim=-1), v)
    return out.to(q.dtype)


@functools.cache
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 1 elsewhere (CPU / interpreter: no split unless forced)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def decode_num_splits(batch: int, num_kv_heads: int, max_context_len: int, num_sms: int) -> int:
    """How many context partitions split-K decode uses (1: no split).

    One program per (sequence, kv head) is enough when B * num_kv_heads >= DECODE_SPLIT_BELOW x
    num_sms; below that, split each context until about DECODE_TARGET_WAVES programs per SM run,
    keeping partitions >= DECODE_MIN_PARTITION tokens. Qwen2-7B per GPU (4 kv heads) on an H200
    (132 SMs): B >= 17 does not split; B = 16 splits in 4 (contexts >= 512); B = 1 in 66 (16k: 64
    partitions of 256 once rounded to 128-token tiles; 4k: 32 of 128).
    Depends on host integers only, so a CUDA graph captured at a given (B, max_context_len) stays valid.
    """
    programs = batch * num_kv_heads
    if programs == 0 or programs >= DECODE_SPLIT_BELOW * num_sms:
        return 1
    want = DECODE_TARGET_WAVES * num_sms // programs
    return max(1, min(want, math.ceil(max_context_len / DECODE_MIN_PARTITION), DECODE_MAX_SPLITS))


def _launch_config(defaults: dict, config: dict | None, dtype: torch.dtype) -> dict:
    """A kernel's launch: `defaults` with a tuning sweep's `config` over them, checked: known keys only, the
    constexpr flags (DOT_16BIT, PREFETCH, P_SPLIT) bools, DOT_16BIT False for float32 inputs."""
    unknown = set(config or {}) - set(defaults)
    if unknown:
        raise ValueError(f"config keys must be among {sorted(defaults)}, got {sorted(unknown)}")
    cfg = defaults | (config or {})
    for flag in ("PREFETCH", "P_SPLIT"):
        if flag in cfg and not isinstance(cfg[flag], bool):
            raise ValueError(f"config {flag} must be a bool, got {cfg[flag]!r}")
    if not isinstance(cfg["DOT_16BIT"], bool) or (cfg["DOT_16BIT"] and dtype == torch.float32):
        raise ValueError(f"config DOT_16BIT must be a bool, and False for float32 inputs, got "
                         f"{cfg['DOT_16BIT']!r} with {dtype} inputs")
    return cfg


def _decode_config(device: torch.device, head_dim: int, split: bool = False, programs: int | None = None) -> dict:
    # Chosen on the real decode step (`python -m bench.profile_decode --kernel-configs`, H200, B = 128,
    # prompts 128 + 256 new tokens, async scheduling; bench/results/profiles/decode_kernel_configs_*):
    # 32-token tiles, 4 warps, 4 stages, 16-bit dots: 7B 5.78 ms/step (best of six; the previous
    # 64 x 2-stage TF32 default 5.84, 128 x 3 stages 6.03), 1.5B 2.60 ms (64 x 2 stages with 16-bit
    # dots 2.55, TF32 2.63, 128 x 3 stages 2.68). The cold-L2 kernel sweep agrees at B = 1 / 16k (22.0 us,
    # best), B = 128 at 256 / 512 / 1k tokens (best) and B = 128 / 4k (within 0.2%). Under the
    # interpreter, 32-token tiles and one stage keep the tests fast. A split launch (few sequences,
    # long contexts) takes 128-token tiles in 3 stages: see DECODE_TARGET_WAVES.
    if device.type != "cuda":
        return dict(BLOCK_N=32, num_warps=4, num_stages=1)
    if head_dim <= 128 and split:
        return dict(BLOCK_N=128, num_warps=4, num_stages=3)
    if head_dim <= 128 and programs is not None and programs <= DECODE_PREFETCH_PROGRAMS * num_sms(device):
        return dict(BLOCK_N=64, num_warps=8, num_stages=1, PREFETCH=True)
    if head_dim <= 128:
        return dict(BLOCK_N=32, num_warps=4, num_stages=4)
    return dict(BLOCK_N=32, num_warps=4, num_stages=2)


def decode_partitions(max_context_len: int, num_splits: int, block_n: int) -> tuple[int, int]:
    """(num_partitions, partition_size): partition_size is a multiple of the kernel's tile `block_n`."""
    size = math.ceil(math.ceil(max_context_len / num_splits) / block_n) * block_n
    return max(1, math.ceil(max_context_len / size)), size


def decode_partition_plan(batch: int, num_kv_heads: int, head_dim: int, max_context_len: int,
                          device: torch.device, num_splits: int | None = None) -> tuple[int, int]:
    """(num_partitions, partition_size) of the Triton decode launch; one partition runs the one-pass kernel."""
    if num_splits is None:
        num_splits = decode_num_splits(batch, num_kv_heads, max_context_len, num_sms(device))
    return decode_partitions(max_context_len, num_splits, _decode_config(device, head_dim, num_splits > 1)["BLOCK_N"])


def paged_decode_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                  block_tables: torch.Tensor, context_lens: torch.Tensor, *, scale: float,
                                  sliding_window: int | None = None, num_splits: int | None = None,
                                  max_context_len: int | None = None,
                                  out: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """`paged_decode_attention` with the Triton kernels (CUDA, or CPU under TRITON_INTERPRET=1).

    `config` overrides the launch choices of `_decode_config` (BLOCK_N, num_warps, num_stages) and
    DOT_16BIT (default True for bf16/fp16: `tl.dot` on the 16-bit tiles; False: the previous fp32
    upcast with TF32 dots; fp32 inputs: False only) and PREFETCH (bool: load the next K/V tile into
    registers before the current tile's math, see the kernel): the tuning sweep of
    bench/paged_attention.py uses it."""
    import triton

    from hybridengine.kernels.paged_attention import paged_decode_kernel, paged_decode_reduce_kernel

    block_size, num_kv_heads, group = _check_decode_args(q, k_cache, v_cache, block_tables, context_lens, scale,
                                                         sliding_window, reference=False)
    batch, num_q_heads, head_dim = q.shape
    capacity = block_tables.shape[1] * block_size
    if max_context_len is None:
        max_context_len = capacity
    if not isinstance(max_context_len, int) or not 1 <= max_context_len <= max(capacity, 1):
        raise ValueError(f"max_context_len must be an int in [1, {capacity}] (block_tables width x block_size), "
                         f"got {max_context_len!r}")
    if num_splits is not None and (not isinstance(num_splits, int) or not 1 <= num_splits <= DECODE_MAX_SPLITS):
        raise ValueError(f"num_splits must be None or an int in [1, {DECODE_MAX_SPLITS}], got {num_splits!r}")
    out = _output(out, q)
    if batch == 0:
        return out

    if num_splits is None:
        num_splits = decode_num_splits(batch, num_kv_heads, max_context_len, num_sms(q.device))
    cfg = _launch_config({"DOT_16BIT": q.dtype != torch.float32, "PREFETCH": False} | _decode_config(
        q.device, head_dim, num_splits > 1, programs=batch * num_kv_heads), config, q.dtype)
    block_n = cfg.pop("BLOCK_N")
    num_partitions, partition_size = decode_partitions(max_context_len, num_splits, block_n)
    split = num_partitions > 1
    block_d = triton.next_power_of_2(head_dim)
    if split:
        acc_part = torch.empty(batch, num_q_heads, num_partitions, block_d, dtype=torch.float32, device=q.device)
        m_part = torch.empty(batch, num_q_heads, num_partitions, dtype=torch.float32, device=q.device)
        l_part = torch.empty_like(m_part)
    else:  # unused by the kernel (SPLIT is a constexpr)
        acc_part = m_part = l_part = out
    paged_decode_kernel[(num_kv_heads, batch, num_partitions)](
        q, k_cache, v_cache, block_tables, context_lens, out, acc_part, m_part, l_part,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        scale * math.log2(math.e), NO_WINDOW if sliding_window is None else sliding_window,
        block_tables.shape[1], partition_size, num_partitions,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, BLOCK_D=block_d,
        PAGE_SIZE=block_size, BLOCK_N=block_n, SPLIT=split, DOT_PRECISION=_dot_precision(q.dtype),
        # the interpreter's tl.dot reads bf16 operands' bits as integers: it multiplies fp32 copies (same products)
        UPCAST_BF16_DOT=q.device.type != "cuda" and q.dtype == torch.bfloat16, **cfg,
    )
    if split:
        block_dr = min(block_d, DECODE_REDUCE_BLOCK_D)
        paged_decode_reduce_kernel[(batch, num_q_heads, block_d // block_dr)](
            acc_part, m_part, l_part, out, out.stride(0), out.stride(1), num_partitions, num_q_heads,
            HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_DR=block_dr,
            CHUNK_P=min(DECODE_REDUCE_CHUNK, triton.next_power_of_2(num_partitions)), num_warps=4,
        )
    return out


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, *, scale: float,
                           sliding_window: int | None = None, num_splits: int | None = None,
                           max_context_len: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of one new token per sequence over its paged K/V (decode step); returns out.

    Args:
        q: [B, num_q_heads, head_dim], fp16/bf16/fp32, last dim contiguous. The token's own K/V must
            already be in the cache (`store_kv` first).
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], q's dtype; num_q_heads
            must be a multiple of num_kv_heads (GQA). Any block_size >= 1.
        block_tables: int32 [B, max_blocks]; only the first ceil(context_lens[b] / block_size)
            entries of row b are read (-1 or garbage past them is fine).
        context_lens: int32 [B], the number of keys of each sequence including the new token;
            0 marks a padding row (CUDA-graph batch padding), whose output is zeros.
        scale: softmax scale (1/sqrt(head_dim) for the usual models).
        sliding_window: the query at position n-1 sees keys n-window .. n-1 (the model's convention
            `i - window < j <= i`); None: all n keys.
        num_splits: context partitions (split-K / flash-decoding, merged by a second kernel); None
            picks `decode_num_splits` from B * num_kv_heads against the SM count; 1 forces one pass.
        max_context_len: a host bound on context_lens that sizes the partitions (default: the
            block-table capacity, max_blocks * block_size). Pass the scheduler's max so splits are
            not spread over empty table columns; under CUDA graphs pass the captured bound.
        out: optional preallocated [B, num_q_heads, head_dim] output (q's dtype).

    Returns out [B, num_q_heads, head_dim] in q's dtype; fp32 math inside.
    CUDA: Triton; CPU: the reference (which ignores num_splits / max_context_len).
    """
    if q.device.type == "cuda":
        return paged_decode_attention_triton(q, k_cache, v_cache, block_tables, context_lens, scale=scale,
                                             sliding_window=sliding_window, num_splits=num_splits,
                                             max_context_len=max_context_len, out=out)
    result = paged_decode_attention_ref(q, k_cache, v_cache, block_tables, context_lens, scale=scale,
                                        sliding_window=sliding_window)
    if out is None:
        return result
    _check_shape("out", out, q.shape, "the shape of q")
    return out.copy_(result)


# --------------------------------------------------------------------------------------------------
# prefill attention


def _check_prefill_args(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, k_cache, v_cache, block_tables,
                        sliding_window, max_seqlen_q, max_seqlen_k, *, reference: bool) -> tuple[int, int, int]:
    """Returns (num_kv_heads, group, block_size or 0 when dense)."""
    _check_float("q", q, reference=reference)
    _check_tensor("q", q, dim=3)
    if q.stride(-1) != 1:
        raise ValueError(f"q must be contiguous in its last (head_dim) dimension, got strides {q.stride()}")
    _, num_q_heads, head_dim = q.shape
    _check_tensor("cu_seqlens_q", cu_seqlens_q, dim=1, dtypes=(torch.int32,), device=q.device)
    _check_tensor("cu_seqlens_k", cu_seqlens_k, dim=1, dtypes=(torch.int32,), device=q.device)
    if cu_seqlens_q.numel() < 1:
        raise ValueError("cu_seqlens_q must have B + 1 >= 1 entries, got an empty tensor")
    _check_shape("cu_seqlens_k", cu_seqlens_k, cu_seqlens_q.shape, "B + 1, as cu_seqlens_q")
    batch = cu_seqlens_q.numel() - 1
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an int >= 0 (the longest sequence), got {value!r}")
    _check_scale_window(scale, sliding_window)
    if block_tables is None:
        if k_cache is not None or v_cache is not None:
            raise ValueError("k_cache and v_cache are only read through block_tables: pass block_tables too, "
                             "or leave them None for dense k/v")
        for name, t in (("k", k), ("v", v)):
            _check_tensor(name, t, dim=3, device=q.device)
            if t.dtype != q.dtype:
                raise ValueError(f"{name} is {t.dtype} but q is {q.dtype}: one dtype is expected")
            if t.stride(-1) != 1:
                raise ValueError(f"{name} must be contiguous in its last (head_dim) dimension, got strides {t.stride()}")
        if k.shape[2] != head_dim:
            raise ValueError(f"k has head_dim {k.shape[2]}, q has head_dim {head_dim}")
        _check_shape("v", v, k.shape, "the shape of k")
        num_kv_heads, block_size = k.shape[1], 0
    else:
        if k is not None or v is not None:
            raise ValueError("k and v must be None when block_tables is given: every key is read from "
                             "k_cache/v_cache (store_kv the new tokens first)")
        if k_cache is None or v_cache is None:
            raise ValueError("block_tables needs k_cache and v_cache")
        block_size, num_kv_heads = _check_cache(q, k_cache, v_cache, head_dim=head_dim, num_heads=None)
        _check_tensor("block_tables", block_tables, dim=2, dtypes=(torch.int32,), device=q.device)
        if block_tables.shape[0] != batch:
            raise ValueError(f"block_tables must have one row per sequence (B = {batch} from cu_seqlens_q), "
                             f"got shape {tuple(block_tables.shape)}")
        if block_tables.stride(-1) != 1:
            raise ValueError(f"block_tables must be contiguous in its last dimension, got strides "
                             f"{block_tables.stride()}")
    group = _check_heads(num_q_heads, num_kv_heads)
    return num_kv_heads, group, block_size


def prefill_attention_ref(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                          cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, *, scale: float,
                          k_cache: torch.Tensor | None = None, v_cache: torch.Tensor | None = None,
                          block_tables: torch.Tensor | None = None, sliding_window: int | None = None,
                          max_seqlen_q: int, max_seqlen_k: int,
                          compute_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Plain-torch reference of `prefill_attention`: one masked softmax attention per sequence in
    `compute_dtype` (default fp32; fp64 for fp64 inputs). Checks the cu_seqlens and block-id values."""
    _, group, block_size = _check_prefill_args(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, k_cache, v_cache,
                                               block_tables, sliding_window, max_seqlen_q, max_seqlen_k,
                                               reference=True)
    dtype = _compute_dtype(q.dtype, compute_dtype)
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    if cq[0] != 0 or cq[-1] != q.shape[0]:
        raise ValueError(f"cu_seqlens_q must run from 0 to total_q = {q.shape[0]}, got {cq}")
    total_k = None if block_tables is not None else k.shape[0]  # paged: any total
    if ck[0] != 0 or (total_k is not None and ck[-1] != total_k):
        raise ValueError(f"cu_seqlens_k must run from 0 to total_k = {total_k or 'anything'}, got {ck}")
    out = torch.zeros(q.shape, dtype=dtype, device=q.device)
    window = NO_WINDOW if sliding_window is None else sliding_window
    for b in range(len(cq) - 1):
        len_q, len_k = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
        if len_q < 0 or len_k < 0:
            raise ValueError(f"cu_seqlens_q and cu_seqlens_k must be non-decreasing, got {cq} and {ck}")
        if len_q > max_seqlen_q or len_k > max_seqlen_k:
            raise ValueError(f"sequence {b} has {len_q} queries and {len_k} keys, over max_seqlen_q = "
                             f"{max_seqlen_q} or max_seqlen_k = {max_seqlen_k}")
        if len_q == 0:
            continue
        if block_tables is None:
            keys, values = k[ck[b]:ck[b + 1]], v[ck[b]:ck[b + 1]]
        else:
            if len_k > block_tables.shape[1] * block_size:
                raise ValueError(f"sequence {b} has {len_k} keys, over block_tables width x block_size = "
                                 f"{block_tables.shape[1] * block_size}")
            blocks = block_tables[b, :math.ceil(len_k / block_size)]
            _check_block_ids(f"block_tables[{b}]", blocks, k_cache.shape[0])
            keys, values = _gather_keys(k_cache, blocks, len_k), _gather_keys(v_cache, blocks, len_k)
        keys = keys.to(dtype).repeat_interleave(group, dim=1)       # [len_k, Hq, D]
        values = values.to(dtype).repeat_interleave(group, dim=1)
        pos = torch.arange(len_q, device=q.device)[:, None] + (len_k - len_q)
        j = torch.arange(len_k, device=q.device)[None, :]
        visible = (j <= pos) & (j > pos - window)                    # [len_q, len_k]
        scores = torch.einsum("qhd,khd->hqk", q[cq[b]:cq[b + 1]].to(dtype), keys) * scale
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)        # a row that sees no key: zeros
        out[cq[b]:cq[b + 1]] = torch.einsum("hqk,khd->qhd", probs, values)
    return out.to(q.dtype)


def _prefill_config(q: torch.Tensor) -> dict:
    # H200 sweep (`python -m bench run --suite prefill_attention`, run 20261201T013708Z-8dc8, Qwen2-7B heads,
    # 8 x 2048 tokens, bf16): 64 x 64 tiles, 4 warps, 3 stages, 16-bit dots with P rounded once (flash-
    # attention's P) 257 TFLOP/s; P split in two at its best 215 (64 x 64, 4 warps, 2 stages); the previous
    # default (fp32 upcast, TF32 dots, 8 warps) 48. torch's varlen flash attention 270 in the same run. The
    # rollout's prefill feeds no cache and training's log-probs use flash's P as well, so the faster P wins here;
    # decode keeps the split P. Under the interpreter, 16 x 16 tiles so that the tests' short sequences still
    # span several tiles.
    tiles = (dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3) if q.device.type == "cuda"
             else dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1))
    return dict(tiles, DOT_16BIT=q.dtype != torch.float32, P_SPLIT=False)


def prefill_attention_triton(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                             cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, *, scale: float,
                             k_cache: torch.Tensor | None = None, v_cache: torch.Tensor | None = None,
                             block_tables: torch.Tensor | None = None, sliding_window: int | None = None,
                             max_seqlen_q: int, max_seqlen_k: int,
                             out: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """`prefill_attention` with the Triton kernel (CUDA, or CPU under TRITON_INTERPRET=1). `config` overrides
    the launch of `_prefill_config` (BLOCK_M, BLOCK_N, num_warps, num_stages, DOT_16BIT (default True for
    bf16/fp16; fp32 inputs: False only), P_SPLIT (default False)); see kernels/prefill_attention.py."""
    import triton

    from hybridengine.kernels.prefill_attention import prefill_attention_kernel

    _, group, block_size = _check_prefill_args(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, k_cache, v_cache,
                                               block_tables, sliding_window, max_seqlen_q, max_seqlen_k,
                                               reference=False)
    out = _output(out, q)
    batch, num_q_heads, head_dim = cu_seqlens_q.numel() - 1, q.shape[1], q.shape[2]
    if batch == 0 or q.shape[0] == 0 or max_seqlen_q == 0:
        return out
    cfg = _launch_config(_prefill_config(q), config, q.dtype)
    paged = block_tables is not None
    if paged:
        k_src, v_src, bt = k_cache, v_cache, block_tables
        strides = (k_cache.stride(1), k_cache.stride(2), v_cache.stride(1), v_cache.stride(2),
                   k_cache.stride(0), v_cache.stride(0), block_tables.stride(0))
        max_blocks = block_tables.shape[1]
    else:
        k_src, v_src, bt = k, v, cu_seqlens_k  # bt: unused (PAGED is a constexpr)
        strides = (k.stride(0), k.stride(1), v.stride(0), v.stride(1), 0, 0, 0)
        max_blocks = 0
    grid = (triton.cdiv(max_seqlen_q, cfg["BLOCK_M"]), batch, num_q_heads)
    prefill_attention_kernel[grid](
        q, k_src, v_src, cu_seqlens_q, cu_seqlens_k, bt, out,
        q.stride(0), q.stride(1), *strides, out.stride(0), out.stride(1),
        scale * math.log2(math.e), NO_WINDOW if sliding_window is None else sliding_window, max_blocks,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), PAGED=paged,
        PAGE_SIZE=max(block_size, 1), DOT_PRECISION=_dot_precision(q.dtype),
        UPCAST_BF16_DOT=q.device.type != "cuda" and q.dtype == torch.bfloat16, **cfg,
    )
    return out


@functools.cache
def _flash_attn_varlen():
    """flash-attn's `flash_attn_varlen_func`, or None when flash-attn is not installed (optional)."""
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:  # (also raised for a flash-attn built against another torch)
        return None
    return flash_attn_varlen_func


def _flash_attn_applies(q: torch.Tensor, k_cache: torch.Tensor | None, block_tables: torch.Tensor | None) -> bool:
    # flash-attn 2 reads a paged cache only with page_block_size % 256 == 0 (nano-vllm uses 256).
    return (q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256
            and (block_tables is None or k_cache.shape[1] % 256 == 0) and _flash_attn_varlen() is not None)


def prefill_attention(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                      cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, *, scale: float,
                      k_cache: torch.Tensor | None = None, v_cache: torch.Tensor | None = None,
                      block_tables: torch.Tensor | None = None, sliding_window: int | None = None,
                      max_seqlen_q: int, max_seqlen_k: int) -> torch.Tensor:
    """Causal attention over packed variable-length sequences (prefill, chunked prefill, shared prefixes).

    Args:
        q: [total_q, num_q_heads, head_dim], fp16/bf16/fp32, last dim contiguous; sequence b owns rows
            cu_seqlens_q[b] .. cu_seqlens_q[b+1].
        k, v: dense mode (block_tables None): [total_k, num_kv_heads, head_dim], sequence b owns rows
            cu_seqlens_k[b] .. cu_seqlens_k[b+1]. Paged mode: must be None.
        cu_seqlens_q, cu_seqlens_k: int32 [B + 1], cumulative lengths from 0. len_k >= len_q is the
            normal case: the mask is causal and bottom-right aligned, query i at key position
            len_k - len_q + i sees keys j <= that position (a query that sees no key gets zeros).
        scale: softmax scale.
        k_cache, v_cache, block_tables: paged mode, given together. Every key j < len_k of sequence b
            is read from the cache at block block_tables[b, j // block_size], offset j % block_size:
            the prompt prefix cached once for the n samples of a prompt, earlier chunks of a chunked
            prefill, and the new tokens themselves, which must be stored first (`store_kv`).
            block_tables is int32 [B, max_blocks]; entries past ceil(len_k / block_size) are not read.
        sliding_window: query at position i sees keys i - window < j <= i; None: no window.
        max_seqlen_q, max_seqlen_k: host ints >= the longest len_q / len_k (they size the grid; the
            values of cu_seqlens are checked by the reference only).

    Returns [total_q, num_q_heads, head_dim] in q's dtype; fp32 math inside. CUDA: flash-attn's
    `flash_attn_varlen_func` when installed (fp16/bf16, head_dim <= 256, and in paged mode
    block_size % 256 == 0), else Triton; CPU: the reference.
    """
    if q.device.type != "cuda":
        return prefill_attention_ref(q, k, v, cu_seqlens_q, cu_seqlens_k, scale=scale, k_cache=k_cache,
                                     v_cache=v_cache, block_tables=block_tables, sliding_window=sliding_window,
                                     max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
    if _flash_attn_applies(q, k_cache, block_tables):
        _check_prefill_args(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, k_cache, v_cache, block_tables,
                            sliding_window, max_seqlen_q, max_seqlen_k, reference=False)
        paged = block_tables is not None
        return _flash_attn_varlen()(
            q, k_cache if paged else k, v_cache if paged else v, cu_seqlens_q, cu_seqlens_k,
            max_seqlen_q, max_seqlen_k, softmax_scale=scale, causal=True,
            window_size=(-1, -1) if sliding_window is None else (sliding_window - 1, 0),
            block_table=block_tables)
    return prefill_attention_triton(q, k, v, cu_seqlens_q, cu_seqlens_k, scale=scale, k_cache=k_cache,
                                    v_cache=v_cache, block_tables=block_tables, sliding_window=sliding_window,
                                    max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)


def implementations(device_type: str) -> dict[str, str]:
    """Which implementation each attention op runs on this device type (for `hybridengine info`)."""
    if device_type != "cuda":
        return {op: "torch reference" for op in ("store_kv", "paged_decode_attention", "prefill_attention")}
    prefill = "flash-attn varlen (block_size % 256 == 0) else Triton" if _flash_attn_varlen() else "Triton"
    return {"store_kv": "Triton", "paged_decode_attention": "Triton (split-K below one program per SM)",
            "prefill_attention": prefill}
