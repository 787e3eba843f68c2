"""Paged decode attention: one new query token per sequence over its K/V in the paged cache.

Layers: `paged_decode_attention_ref` (plain torch: gather each sequence's K/V, softmax attention),
`paged_decode_attention_triton` (the launcher of `kernels.paged_attention`: output and split-K buffers,
the partition plan, the launch config) and `paged_decode_attention`, the op, which checks its arguments and
runs the launcher on CUDA, the reference elsewhere. The cache layout is `hybridengine.ops.kv_store`'s.

Split-K (flash-decoding): with few (sequence, kv head) programs for the SMs, each context is split in
partitions whose partial softmax results a second kernel merges. The plan (`decode_num_splits`,
`decode_partitions`) depends on host integers only, so a CUDA graph captured at a given batch size and
context bound stays valid. Index tensors (block tables, context lengths) are int32; their values are
checked by the reference only (reading them would synchronise with the GPU).
"""

from __future__ import annotations

import functools
import math

import torch

from hybridengine.checks import FLOAT_DTYPES, number, tensor
from hybridengine.ops import _launch
from hybridengine.ops.kv_store import check_cache

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
multiple of the SMs would pay a whole extra wave. The merge runs as a second kernel: merging in each
head's last partition program instead was slower in every case of the split sweep (one program's
dependent loads of all the partials cost more than the second launch)."""
DECODE_SPLIT_BELOW = 0.5
"""No split while B * num_kv_heads >= this fraction of the SMs: the plan is fixed at CUDA-graph capture
for the cache's capacity, so at decode batch sizes (B = 64, 2 kv heads: 128 programs) a split would
mostly add empty partitions and the merge kernel."""
DECODE_PREFETCH_PROGRAMS = 2
"""A one-pass launch of at most this many programs per SM (B * num_kv_heads <= 2 x SMs: Qwen2.5-1.5B, and
Qwen2-7B at tg = 2, have 2 kv heads per rank) takes 64-token tiles, 8 warps and the register prefetch
(config PREFETCH) instead of 32-token tiles in Triton's 4-stage pipeline: faster in the kernel sweep
(`--suite paged_attention_prefetch`) at those shapes and never slower on the real decode step; with more
programs per SM it loses."""


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
    keeping partitions >= DECODE_MIN_PARTITION tokens. Qwen2-7B per GPU (4 kv heads) on 132 SMs:
    B >= 17 does not split; B = 16 splits in 4 (contexts >= 512); B = 1 in 66 (16k: 64 partitions
    of 256 once rounded to 128-token tiles; 4k: 32 of 128).
    Depends on host integers only, so a CUDA graph captured at a given (B, max_context_len) stays valid.
    """
    programs = batch * num_kv_heads
    if programs == 0 or programs >= DECODE_SPLIT_BELOW * num_sms:
        return 1
    want = DECODE_TARGET_WAVES * num_sms // programs
    return max(1, min(want, math.ceil(max_context_len / DECODE_MIN_PARTITION), DECODE_MAX_SPLITS))


def _decode_config(device: torch.device, head_dim: int, split: bool = False, programs: int | None = None) -> dict:
    """The decode kernel's launch (tile BLOCK_N, warps, stages, PREFETCH where it applies). Chosen on the
    real decode step (`python -m hybridengine_bench.probes.profile_decode --kernel-configs`), which the
    cold-L2 kernel sweep agrees with: 32-token tiles in 4 stages; a split launch (few sequences, long
    contexts) takes 128-token tiles in 3 stages (see DECODE_TARGET_WAVES), a launch of few programs the
    register prefetch (see DECODE_PREFETCH_PROGRAMS). Under the interpreter, 32-token tiles and one stage
    keep the tests fast."""
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


def check_decode_args(op: str, q, k_cache, v_cache, block_tables, context_lens, scale, sliding_window, out) -> int:
    """The arguments every paged decode op shares (`paged_decode_attention`, `exact_decode_attention`): q, the
    cache, scale and window, block tables, context lengths and `out`. Returns the cache's block size."""
    tensor(op, "q", q, dim=3, dtypes=FLOAT_DTYPES, contiguous_last=True)
    batch, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = check_cache(op, k_cache, v_cache, q, head_dim=head_dim)
    _launch.check_attention(op, scale, sliding_window, num_q_heads, num_kv_heads)
    tensor(op, "block_tables", block_tables, dim=2, dtypes=(torch.int32,), device=q.device, contiguous_last=True)
    if block_tables.shape[0] != batch:
        raise ValueError(f"{op}: block_tables must have one row per sequence of q ({batch}), got shape "
                         f"{tuple(block_tables.shape)}")
    tensor(op, "context_lens", context_lens, shape=(batch,), dtypes=(torch.int32,), device=q.device)
    if out is not None:
        tensor(op, "out", out, shape=q.shape, dtypes=(q.dtype,), device=q.device, contiguous_last=True)
    return block_size


def _check(q, k_cache, v_cache, block_tables, context_lens, scale, sliding_window, num_splits, max_context_len,
           out) -> None:
    op = "paged_decode_attention"
    block_size = check_decode_args(op, q, k_cache, v_cache, block_tables, context_lens, scale, sliding_window, out)
    if num_splits is not None:
        number(op, "num_splits", num_splits, low=1, high=DECODE_MAX_SPLITS, integer=True)
    if max_context_len is not None:
        number(op, "max_context_len", max_context_len, low=1, high=max(block_tables.shape[1] * block_size, 1),
               integer=True)


def _gather_keys(cache: torch.Tensor, blocks: torch.Tensor, n: int) -> torch.Tensor:
    """The first n tokens [n, num_kv_heads, head_dim] of a sequence whose blocks are `blocks`."""
    return cache[blocks.long()].reshape(-1, *cache.shape[2:])[:n]


def paged_decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor, *, scale: float,
                               sliding_window: int | None = None,
                               compute_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Plain-torch reference of `paged_decode_attention`: per sequence, gather its K/V from the blocks
    and run softmax attention in `compute_dtype` (default fp32; fp64 for fp64 inputs). Checks the
    index values (context length within the block table, block ids within the cache)."""
    block_size = k_cache.shape[1]
    group = q.shape[1] // k_cache.shape[2]
    dtype = _launch.reference_dtype(q.dtype, compute_dtype)
    out = torch.zeros(q.shape, dtype=dtype, device=q.device)
    for b, n in enumerate(context_lens.tolist()):
        if n < 0 or n > block_tables.shape[1] * block_size:
            raise ValueError(f"context_lens[{b}] = {n} is outside [0, {block_tables.shape[1] * block_size}] "
                             f"(block_tables width x block_size)")
        if n == 0:  # a padding row
            continue
        blocks = block_tables[b, :math.ceil(n / block_size)]
        if int(blocks.min()) < 0 or int(blocks.max()) >= k_cache.shape[0]:
            raise ValueError(f"block_tables[{b}] has block ids {blocks.tolist()} outside [0, {k_cache.shape[0]}) "
                             f"among the used blocks")
        start = 0 if sliding_window is None else max(0, n - sliding_window)
        k = _gather_keys(k_cache, blocks, n)[start:].to(dtype).repeat_interleave(group, dim=1)  # [n, Hq, D]
        v = _gather_keys(v_cache, blocks, n)[start:].to(dtype).repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[b].to(dtype), k) * scale
        out[b] = torch.einsum("hn,nhd->hd", torch.softmax(scores, dim=-1), v)
    return out.to(q.dtype)


def paged_decode_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                  block_tables: torch.Tensor, context_lens: torch.Tensor, *, scale: float,
                                  sliding_window: int | None = None, num_splits: int | None = None,
                                  max_context_len: int | None = None,
                                  out: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """`paged_decode_attention` with the Triton kernels (CUDA, or CPU under TRITON_INTERPRET=1).

    `config` overrides the launch of `_decode_config`: BLOCK_N, num_warps, num_stages and PREFETCH (bool:
    load the next K/V tile into registers before the current tile's math, see the kernel); the tuning
    sweeps of hybridengine_bench/paged_attention.py use it."""
    import triton

    from hybridengine.kernels.paged_attention import paged_decode_kernel, paged_decode_reduce_kernel

    batch, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert k_cache.shape[3] == head_dim and k_cache.dtype == q.dtype and num_q_heads % num_kv_heads == 0
    assert block_tables.dtype == context_lens.dtype == torch.int32 and q.stride(-1) == k_cache.stride(-1) == 1
    if max_context_len is None:
        max_context_len = block_tables.shape[1] * block_size
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out
    if batch == 0:
        return out

    if num_splits is None:
        num_splits = decode_num_splits(batch, num_kv_heads, max_context_len, num_sms(q.device))
    cfg = _launch.launch_config({"PREFETCH": False} | _decode_config(q.device, head_dim, num_splits > 1,
                                                                     programs=batch * num_kv_heads), config)
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
        scale * math.log2(math.e), _launch.NO_WINDOW if sliding_window is None else sliding_window,
        block_tables.shape[1], partition_size, num_partitions,
        GROUP=num_q_heads // num_kv_heads, GROUP_PAD=max(16, triton.next_power_of_2(num_q_heads // num_kv_heads)),
        HEAD_DIM=head_dim, BLOCK_D=block_d, PAGE_SIZE=block_size, BLOCK_N=block_n, SPLIT=split,
        **_launch.dot_flags(q), **cfg,
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
    CUDA: Triton; elsewhere: the reference (which ignores num_splits / max_context_len).
    """
    _check(q, k_cache, v_cache, block_tables, context_lens, scale, sliding_window, num_splits, max_context_len, out)
    if _launch.use_kernel(q):
        return paged_decode_attention_triton(q, k_cache, v_cache, block_tables, context_lens, scale=scale,
                                             sliding_window=sliding_window, num_splits=num_splits,
                                             max_context_len=max_context_len, out=out)
    result = paged_decode_attention_ref(q, k_cache, v_cache, block_tables, context_lens, scale=scale,
                                        sliding_window=sliding_window)
    return result if out is None else out.copy_(result)


def implementations(device_type: str) -> dict[str, str]:
    """Which implementation each op of this module runs on this device type (for `hybridengine info`)."""
    return {"paged_decode_attention": "Triton (split-K when B x kv heads < half the SMs)" if device_type == "cuda"
            else "torch reference"}
