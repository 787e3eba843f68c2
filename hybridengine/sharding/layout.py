"""Where every parameter element lives in the flat buffer, for N training ranks and TP degree tg.

The model is cut into *units* (the embedding, each decoder layer, the final norm + LM head).
Inside a unit the flat order is TP-slice major: `[slice 0 | slice 1 | ... | slice tg-1]`, and
slice t holds, parameter after parameter, the piece of each parameter that TP rank t uses for
generation. Each slice is cut into `m = N / tg` equal training shards, so rank `r = t*m + j`
trains a shard that lies inside the slice it generates with: the optimizer updates, in place, the
very elements the rollout reads.

Slicing rule by role (the model family's `ParallelPlan` gives each parameter its role; model/family.py):

- ``column``: split dim 0 into tg equal parts (q/k/v/gate/up weights and q/k/v biases). For q/k/v
  the split must fall on head boundaries (`granule` = head_dim).
- ``row``: split dim 1 into tg equal parts (o_proj/down_proj weights).
- ``vocab``: split dim 0 of the embedding / LM head into tg parts of `ceil(V / tg)` rows; a
  vocabulary that tg does not divide is padded: the last slice's slot keeps its full size and
  the missing rows are padding (zero, never a parameter element).
- ``expert``: stacked expert weights [experts, ...]: split dim 0 into tg equal parts of whole experts,
  so that TP rank t holds its own experts (expert parallelism in generation).
- ``replicated``: norms, routers and any other bias: a full copy in *every* slice. Unpack reads the copy
  of slice 0; pack writes the gradient into every copy, so copies updated by the same elementwise
  optimizer stay bitwise equal. Norm-style reductions must count them once.

Copies between the natural layout of a unit (its parameters back to back, each contiguous) and
the slice-major layout are described by segment tables `[S, 3]` of `(src, dst, numel)` in
elements, executed by the fused `segment_copy` op.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable

import torch

from hybridengine.model.family import ROLES, ParallelPlan


def _dense_plan() -> ParallelPlan:
    # The dense Llama family's plan, for callers that pass none; a lazy import: the families import the decoder,
    # which imports this module.
    from hybridengine.model.families.dense import DENSE_PLAN

    return DENSE_PLAN


def tp_role(name: str, plan: ParallelPlan | None = None) -> str:
    """The parallel role `plan` (default: the dense Llama family's) gives parameter `name`; a ValueError for a
    name the plan does not cover."""
    return (plan or _dense_plan()).resolve(name)[0]


def unit_of(name: str, plan: ParallelPlan | None = None) -> str:
    """The unit of parameter `name` under `plan` (default: the dense Llama family's): 'embed', 'layers.<i>'
    or 'head'."""
    return (plan or _dense_plan()).resolve(name)[1]


def _round_up(x: int, k: int) -> int:
    return (x + k - 1) // k * k


@dataclass(frozen=True, slots=True)
class ParamSpec:
    """One parameter as the layout sees it."""

    name: str
    shape: tuple[int, ...]
    role: str
    unit: str
    granule: int = 1
    """Slices along the split dim must be multiples of this (head_dim for q/k/v)."""

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"ParamSpec: name must be a non-empty str, got {self.name!r}")
        if (not isinstance(self.shape, tuple) or not self.shape
                or not all(isinstance(d, int) and not isinstance(d, bool) for d in self.shape)):
            raise ValueError(f"ParamSpec {self.name!r}: shape must be a non-empty tuple of ints, got {self.shape!r}")
        if isinstance(self.granule, bool) or not isinstance(self.granule, int) or self.granule < 1:
            raise ValueError(f"ParamSpec {self.name!r}: granule must be an int >= 1, got {self.granule!r}")
        if self.role not in ROLES:
            raise ValueError(f"ParamSpec {self.name!r}: role {self.role!r} is not one of {ROLES}")
        if self.role in ("column", "row", "vocab", "expert") and len(self.shape) < (2 if self.role == "row" else 1):
            raise ValueError(f"ParamSpec {self.name!r}: role {self.role!r} needs more dims than {self.shape}")
        if any(s <= 0 for s in self.shape):
            raise ValueError(f"ParamSpec {self.name!r}: shape {self.shape} has an empty dim")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def slice_shape(self, tp_size: int) -> tuple[int, ...]:
        """Shape of the piece one TP rank holds (vocab: padded rows included)."""
        if self.role in ("column", "vocab", "expert"):
            return (math.ceil(self.shape[0] / tp_size), *self.shape[1:])
        if self.role == "row":
            return (self.shape[0], self.shape[1] // tp_size, *self.shape[2:])
        return self.shape

    def natural_segments(self, t: int, tp_size: int) -> list[tuple[int, int]]:
        """(offset, numel) runs of the parameter's natural (row-major) storage that slice t holds."""
        if self.role == "replicated" or tp_size == 1:
            return [(0, self.numel)]
        inner = math.prod(self.shape[1:])
        if self.role in ("column", "expert"):
            rows = self.shape[0] // tp_size
            return [(t * rows * inner, rows * inner)]
        if self.role == "vocab":
            rows = math.ceil(self.shape[0] / tp_size)
            present = max(0, min(self.shape[0], (t + 1) * rows) - t * rows)
            return [(t * rows * inner, present * inner)] if present else []
        out, cols, trail = self.shape[0], self.shape[1] // tp_size, math.prod(self.shape[2:])
        row_len = self.shape[1] * trail
        return [(i * row_len + t * cols * trail, cols * trail) for i in range(out)]

    def check_tp(self, tp_size: int) -> None:
        if self.role == "column" and self.shape[0] % (tp_size * self.granule):
            raise ValueError(
                f"parameter {self.name!r} (column-parallel, shape {self.shape}, granule {self.granule}): "
                f"dim 0 must divide into tp_size={tp_size} slices of whole granules")
        if self.role == "expert" and self.shape[0] % (tp_size * self.granule):
            raise ValueError(
                f"parameter {self.name!r} (expert-parallel, shape {self.shape}): its {self.shape[0]} experts "
                f"must divide into tp_size={tp_size} slices of whole experts")
        if self.role == "row" and self.shape[1] % (tp_size * self.granule):
            raise ValueError(
                f"parameter {self.name!r} (row-parallel, shape {self.shape}, granule {self.granule}): "
                f"dim 1 must divide into tp_size={tp_size} slices of whole granules")


@dataclass(frozen=True, slots=True)
class Piece:
    """The part of one parameter that lies in one TP slice of a unit."""

    name: str
    slice_index: int
    offset: int
    """Element offset of the piece's slot in the unit's slice-major buffer."""
    slot_numel: int
    """Elements reserved for the piece (vocab padding included)."""


def merge_segments(rows: list[tuple[int, int, int]]) -> torch.Tensor:
    """Segment table from (src, dst, numel) rows, adjacent runs merged, empty runs dropped."""
    merged: list[list[int]] = []
    for s, d, n in rows:
        if n == 0:
            continue
        if merged and merged[-1][0] + merged[-1][2] == s and merged[-1][1] + merged[-1][2] == d:
            merged[-1][2] += n
        else:
            merged.append([s, d, n])
    return torch.tensor(merged, dtype=torch.int64).reshape(-1, 3)


@dataclass(slots=True)
class UnitLayout:
    """Natural and slice-major layouts of one unit."""

    name: str
    params: list[ParamSpec]
    tp_size: int
    num_shards: int
    """m = N / tg: training shards per TP slice."""
    natural_offsets: dict[str, int]
    natural_numel: int
    pieces: list[Piece]
    slice_numel: int
    shard_numel: int

    @property
    def numel(self) -> int:
        """Elements of the whole unit in slice-major order (all tg slices, padding included)."""
        return self.slice_numel * self.tp_size

    def shard_range(self, rank: int) -> tuple[int, int]:
        """[start, end) of rank's training shard in the unit's slice-major buffer."""
        start = rank * self.shard_numel
        return start, start + self.shard_numel

    def _rows(self, to_natural: bool) -> list[tuple[int, int, int]]:
        by_name = {p.name: p for p in self.params}
        rows = []
        for piece in self.pieces:
            spec = by_name[piece.name]
            if to_natural and spec.role == "replicated" and piece.slice_index != 0:
                continue  # replicated: slice 0's copy is the one read back
            base, cursor = self.natural_offsets[piece.name], piece.offset
            for off, n in spec.natural_segments(piece.slice_index, self.tp_size):
                rows.append((cursor, base + off, n) if to_natural else (base + off, cursor, n))
                cursor += n
        return rows

    def pack_table(self) -> torch.Tensor:
        """Segments natural -> slice-major (replicated params written into every slice)."""
        return merge_segments(self._rows(to_natural=False))

    def unpack_table(self) -> torch.Tensor:
        """Segments slice-major -> natural (replicated params read from slice 0)."""
        return merge_segments(self._rows(to_natural=True))


@dataclass(slots=True)
class ShardedLayout:
    """The flat layout of a whole model for `world_size` training ranks and TP degree `tp_size`."""

    specs: list[ParamSpec]
    world_size: int = 1
    tp_size: int = 1
    element_size: int = 2
    align_bytes: int = 16
    """Each piece starts on this boundary (16 B: vector loads in the copy kernel)."""
    shard_align_bytes: int = 16
    """Every training shard is a multiple of this (2 MiB for the CUDA VMM buffer)."""
    units: list[UnitLayout] = field(init=False)
    unit_index: dict[str, int] = field(init=False)
    gen_offsets: list[int] = field(init=False)
    """Offset of each unit's slice in a rank's generation buffer G."""
    _by_name: dict = field(init=False, repr=False, compare=False)
    """name -> (spec, unit, gen offset): `natural_view` runs ~40 times per layer per training step."""

    def __post_init__(self):
        for arg in ("world_size", "tp_size", "element_size", "align_bytes", "shard_align_bytes"):
            value = getattr(self, arg)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ShardedLayout: {arg} must be >= 1 (an int), got {value!r}")
        bad = [s for s in self.specs if not isinstance(s, ParamSpec)]
        if bad:
            raise ValueError(f"ShardedLayout: specs must be ParamSpec (see param_specs), got {type(bad[0]).__name__}")
        if self.world_size % self.tp_size:
            raise ValueError(
                f"ShardedLayout: tp_size={self.tp_size} must divide world_size={self.world_size}")
        for arg in ("align_bytes", "shard_align_bytes"):
            if getattr(self, arg) % self.element_size:
                raise ValueError(f"ShardedLayout: {arg}={getattr(self, arg)} is not a multiple of "
                                 f"element_size={self.element_size}")
        names = [s.name for s in self.specs]
        if len(set(names)) != len(names):
            raise ValueError("ShardedLayout: duplicate parameter names in specs")
        for s in self.specs:
            s.check_tp(self.tp_size)
        align = self.align_bytes // self.element_size
        shard_align = self.shard_align_bytes // self.element_size
        m = self.world_size // self.tp_size
        grouped: dict[str, list[ParamSpec]] = {}
        for s in self.specs:
            grouped.setdefault(s.unit, []).append(s)
        self.units, self.unit_index, self.gen_offsets = [], {}, []
        gen = 0
        for unit_name, params in grouped.items():
            natural_offsets, cursor = {}, 0
            for s in params:
                natural_offsets[s.name] = cursor
                cursor = _round_up(cursor + s.numel, align)
            slot_sizes = {s.name: math.prod(s.slice_shape(self.tp_size)) for s in params}
            slice_used = 0
            for s in params:
                slice_used = _round_up(slice_used + slot_sizes[s.name], align)
            slice_numel = _round_up(max(slice_used, 1), m * shard_align)
            pieces = []
            for t in range(self.tp_size):
                off = t * slice_numel
                for s in params:
                    pieces.append(Piece(s.name, t, off, slot_sizes[s.name]))
                    off = _round_up(off + slot_sizes[s.name], align)
            self.unit_index[unit_name] = len(self.units)
            self.units.append(UnitLayout(unit_name, params, self.tp_size, m, natural_offsets, cursor,
                                         pieces, slice_numel, slice_numel // m))
            self.gen_offsets.append(gen)
            gen += slice_numel
        self._by_name = {s.name: (s, u, g) for u, g in zip(self.units, self.gen_offsets) for s in u.params}

    @property
    def num_shards(self) -> int:
        return self.world_size // self.tp_size

    @property
    def gen_numel(self) -> int:
        """Elements of one rank's generation buffer G (one TP slice of every unit)."""
        return sum(u.slice_numel for u in self.units)

    @property
    def shard_numel(self) -> int:
        """Elements of one rank's training shard, all units together."""
        return sum(u.shard_numel for u in self.units)

    def tp_rank(self, rank: int) -> int:
        return rank // self.num_shards

    def shard_in_gen(self, rank: int) -> list[tuple[int, int]]:
        """(offset in G, numel) of rank's training shard of each unit: the shard lives inside G."""
        j = rank % self.num_shards
        return [(g + j * u.shard_numel, u.shard_numel) for u, g in zip(self.units, self.gen_offsets)]

    def gen_view(self, gen_buffer: torch.Tensor, name: str) -> torch.Tensor:
        """The TP-slice view of parameter `name` in a rank's generation buffer."""
        spec, unit, gen = self._find(name)
        piece = next(p for p in unit.pieces if p.name == name and p.slice_index == 0)
        start = gen + piece.offset
        return gen_buffer[start:start + piece.slot_numel].view(spec.slice_shape(self.tp_size))

    def natural_view(self, unit_buffer: torch.Tensor, name: str) -> torch.Tensor:
        """The full parameter `name` inside its unit's natural-layout buffer."""
        spec, unit, _ = self._find(name)
        start = unit.natural_offsets[name]
        return unit_buffer[start:start + spec.numel].view(spec.shape)

    def _find(self, name: str) -> tuple[ParamSpec, UnitLayout, int]:
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"parameter {name!r} is not in this layout") from None


def param_specs(named_shapes: Iterable[tuple[str, tuple[int, ...]]], head_dim: int | None = None, *,
                plan: ParallelPlan | None = None) -> list[ParamSpec]:
    """ParamSpecs for named parameters, their roles and units from the family's `plan` (default: the dense Llama
    family's; a name it does not cover is a ValueError); the parameters it cuts on whole heads get granule
    head_dim so TP splits whole heads.

    Order: units as they first appear; inside a unit the matrices keep their order and come first,
    then the 1-D parameters (biases, norms). So a layer's q/k/v weights, its gate/up weights and its
    q/k/v biases each lie back to back, in the flat buffer and in every TP slice of the generation
    buffer, and the rollout runs one GEMM for q, k and v and one for gate and up (`fused.stacked_rows`)."""
    plan = plan or _dense_plan()
    specs, first_seen = [], {}
    for name, shape in named_shapes:
        role, unit, per_head = plan.resolve(name)
        spec = ParamSpec(name, tuple(shape), role, unit, head_dim if (head_dim and per_head) else 1)
        first_seen.setdefault(spec.unit, len(first_seen))
        specs.append(spec)
    return sorted(specs, key=lambda s: (first_seen[s.unit], len(s.shape) < 2))
