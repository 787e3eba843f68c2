"""When the optimizer state leaves the device and comes back (`EngineConfig.offload`), as the engine's calls see it.

`StateOffload` (train/offload.py) moves the state; `OffloadPolicy` decides when. The engine holds one and
calls its verbs (docs/memory.md describes the modes):

- `start`: a rollout is coming. Offload 'rollout' begins the state's copy to host memory: early in
  `prepare_rollout` (behind the last step's queued work), or in rollout()'s check, before any collective,
  so that a host that cannot hold the state raises on every rank with the state still on the device. A
  cache that grows (`cache_grows`) only makes the host allocation there; its copy starts in `kv_cache`.
- `kv_cache`: rollout() entry, after the switch. A cache that grows starts the copy and begins in the
  memory free now; any other cache waits for the copy and is sized once.
- `grow`: the scheduler's callback when the cache is full: wait for the copy, and map the state's memory
  into the cache.
- `cancel`: the end of every rollout. A copy whose memory the cache never took is dropped, and the state
  stays on the device: nothing has to come back.
- `bring_back`: a training call. Offload 'rollout' starts the copy back (the optimizer step joins it);
  'optimizer' makes the host allocation at the first stepping call's check, before any work.
- `report`: where the state is, for memory_report.

The verbs note their costs in the engine's `stats`: `offload_wait_s`, `kv_grow_s`, `offload_start_out_s`,
`offload_start_back_s`, `offload_copy_out_s`, `offload_copy_back_s`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from hybridengine.sharding.generation_memory import vmm_status
from hybridengine.train.offload import OffloadError

if TYPE_CHECKING:
    from hybridengine.config import EngineConfig
    from hybridengine.train.trainer import Trainer


class _Growth:
    """The open rollout's growing KV cache."""

    def __init__(self, kv):
        self.kv = kv
        self.per_block = kv.capacity_bytes() // kv.capacity
        self.grown = False


class OffloadPolicy:
    """EngineConfig.offload for one engine. `trainer`: the engine's Trainer, or None before the first training
    call (its optimizer, and with it the state, can appear and be replaced between calls). `config.offload`
    is read at each call. `tp_generation`: generation is tensor-parallel (the ranks' caches must stay alike,
    so none grows). `kv_budget`: the bytes the KV cache may take on the CUDA device now (the rollout's
    `cuda_budget`: train/ does not import rollout/)."""

    def __init__(self, config: EngineConfig, device: torch.device, *, trainer: Callable[[], Trainer | None],
                 stats: dict[str, float], tp_generation: bool, kv_budget: Callable[[], int]):
        self.config, self.device = config, device
        self.trainer, self.stats, self.tp_generation, self.kv_budget = trainer, stats, tp_generation, kv_budget
        self._growth: _Growth | None = None

    def has_state(self) -> bool:
        """The AdamW state exists (it appears at the first optimizer step)."""
        trainer = self.trainer()
        return trainer is not None and trainer.has_optimizer

    def cache_grows(self) -> bool:
        """The rollout's KV cache starts in the memory free at entry, with the state's copy to host memory
        running, and grows into the state's memory when it is full (no wait at entry): offload 'rollout'
        on CUDA with the VMM API, one generation rank per group."""
        return (self.config.offload == "rollout" and self.has_state() and not self.tp_generation
                and self.device.type == "cuda" and vmm_status(self.device.index or 0)[0])

    def start(self, *, early: bool = False) -> None:
        """A rollout is coming: begin the state's copy to host memory (offload 'rollout'). `early`
        (prepare_rollout): only for a cache that cannot grow, and a refused host allocation is left for
        rollout()'s check to raise. Otherwise (rollout()'s check, before any collective): raises
        `OffloadError` with the state still on the device; a cache that grows makes the host allocation
        only, and its copy starts at entry (`kv_cache`)."""
        if self.config.offload != "rollout" or not self.has_state():
            return
        offload = self.trainer().optimizer.offload
        if early:
            if not self.cache_grows():
                try:  # behind the step's queued work; rollout() joins it
                    offload.to_host(wait=False)
                except OffloadError:
                    pass  # nothing moved; rollout() raises it on every rank
        elif self.cache_grows():
            offload.prepare_host()
        else:
            offload.to_host(wait=False)

    def kv_cache(self, allocate: Callable[..., object]):
        """rollout() entry, after the switch: (the rollout's KV cache, the scheduler's grow callback or None).
        `allocate(freed_bytes=0)` makes the cache (`allocate_kv_cache`). A cache that grows starts the copy
        out now and begins in the memory free now (the caching allocator's idle blocks given back first:
        the cache maps memory outside it); any other cache waits for the copy out and is sized once."""
        t0 = time.perf_counter()
        grow = None
        if self.cache_grows():
            offload = self.trainer().optimizer.offload
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            freed = offload.device_state_bytes()
            offload.to_host(wait=False)
            kv = allocate(freed_bytes=freed)
            self._growth, grow = _Growth(kv), self.grow
        else:
            self._join()  # the KV cache is sized with the state's memory free
            kv = allocate()
        self.stats["offload_wait_s"] = time.perf_counter() - t0
        return kv, grow

    def grow(self) -> int:
        """The scheduler's `grow` callback (`Scheduler.grow`): the cache is full (the scheduler would otherwise
        preempt, or could not start a request), so wait for the copy out, give the state's device memory back
        to the driver, and grow the cache into it; the new block count, or 0 once grown. Not before: a
        rollout that fits in the memory free at entry leaves the state on the device (`cancel`)."""
        g = self._growth
        if g is None or g.grown:
            return 0
        t0 = time.perf_counter()
        self._join()  # the state's device memory goes back to torch's allocator ...
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # ... and to the driver, for the cache to map
            budget = self.kv_budget()
        else:  # (tests) off CUDA the cache holds its whole capacity from the start
            budget = g.kv.capacity_bytes()
        g.kv.grow_to(g.kv.num_blocks + max(budget, 0) // g.per_block)
        self.stats["kv_grow_s"] = time.perf_counter() - t0
        g.grown = True
        return g.kv.num_blocks

    def cancel(self) -> None:
        """The end of every rollout (also after an error), once nothing in flight touches the cache: a cache
        that never needed the state's memory leaves the state on the device, unchanged, so its host copy is
        dropped (once its copies are done) and nothing comes back."""
        g, self._growth = self._growth, None
        if g is not None and not g.grown:
            offload = self.trainer().optimizer.offload
            if offload.cancel_to_host():
                self._note(offload)

    def bring_back(self, *, stepping: bool) -> None:
        """A training call (the trainer exists): 'rollout' starts copying the state back to the device (the
        optimizer step joins it; log_probs runs meanwhile); 'optimizer' makes the host state at the first
        stepping call's check, so that a host that cannot hold it fails the call before any work."""
        trainer = self.trainer()
        if self.config.offload == "rollout" and trainer.has_optimizer:
            trainer.optimizer.offload.to_device()
        elif self.config.offload == "optimizer" and stepping:
            trainer.optimizer  # noqa: B018 - allocates the host state (raises OffloadError before anything moves)

    def report(self) -> dict[str, float]:
        """GiB of the state on the device (`optimizer`; 0 before the first step), its live copy in host memory
        (`host_optimizer`; a transfer in flight counts at its source) and the host allocation the offload
        holds (`host_pinned_total`, pinned on CUDA)."""
        gib = 2**30
        tensors = self.trainer().optimizer.state_tensors() if self.has_state() else []
        state = sum(t.numel() * t.element_size() for t in tensors)
        offload = self.trainer().optimizer.offload if tensors else None
        host = offload.host_state_bytes() if offload is not None else 0
        pinned = offload.host.nbytes if offload is not None and offload.host is not None else 0
        return dict(optimizer=(state - host) / gib, host_optimizer=host / gib, host_pinned_total=pinned / gib)

    def _join(self) -> None:
        """Wait for the state's copy out, then note in `stats` what the round trip cost: the host seconds of
        the calls that started each direction (`offload_start_out_s`, `offload_start_back_s`: allocation and
        launch) and the device seconds of the copies (`offload_copy_out_s`, and `offload_copy_back_s` of the
        copy back before it; CUDA only)."""
        if self.config.offload != "none" and self.has_state():
            offload = self.trainer().optimizer.offload
            offload.join()
            self._note(offload)

    def _note(self, offload) -> None:
        """`stats` of the offload's last transfers (see `_join`)."""
        for target, way in (("host", "out"), ("device", "back")):
            if target in offload.start_seconds:
                self.stats[f"offload_start_{way}_s"] = offload.start_seconds[target]
            copy = offload.copy_seconds(target)
            if copy is not None:
                self.stats[f"offload_copy_{way}_s"] = copy
