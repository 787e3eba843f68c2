"""The gradient shards of one rank: fp32, one per unit, filled by reduce-scatters during the backward.

The backward hands each unit's natural-layout fp32 gradient to `GradShards.reduce`, which reduce-scatters
it (`ShardedBuffer.reduce_scatter_grad`: packed to slice-major order, summed over the ranks) into this
rank's shard of the unit. A unit's first gradient of a step is written straight into its shard (no zeroing
pass), later ones (more micro-batches) are added. One reduce-scatter is in flight at a time, overlapping
the next unit's backward. `norm` is the step's global gradient norm, with each replicated parameter counted
once; `drop` lets go of a failed step's partial gradients.

Shards live from a unit's first reduce-scatter of a step to the end of its optimizer step (unless
keep_grads): with activations kept, the forward's peak then holds no gradients, as FSDP with set_to_none.

`add_embedding_grad_` is the embedding's backward, in the same order on every run and device.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from hybridengine.sharding.switch import ShardedBuffer


class GradShards:
    """The fp32 gradient shard of each unit of a ShardedBuffer, on this rank. `replicated_index`: per unit
    shard, the indices of copies of replicated parameters (norms and biases: each of the tg slices holds
    one), which the norm counts once."""

    def __init__(self, sharded: ShardedBuffer, replicated_index: list[torch.Tensor]):
        self.sharded, self.layout, self.device = sharded, sharded.layout, sharded.device
        self.replicated_index = replicated_index
        self._shards: list[torch.Tensor | None] | None = None
        self._fresh: set[int] = set()  # units whose shard this step has not written yet
        self._pending = None  # (work, input, out or None, unit) of the reduce-scatter in flight

    def all(self) -> list[torch.Tensor]:
        """Every unit's shard: the last step's with keep_grads, else (or after a failed step) zeros outside
        a step."""
        if self._shards is None:
            self._shards = [None] * len(self.layout.units)
        for u, g in enumerate(self._shards):
            if g is None:
                self._shards[u] = self._new(u).zero_()
        return self._shards

    def held(self) -> list[torch.Tensor]:
        """The shards that exist now (none between steps unless keep_grads); read-only use."""
        return [g for g in self._shards or [] if g is not None]

    def _new(self, u: int) -> torch.Tensor:
        """An uninitialised shard of unit u."""
        return torch.empty(self.layout.units[u].shard_numel, dtype=torch.float32, device=self.device)

    def begin(self) -> None:
        """A step starts: each unit's first reduce-scatter writes its shard (allocated then, kept ones
        reused), later ones add."""
        self._fresh = set(range(len(self.layout.units)))
        if self._shards is None:
            self._shards = [None] * len(self.layout.units)

    def zero_unreduced(self) -> None:
        """The end of a step's backward: a unit no micro-batch reduced has a zero gradient."""
        for u in self._fresh:
            self._shards[u] = self._new(u).zero_()

    def release(self) -> None:
        """Back to the allocator's cache (not keep_grads): the next forward's activations reuse it."""
        self._shards = None

    def natural(self, u: int) -> torch.Tensor:
        """A zeroed fp32 natural-layout gradient buffer of unit u (write with `natural_view`)."""
        unit = self.layout.units[u]
        return torch.zeros(unit.numel if self.layout.tp_size == 1 else unit.natural_numel, dtype=torch.float32,
                           device=self.device)

    def reduce(self, u: int, grads: dict[str, torch.Tensor] | None = None, natural: torch.Tensor | None = None) -> None:
        """Natural-layout fp32 gradients of unit u (by name, or an already filled `natural` buffer) -> summed
        over ranks into this rank's shard (written by the step's first, added after)."""
        # Asynchronous: the reduce-scatter of this unit runs while the next unit's backward computes (the
        # NCCL stream waits for the gradients queued so far); `finish` waits before the result is used. One
        # in flight, waited here first (its backward overlap is done), so its buffer is free before this
        # unit's is filled.
        self.finish()
        unit = self.layout.units[u]
        if natural is None:
            natural = self.natural(u)
            for name, g in grads.items():
                if g is not None:
                    self.layout.natural_view(natural, name).copy_(g)
        if u in self._fresh:  # the step's first gradient of this unit: straight into the shard
            if self._shards[u] is None:
                self._shards[u] = self._new(u)
            work = self.sharded.reduce_scatter_grad(u, natural, self._shards[u], async_op=True)
            self._fresh.discard(u)
            self._pending = (work, natural, None, u)
            return
        out = torch.empty(unit.shard_numel, dtype=torch.float32, device=self.device)
        work = self.sharded.reduce_scatter_grad(u, natural, out, async_op=True)
        self._pending = (work, natural, out, u)

    def finish(self) -> None:
        """Wait for the reduce-scatter in flight and add its result where it accumulates."""
        if self._pending is None:
            return
        work, _natural, out, u = self._pending
        self._pending = None
        if work is not None:
            work.wait()
        if out is not None:
            self._shards[u] += out

    def drop(self, wait: bool) -> None:
        """A step failed: let go of its partial gradients (up to 4 B per parameter of the shard), so the
        memory it took (an out-of-memory step's, say) is free again. `wait`: finish the reduce-scatter in
        flight first (a failure every rank raises alike, `LossFnError`); otherwise a peer may never join
        it, and the reference is dropped (the work keeps its buffers until it ends)."""
        try:
            if wait:
                self.finish()
        finally:
            self._pending = None
            self._shards, self._fresh = None, set()

    def norm(self) -> float:
        """The global gradient norm over every rank's shards (NaN or inf when a gradient is)."""
        # Replicated parameters have one copy per TP slice, each in some rank's shard: count 1/tg of each.
        tg = self.layout.tp_size
        # Sum of squares in one pass over each shard (fp32 norm, as torch's clip_grad_norm_), minus the
        # surplus of the replicated copies: (1 - 1/tg) of their squares. No fp64 copy of the gradients.
        norms = [torch.linalg.vector_norm(g).double() for g in self.all()]
        sq = torch.stack(norms).square().sum() if norms else torch.zeros((), dtype=torch.float64, device=self.device)
        if tg > 1:
            for g, index in zip(self.all(), self.replicated_index):
                if index.numel():
                    sq = sq - (1 - 1 / tg) * torch.linalg.vector_norm(g[index]).double().square()
        if not self.sharded.local and self.sharded.world_size > 1:
            dist.all_reduce(sq, group=self.sharded.group)
        return math.sqrt(max(float(sq), 0.0))  # NaN stays NaN; the same on every rank (sq is all-reduced)


def add_embedding_grad_(embed_grad: torch.Tensor, distinct: torch.Tensor, inverse: torch.Tensor,
                        grad_x: torch.Tensor) -> None:
    """embed_grad[v] += the sum of grad_x's rows at the tokens with id v, in the same order on every run
    and device: the micro-batch's `distinct` ids (sorted) and each token's index among them
    (`torch.unique(ids, sorted=True, return_inverse=True)`).

    `index_add_` over the tokens would be nondeterministic on CUDA (atomics: the rows of a repeated id
    add in a varying order), so a step would not repeat bit for bit and a resumed run would drift from
    an uninterrupted one. Here the embedding backward sums each id's rows into a compact [distinct
    ids, H] tensor (sorted segments, no atomics on CUDA; in token order on the CPU), and each distinct
    row is added once. Extra work: the sort of the micro-batch's ids and a [distinct ids, H] buffer."""
    rows = torch.ops.aten.embedding_dense_backward(grad_x.float(), inverse, distinct.numel(), -1, False)
    embed_grad.index_add_(0, distinct, rows)  # distinct indices: one add per element, no order to vary
