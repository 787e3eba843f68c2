"""The paged KV cache and its size: one allocation for every layer's K and V blocks."""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from hybridengine.config import EngineConfig
    from hybridengine.model.config import ModelConfig


CPU_KV_CACHE_BYTES = 4 * 2**30
"""The default KV cache budget off CUDA (also at most half the available memory). CPU runs are tests
and demos: sizing for max_num_seqs x max_model_len asks 28 GiB for Qwen2.5-1.5B at the defaults. An
explicit `EngineConfig.num_kv_blocks` goes past it, up to the available memory."""


class KVCache:
    """One allocation [layers, 2, num_blocks, block_size, kv_heads, head_dim], per-layer views."""

    def __init__(self, *, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.data = torch.empty(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
        self.layers = [(self.data[i, 0], self.data[i, 1]) for i in range(num_layers)]

    @staticmethod
    def bytes_per_block(*, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return num_layers * 2 * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: dst block := src block, in every layer, K and V."""
        if copies:  # (a pageable copy with non_blocking=False would wait for the GPU)
            src, dst = torch.tensor(copies).t().to(self.data.device, non_blocking=True)
            self.data[:, :, dst] = self.data[:, :, src]

    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


def _shape(config: EngineConfig, model: ModelConfig) -> dict:
    return dict(num_layers=model.num_hidden_layers, block_size=config.block_size, num_kv_heads=model.num_key_value_heads,
                head_dim=model.head_dim)


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
    free, total = torch.cuda.mem_get_info(device)
    # Blocks torch's allocator holds but no tensor uses are free for the cache too (the driver counts
    # them as used: after a previous engine or rollout they can be most of the GPU).
    free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    # Leave room for activations of the largest prefill step and the logits of a decode step.
    reserve = 2 * config.max_num_batched_tokens * max(model.hidden_size, model.intermediate_size) * 4 \
        + config.max_num_seqs * model.vocab_size * 4 * 2
    budget = int(total * config.gpu_memory_utilization) - (total - free) - reserve
    if budget // per_block < math.ceil(config.max_model_len / config.block_size):
        raise RuntimeError(f"rank {rank}: the KV cache budget ({budget / 2**30:.2f} GiB at "
                           f"gpu_memory_utilization={config.gpu_memory_utilization}) does not hold one sequence of "
                           f"max_model_len={config.max_model_len}; raise gpu_memory_utilization or lower max_model_len")
    return min(budget // per_block, most)


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


def available_memory() -> int | None:
    """Bytes of host memory available to a new allocation (Linux MemAvailable; free pages elsewhere),
    or None when the system does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def allocate_kv_cache(config: EngineConfig, model: ModelConfig, device: torch.device, *, rank: int = 0) -> KVCache:
    """The rollout's KV cache, sized by `num_kv_blocks`."""
    return KVCache(num_blocks=num_kv_blocks(config, model, device, rank=rank), dtype=config.dtype, device=device,
                   **_shape(config, model))
