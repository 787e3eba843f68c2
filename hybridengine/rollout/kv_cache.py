"""The paged KV cache and its size: one allocation for every layer's K and V blocks."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from hybridengine.memory import available_memory

if TYPE_CHECKING:
    from hybridengine.config import EngineConfig
    from hybridengine.model.config import ModelConfig


CPU_KV_CACHE_BYTES = 4 * 2**30
"""The default KV cache budget off CUDA (also at most half the available memory). CPU runs are tests
and demos: sizing for max_num_seqs x max_model_len asks 28 GiB for Qwen2.5-1.5B at the defaults. An
explicit `EngineConfig.num_kv_blocks` goes past it, up to the available memory."""


class KVCache:
    """One allocation [layers, 2, capacity, block_size, kv_heads, head_dim], per-layer views.

    The first `num_blocks` blocks of each layer's K and V are usable; `grow_to` makes more of the
    `capacity` usable. On CUDA with `use_vmm` the allocation is a reserved address range (`VmmRange`)
    whose (layer, K/V) planes are backed piece by piece, so the cache can start small and grow into
    memory that is freed while it runs (offload 'rollout': the optimizer state's, once it is in host
    memory). Growth steps are whole mapping granules in every plane. Without
    VMM the whole capacity is allocated at once and growth only raises `num_blocks` (the same
    bookkeeping, for tests off CUDA)."""

    def __init__(self, *, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, capacity: int | None = None, use_vmm: bool = False):
        capacity = num_blocks if capacity is None else capacity
        if not 0 <= num_blocks <= capacity or capacity < 1:
            raise ValueError(f"KVCache: need 0 <= num_blocks ({num_blocks}) <= capacity ({capacity}) and capacity >= 1")
        self.block_size, self.capacity = block_size, capacity
        shape = (num_layers, 2, capacity, block_size, num_kv_heads, head_dim)
        self.block_bytes = block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
        """Bytes of one block in one (layer, K/V) plane."""
        self.vmm = None
        self.num_blocks = 0
        self._mapped: list[int] = []  # byte offsets of the VMM range's mappings, one per plane and growth step
        if use_vmm:
            from hybridengine.sharding.vmm import VmmRange

            self.vmm = VmmRange(num_layers * 2 * capacity * self.block_bytes, device.index or 0)
            self.granule_blocks = self.vmm.granularity // math.gcd(self.vmm.granularity, self.block_bytes)
            """Blocks per growth step: the fewest whose bytes in a plane are a multiple of the granularity."""
            if capacity % self.granule_blocks:
                raise ValueError(f"KVCache: capacity={capacity} must be a multiple of {self.granule_blocks} blocks "
                                 "with use_vmm (`KVCache.granule` rounds a count down to one)")
            self.data = self.vmm.tensor(dtype, 0, num_layers * 2 * capacity * self.block_bytes).view(shape)
        else:
            self.granule_blocks = 1
            self.data = torch.empty(shape, dtype=dtype, device=device)
        self.layers = [(self.data[i, 0], self.data[i, 1]) for i in range(num_layers)]
        self.grow_to(num_blocks)

    @staticmethod
    def granule(device: torch.device, block_bytes: int) -> int:
        """Blocks per growth step of a VMM cache on `device` whose blocks take `block_bytes` per plane."""
        from hybridengine.sharding.generation_memory import vmm_status
        from hybridengine.sharding.vmm import VmmRange

        if device.type != "cuda" or not vmm_status(device.index or 0)[0]:
            return 1
        gran = VmmRange(1, device.index or 0).granularity
        return gran // math.gcd(gran, block_bytes)

    def grow_to(self, num_blocks: int) -> int:
        """Make the first `num_blocks` blocks usable (at most `capacity`; with VMM rounded down to whole
        growth steps; never fewer than now). All or nothing: a mapping the driver refuses unmaps what
        this call mapped and raises. Returns the usable blocks."""
        target = min(num_blocks, self.capacity)
        target -= target % self.granule_blocks
        if target <= self.num_blocks:
            return self.num_blocks
        if self.vmm is not None:
            start, size = self.num_blocks * self.block_bytes, (target - self.num_blocks) * self.block_bytes
            plane = self.capacity * self.block_bytes
            done = []
            try:
                for p in range(self.data.shape[0] * 2):
                    self.vmm.map(p * plane + start, size)
                    done.append(p * plane + start)
            except RuntimeError:
                for off in done:
                    self.vmm.unmap(off)
                raise
            self._mapped += done
        self.num_blocks = target
        return target

    def release(self) -> None:
        """Give a VMM cache's memory back to the driver now (the caller has waited for every kernel
        that touches it; the views must not be touched again). No-op without VMM."""
        if self.vmm is not None:
            while self._mapped:
                self.vmm.unmap(self._mapped.pop())
            self.num_blocks = 0

    @staticmethod
    def bytes_per_block(*, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        return num_layers * 2 * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: dst block := src block, in every layer, K and V."""
        if copies:  # (a pageable copy with non_blocking=False would wait for the GPU)
            src, dst = torch.tensor(copies).t().to(self.data.device, non_blocking=True)
            self.data[:, :, dst] = self.data[:, :, src]

    def nbytes(self) -> int:
        """Bytes of the usable blocks (with VMM: the memory mapped)."""
        return self.data.shape[0] * 2 * self.num_blocks * self.block_bytes

    def capacity_bytes(self) -> int:
        return self.data.shape[0] * 2 * self.capacity * self.block_bytes


def _shape(config: EngineConfig, model: ModelConfig) -> dict:
    return dict(num_layers=model.num_hidden_layers, block_size=config.block_size,
                num_kv_heads=model.num_key_value_heads, head_dim=model.head_dim)


def num_kv_blocks(config: EngineConfig, model: ModelConfig, device: torch.device, *, rank: int = 0) -> int:
    """How many blocks the rollout's cache gets: `config.num_kv_blocks` when set (off CUDA: when the
    available memory holds it); on CUDA what the memory budget leaves (gpu_memory_utilization of the
    GPU, less what is in use and a reserve for the largest step's activations and logits); off CUDA
    what CPU_KV_CACHE_BYTES and half the available memory allow; at most what running sequences can
    ever hold. `model` is the config of the model as this rank runs it (under TP: its heads). Raises
    when max_model_len exceeds the model's positions or one sequence of it does not fit."""
    config.check_model(model)
    per_block = KVCache.bytes_per_block(dtype=config.dtype, **_shape(config, model))
    # What running sequences can ever hold (forks share blocks; a preempted one frees its own).
    one_seq = math.ceil(config.max_model_len / config.block_size)
    most = config.max_num_seqs * one_seq
    if device.type != "cuda":
        return _host_blocks(config, per_block, one_seq, most, rank)
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    budget = cuda_budget(config, model, device)
    if budget // per_block < one_seq:
        raise RuntimeError(f"rank {rank}: the KV cache budget ({budget / 2**30:.2f} GiB at "
                           f"gpu_memory_utilization={config.gpu_memory_utilization}) does not hold one sequence of "
                           f"max_model_len={config.max_model_len}; raise gpu_memory_utilization or lower max_model_len")
    return min(budget // per_block, most)


def cuda_budget(config: EngineConfig, model: ModelConfig, device: torch.device) -> int:
    """Bytes the KV cache may take on a CUDA device now: gpu_memory_utilization of the GPU, less what is
    in use and a reserve for the largest step's activations and logits (may be negative)."""
    free, total = torch.cuda.mem_get_info(device)
    # Blocks torch's allocator holds but no tensor uses are free for the cache too (the driver counts
    # them as used: after a previous engine or rollout they can be most of the GPU).
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    # Leave room for activations of the largest prefill step and the logits of a decode step.
    reserve = 2 * config.max_num_batched_tokens * max(model.hidden_size, model.intermediate_size) * 4 \
        + config.max_num_seqs * model.vocab_size * 4 * 2
    return int(total * config.gpu_memory_utilization) - (total - free) - reserve


def growing_kv_blocks(config: EngineConfig, model: ModelConfig, device: torch.device, *, budget: int,
                      freed_bytes: int, rank: int = 0) -> tuple[int, int, int]:
    """(blocks now, capacity, blocks per growth step) of a cache that starts in `budget` bytes and grows
    by `freed_bytes` (memory freed while the rollout runs), at most what running sequences can ever
    hold; both counts whole growth steps, at least one step now. Raises when the capacity does not hold
    one sequence of max_model_len."""
    config.check_model(model)
    shape = _shape(config, model)
    per_block = KVCache.bytes_per_block(dtype=config.dtype, **shape)
    step = KVCache.granule(device, per_block // (2 * shape["num_layers"]))
    one_seq = math.ceil(config.max_model_len / config.block_size)
    most = config.max_num_seqs * one_seq
    capacity = min((max(budget, 0) + freed_bytes) // per_block, -(-most // step) * step)
    capacity -= capacity % step
    if capacity < one_seq:
        raise RuntimeError(f"rank {rank}: the KV cache budget ({max(budget, 0) / 2**30:.2f} GiB now, "
                           f"{freed_bytes / 2**30:.2f} GiB more once the optimizer state is in host memory, at "
                           f"gpu_memory_utilization={config.gpu_memory_utilization}) does not hold one sequence of "
                           f"max_model_len={config.max_model_len}; raise gpu_memory_utilization or lower max_model_len")
    now = max(budget, 0) // per_block
    return max(step, min(now - now % step, capacity)), capacity, step


def _host_blocks(config: EngineConfig, per_block: int, one_seq: int, most: int, rank: int) -> int:
    """Off CUDA: an explicit size when the available memory holds it, else what CPU_KV_CACHE_BYTES and
    half the available memory allow, at most `most`. A torch.empty this large would succeed anyway
    (the pages are committed on first touch) and the process be killed later, so check now."""
    available = available_memory()
    if config.num_kv_blocks is not None:
        need = config.num_kv_blocks * per_block
        if available is not None and need > available:
            raise RuntimeError(f"rank {rank}: EngineConfig.num_kv_blocks={config.num_kv_blocks} needs "
                               f"{need / 2**30:.2f} GiB of KV cache, {available / 2**30:.2f} GiB of memory is "
                               "available")
        return config.num_kv_blocks
    budget = CPU_KV_CACHE_BYTES if available is None else min(CPU_KV_CACHE_BYTES, available // 2)
    if budget // per_block < one_seq:
        raise RuntimeError(f"rank {rank}: the KV cache budget off CUDA ({budget / 2**30:.2f} GiB: "
                           f"CPU_KV_CACHE_BYTES, at most half the available memory) does not hold one sequence of "
                           f"max_model_len={config.max_model_len} ({one_seq * per_block / 2**30:.2f} GiB); lower "
                           "max_model_len or set EngineConfig.num_kv_blocks")
    return min(budget // per_block, most)


def allocate_kv_cache(config: EngineConfig, model: ModelConfig, device: torch.device, *, rank: int = 0,
                      freed_bytes: int = 0) -> KVCache:
    """The rollout's KV cache, sized by `num_kv_blocks`; with `freed_bytes` (device memory that is freed
    while the rollout runs), a cache that starts in the memory free now and can grow by that much
    (`growing_kv_blocks`; VMM-backed on CUDA)."""
    if not freed_bytes:
        return KVCache(num_blocks=num_kv_blocks(config, model, device, rank=rank), dtype=config.dtype, device=device,
                       **_shape(config, model))
    if device.type == "cuda":
        budget = cuda_budget(config, model, device)
    else:
        budget = num_kv_blocks(config, model, device, rank=rank) * KVCache.bytes_per_block(
            dtype=config.dtype, **_shape(config, model))
    now, capacity, _ = growing_kv_blocks(config, model, device, budget=budget, freed_bytes=freed_bytes, rank=rank)
    return KVCache(num_blocks=now, capacity=capacity, dtype=config.dtype, device=device,
                   use_vmm=device.type == "cuda", **_shape(config, model))
