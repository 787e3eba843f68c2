"""Expert-parallel training's collectives for the units that hold routed experts: each rank gathers the
experts it owns and every other parameter, and the experts' gradients are reduced among their owners only.

With expert-parallel training (`train.expert_parallel`) TP-slice rank t runs the experts of slice t, and the
slice-major layout already keeps them there: slice t of a unit holds its experts [t * E / tg, (t + 1) * E / tg)
whole, cut into the m training shards of the micro-DP group (the m ranks t * m + j). So a unit with experts
travels in two steps instead of one all-gather over all N ranks:

- gather: all-gather slice t within the micro-DP group (m ranks: this rank's experts and its slice of every
  other parameter), then all-gather the slice's non-expert part (`compact`: attention, norms, router, shared
  expert) within the TP group (tg ranks), which completes every other parameter. The other slices' experts
  stay zero: this rank never reads them. Each rank receives (m - 1) / m of its slice plus (tg - 1) compact
  parts, instead of (N - 1) / N of the unit.
- reduce: reduce-scatter the non-expert parts within the TP group (each rank gets its slice's part summed
  over the TP group), put this rank's own experts' gradients beside it, and reduce-scatter slice t within
  the micro-DP group into this rank's shard. A non-expert element is then summed over all N ranks, as by
  the plain reduce-scatter; an expert's gradient, zero on every rank outside slice t, over its m owners.
"""

from __future__ import annotations

import torch

from hybridengine.sharding.switch import _all_gather, _reduce_scatter


class ExpertComm:
    """The two-step gather and gradient reduce of a ShardedBuffer's units with ``expert`` parameters (see the
    module docstring); `units` maps each such unit to the positions of its non-expert pieces in a slice."""

    def __init__(self, sharded):
        layout = sharded.layout
        if layout.tp_size == 1:
            raise ValueError("ExpertComm: expert-parallel training needs tp_generation > 1 (the EP group is the "
                             "TP group)")
        self.sharded, self.layout = sharded, layout
        self.units: dict[int, torch.Tensor] = {}
        for u, unit in enumerate(layout.units):
            roles = {p.name: p.role for p in unit.params}
            if "expert" not in roles.values():
                continue
            runs = [torch.arange(p.offset, p.offset + p.slot_numel) for p in unit.pieces
                    if p.slice_index == 0 and roles[p.name] != "expert"]
            compact = torch.cat(runs) if runs else torch.zeros(0, dtype=torch.long)
            self.units[u] = compact.to(sharded.device)

    def _rows(self, u: int, flat: torch.Tensor) -> torch.Tensor:
        """A unit's slice-major buffer as [tg, slice_numel]."""
        return flat.view(self.layout.tp_size, self.layout.units[u].slice_numel)

    def gather_packed(self, u: int) -> torch.Tensor:
        """Unit u slice-major, with every parameter but the other slices' experts (zeros there)."""
        sb, unit, compact = self.sharded, self.layout.units[u], self.units[u]
        full = torch.zeros(unit.numel, dtype=sb.gen.data.dtype, device=sb.device)
        rows = self._rows(u, full)
        own = rows[sb.tp_rank]
        if sb.micro_dp_group is not None:
            _all_gather(own, sb._shards[u], group=sb.micro_dp_group)
        else:  # m = 1: the shard is the slice
            own.copy_(sb._shards[u])
        parts = torch.empty(self.layout.tp_size * compact.numel(), dtype=full.dtype, device=full.device)
        _all_gather(parts, own[compact], group=sb.tp_group)
        rows[:, compact] = parts.view(self.layout.tp_size, -1)
        return full

    def reduce_scatter(self, u: int, packed: torch.Tensor, out: torch.Tensor) -> None:
        """out (this rank's shard of unit u) = the sum over ranks of the packed gradients `packed` [unit.numel],
        whose other slices' experts are zero (see the module docstring)."""
        sb, compact = self.sharded, self.units[u]
        rows = self._rows(u, packed)
        part = torch.empty(compact.numel(), dtype=packed.dtype, device=packed.device)
        _reduce_scatter(part, rows[:, compact].contiguous().view(-1), group=sb.tp_group)
        own = rows[sb.tp_rank].clone()
        own[compact] = part
        if sb.micro_dp_group is not None:
            _reduce_scatter(out, own, group=sb.micro_dp_group)
        else:
            out.copy_(own)
