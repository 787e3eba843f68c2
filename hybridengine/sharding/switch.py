"""The zero-copy switch: one generation buffer G per rank, training shards living inside it.

`ShardedBuffer` owns, on each of the N ranks of a process group:

- **G** (`GenerationBuffer`), TP slice `t = rank // m` of every unit (m = N / tg). The rank's
  training shard of each unit lives permanently inside G, so the optimizer writes straight into the
  weights that the next rollout reads. `switch_to_generation()` backs the other shards of every
  unit with memory and all-gathers into them in place within the micro-DP group (the m ranks sharing
  slice t); `switch_to_training()` gives that memory back (on a host thread, after the queued GPU
  work), unless asked to keep it for the next rollout (`release=False`); `prepare_generation()` maps
  it ahead on a host thread, so the switch is the all-gather alone. With tg = N nothing moves.
- **Views**: `flat_buffer`, a `FlatParamBuffer` over G: the TP-slice view of every parameter
  (`generation_views`) and the rank's training shard of every unit (`shard_views`).
- **Training-view gathers**: `gather_unit(u)` all-gathers unit u's shards from all N ranks (the
  concatenation in rank order *is* the slice-major unit) and unpacks it to natural layout with
  the fused segment copy; with tg = 1 the gathered buffer already is the natural layout.
  `prefetch_unit(u)` starts that on a side stream (CUDA) so it hides under the previous unit.
- **Gradient reduce-scatter**: `reduce_scatter_grad(u, natural_grad, out)` packs a unit's
  natural-layout gradient to slice-major order and reduce-scatters it into the rank's shard.
"""

from __future__ import annotations

import datetime
import hashlib
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hybridengine import checks
from hybridengine.ops.segment_copy import launch_segment_copy, prepare_table
from hybridengine.sharding.buffer import FlatParamBuffer
from hybridengine.sharding.generation_memory import GenerationBuffer, vmm_status
from hybridengine.sharding.layout import ParamSpec, ShardedLayout
from hybridengine.sharding.vmm import VmmRange

SWITCH_BATCH_BYTES = (256 << 20, 2 << 30)
"""Bounds of the switch's automatic batch (received bytes per NCCL group call), which is a quarter of
what the switch receives: the first batch's mapping is the only one not hidden under an all-gather,
and NCCL's bus bandwidth grows with the transfer, so a few large batches beat one all-gather per unit
and beat one all-gather of everything."""

PREFETCH_UNPACK_SM_FRACTION = 3 / 4
"""Share of the device's SMs a prefetched unit's unpack may use: it runs beside the next unit's
all-gather, and NCCL needs the rest; with far fewer blocks the unpack outlasts the all-gather."""

# torch 2.13 renamed the tensor collectives (same signatures); 2.11 only has the old names.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

OP = "ShardedBuffer"


def switch_batches(layout: ShardedLayout, batch_bytes: int) -> list[list[int]]:
    """Unit batches of the switch: the smallest unit alone (its mapping is the one not hidden under an
    all-gather), then the rest in layout order, about `batch_bytes` received bytes a batch (0: one unit)."""
    units = layout.units
    order = sorted(range(len(units)), key=lambda u: units[u].shard_numel)
    order = order[:1] + sorted(order[1:])
    if batch_bytes == 0:
        return [[u] for u in order]
    batches, current, size = [order[:1]], [], 0
    for u in order[1:]:
        received = units[u].shard_numel * (layout.num_shards - 1) * layout.element_size
        if current and size + received > batch_bytes:
            batches.append(current)
            current, size = [], 0
        current.append(u)
        size += received
    return batches + ([current] if current else [])


class _Works:
    """Several async collective works waited as one."""

    def __init__(self, works):
        self.works = works

    def wait(self) -> None:
        for w in self.works:
            w.wait()


@dataclass(slots=True)
class _Prefetch:
    natural: torch.Tensor
    event: torch.cuda.Event | None
    own_experts: bool = False


class ShardedBuffer:
    """A model's parameters sharded over a process group, with training and generation views."""

    def __init__(self, specs: Sequence[ParamSpec], *, dtype: torch.dtype, device: torch.device | str = "cpu",
                 tp_size: int = 1, group: dist.ProcessGroup | None = None, use_vmm: bool | None = None,
                 timeout: datetime.timedelta | None = None, switch_batch_bytes: int | None = None):
        """`specs`: every parameter of the model (`layout.param_specs`), the same on every rank.
        `tp_size`: the generation's TP degree tg, which divides the group's size N. `use_vmm`: G over
        the CUDA VMM API (None: where available, with a warning where not). `timeout` bounds the
        collectives of the subgroups made here (default: the process group's). `switch_batch_bytes`:
        how many received bytes `switch_to_generation` gathers per NCCL group call (0: one all-gather
        per unit; None: a quarter of the switch's bytes within SWITCH_BATCH_BYTES)."""
        specs = self._check_args(specs, dtype, tp_size, use_vmm, timeout, switch_batch_bytes)
        # Without torch.distributed the buffer is one rank alone: every collective is skipped.
        self.local = not dist.is_initialized()
        if self.local and group is not None:
            raise ValueError(f"{OP}: a process group was given but torch.distributed is not initialised")
        self.group = None if self.local else (group if group is not None else dist.group.WORLD)
        self.world_size = 1 if self.local else dist.get_world_size(self.group)
        self.rank = 0 if self.local else dist.get_rank(self.group)
        if self.world_size % tp_size:
            raise ValueError(f"{OP}: tp_size={tp_size} must divide the group's world_size={self.world_size}")
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        es = torch.empty((), dtype=dtype).element_size()
        self.use_vmm = self._decide_vmm(use_vmm)
        granule = VmmRange(1, self.device.index).granularity if self.use_vmm else 16
        self.layout = ShardedLayout(specs, world_size=self.world_size, tp_size=tp_size, element_size=es,
                                    shard_align_bytes=granule)
        self._check_same_layout(dtype)
        m = self.layout.num_shards
        self.tp_rank, self.shard_index = divmod(self.rank, m)
        # Every rank creates every subgroup, in the same order (torch.distributed requires it).
        global_ranks = [dist.get_global_rank(self.group, r) if self.group not in (None, dist.group.WORLD) else r
                        for r in range(self.world_size)]
        self.micro_dp_group = self.tp_group = None
        for t in range(tp_size):
            g = (dist.new_group([global_ranks[t * m + j] for j in range(m)], timeout=timeout)
                 if 1 < m < self.world_size else None)
            if t == self.tp_rank:
                self.micro_dp_group = self.group if m == self.world_size else g
        for j in range(m):
            g = (dist.new_group([global_ranks[t * m + j] for t in range(tp_size)], timeout=timeout)
                 if 1 < tp_size < self.world_size else None)
            if j == self.shard_index:
                self.tp_group = self.group if tp_size == self.world_size else g
        if switch_batch_bytes is None:
            received = sum(u.shard_numel for u in self.layout.units) * (m - 1) * es
            low, high = SWITCH_BATCH_BYTES
            switch_batch_bytes = min(high, max(low, received // 4))
        self.switch_batch_bytes = switch_batch_bytes
        cuda = self.device.type == "cuda"
        # Grid bound of a prefetched unit's unpack (segment_copy's max_blocks; 0: none, as on CPU).
        self.prefetch_unpack_blocks = (int(torch.cuda.get_device_properties(self.device).multi_processor_count
                                           * PREFETCH_UNPACK_SM_FRACTION) if cuda else 0)
        self.gen = GenerationBuffer(self.layout, self.rank, dtype, self.device, self.use_vmm)
        self.flat_buffer = FlatParamBuffer(self.layout, dtype=dtype, rank=self.rank, data=self.gen.data)
        self._shards = self.flat_buffer.shard_views()  # per unit; fixed views of G
        self.state = "training"
        self._unpack = [None] * len(self.layout.units)
        self._pack = [None] * len(self.layout.units)
        self._side_stream = torch.cuda.Stream(self.device) if cuda else None  # prefetch all-gathers
        self._unpack_stream = torch.cuda.Stream(self.device) if cuda else None  # their unpacks (tg > 1)
        self._prefetched: dict[int, _Prefetch] = {}
        self.expert_comm = None
        """Expert-parallel training (`expert_comm.ExpertComm`, set by `train.expert_parallel.enable`): the
        trainer's gathers of a unit with experts bring only this rank's own experts, and its gradients reduce
        among their owners."""
        # NCCL group calls (one launch for several units' all-gathers) need the NCCL backend.
        self._coalesce = (cuda and self.micro_dp_group is not None
                          and dist.get_backend(self.micro_dp_group) == "nccl")

    # -- set-up -----------------------------------------------------------------------------------

    @staticmethod
    def _check_args(specs, dtype, tp_size, use_vmm, timeout, switch_batch_bytes) -> list[ParamSpec]:
        if isinstance(specs, (str, bytes)) or not isinstance(specs, Sequence) or not specs \
                or not all(isinstance(s, ParamSpec) for s in specs):
            raise ValueError(f"{OP}: specs must be a non-empty list of ParamSpec, got {checks.describe(specs)} "
                             "(layout.param_specs builds them)")
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"{OP}: dtype must be a floating torch.dtype, got {dtype!r}")
        checks.number(OP, "tp_size", tp_size, low=1, integer=True)
        checks.one_of(OP, "use_vmm", use_vmm, (None, True, False))
        if timeout is not None and not isinstance(timeout, datetime.timedelta):
            raise ValueError(f"{OP}: timeout must be None or a datetime.timedelta, got {checks.describe(timeout)}")
        if switch_batch_bytes is not None and (isinstance(switch_batch_bytes, bool)
                                               or not isinstance(switch_batch_bytes, int) or switch_batch_bytes < 0):
            raise ValueError(f"{OP}: switch_batch_bytes must be None or an int >= 0, got {switch_batch_bytes!r}")
        return list(specs)

    def _decide_vmm(self, use_vmm: bool | None) -> bool:
        if self.device.type != "cuda":
            if use_vmm:
                raise ValueError(f"{OP}: use_vmm=True needs a CUDA device, got device={self.device}")
            return False
        ok, reason = vmm_status(self.device.index)
        if use_vmm and not ok:
            raise RuntimeError(f"rank {self.rank}: use_vmm=True but the CUDA VMM buffer is unavailable: {reason}")
        if use_vmm is None and not ok:
            warnings.warn(f"hybridengine: CUDA VMM buffer unavailable ({reason}); the generation buffer is an "
                          "ordinary tensor that stays allocated between rollouts", RuntimeWarning, stacklevel=3)
        return ok if use_vmm is None else use_vmm

    def _check_same_layout(self, dtype: torch.dtype) -> None:
        """All ranks must lay out the same model the same way: checked once, named by rank."""
        lay = self.layout
        key = repr(([(s.name, s.shape, s.role, s.granule) for s in lay.specs], lay.tp_size, lay.shard_align_bytes,
                    str(dtype)))
        digest = hashlib.sha256(key.encode()).hexdigest()[:16]
        if self.local:
            return
        digests: list[str] = [""] * self.world_size
        dist.all_gather_object(digests, digest, group=self.group)
        bad = [r for r, d in enumerate(digests) if d != digests[0]]
        if bad:
            raise ValueError(f"rank {self.rank}: ranks {bad} lay out a different model than rank 0 (parameter "
                             "names/shapes, tp_size, alignment or dtype differ); every rank must pass the same specs")

    def load_(self, params: Mapping[str, torch.Tensor]) -> None:
        """Fill this rank's shards from full natural-layout parameters (every rank passes the same).
        Names the layout does not know are ignored."""
        self._expect("training", "load_")
        if not isinstance(params, Mapping):
            raise ValueError(f"{OP}.load_: params must be a mapping of parameter name to tensor, "
                             f"got {checks.describe(params)}")
        missing = [s.name for s in self.layout.specs if s.name not in params]
        if missing:
            raise ValueError(f"{OP}.load_: parameters missing: {missing[:5]}{' ...' if len(missing) > 5 else ''}")
        for s in self.layout.specs:
            checks.tensor(f"{OP}.load_", f"params[{s.name!r}]", params[s.name], shape=s.shape, floating=True)
        for u, unit in enumerate(self.layout.units):
            natural = torch.zeros(unit.natural_numel, dtype=self.gen.data.dtype, device=self.device)
            for s in unit.params:
                self.layout.natural_view(natural, s.name).copy_(params[s.name])
            packed = self.pack_unit(u, natural)
            start, end = unit.shard_range(self.rank)
            self._shards[u].copy_(packed[start:end])

    # -- the switch ---------------------------------------------------------------------------------

    def switch_to_generation(self) -> None:
        """Make G hold this rank's full TP slice of every unit: all-gather within the micro-DP group.

        Units go in batches of about `switch_batch_bytes` received bytes (`switch_batches`), the
        smallest unit first: a batch's pages are mapped on the host while the previous batch's
        all-gathers run, and a batch's all-gathers are one NCCL group call. Pages kept by
        `switch_to_training(release=False)` are not mapped again, only gathered into. If a mapping
        fails, what this call mapped is unmapped again (kept pages stay) and the buffer stays in the
        training state."""
        self._expect("training", "switch_to_generation")
        self.gen.wait_released()  # a deferred release of the last switch back must be done first
        try:
            self.gen.wait_mapped()  # pages mapped ahead by prepare_generation()
        except RuntimeError as e:
            raise RuntimeError(f"rank {self.rank}: switch_to_generation: mapping the generation pages ahead "
                               f"(prepare_generation) failed; nothing of it stays mapped and the buffer is in "
                               f"training state: {e}") from e
        works, mapped = [], []  # mapped: (unit, byte offsets this call mapped for it)
        for batch in switch_batches(self.layout, self.switch_batch_bytes if self._coalesce else 0):
            for u in batch:  # host-side mapping; the previous batch's all-gathers are in flight
                try:
                    offsets = self.gen.map_unit(u)
                except RuntimeError as e:
                    for w in works:
                        w.wait()
                    if self.device.type == "cuda":  # the all-gathers may still write what is unmapped next
                        torch.cuda.current_stream(self.device).synchronize()
                    for v, offs in mapped:
                        self.gen.unmap_unit(v, offs)
                    name = self.layout.units[u].name
                    raise RuntimeError(f"rank {self.rank}: switch_to_generation could not map unit {name!r}; the "
                                       f"buffer is back in training state: {e}") from e
                if offsets:
                    mapped.append((u, offsets))
            if self.layout.num_shards > 1:
                works.append(self._gather_slices(batch))
        for w in works:
            w.wait()
        self.state = "generation"

    def _gather_slices(self, batch: list[int]):
        """Async all-gather of the listed units' slices in G (one NCCL group call when coalescing)."""
        group = self.micro_dp_group
        if len(batch) == 1 or not self._coalesce:
            return _Works([_all_gather(self.gen.unit_slice(u), self._shards[u], group=group, async_op=True)
                           for u in batch])
        with dist._coalescing_manager(group=group, device=self.device, async_ops=True) as cm:
            for u in batch:
                dist.all_gather_into_tensor(self.gen.unit_slice(u), self._shards[u], group=group)
        return cm

    def switch_to_training(self, release: bool = True) -> None:
        """Release the other shards of G (VMM: unmapped on a host thread once the work queued on the
        current stream is done, so the call returns at once); the own shards stay. The release
        overlaps what the caller does next; `wait_released()` joins it, and the next
        `switch_to_generation()` does so first.

        `release=False` keeps the other shards mapped, so the next `switch_to_generation()` is only the
        all-gather: memory stays at model/tg per rank through training. The kept pages hold stale data
        (the last rollout's weights) until that all-gather overwrites them; training must not read them.
        `release_generation_pages()` gives them back."""
        self._expect("generation", "switch_to_training")
        if release:
            self.gen.release_others_deferred()
        self.state = "training"

    def prepare_generation(self) -> None:
        """Start mapping the generation pages (VMM) on a host thread and return at once, so that the
        next `switch_to_generation()` only all-gathers. Call it where the training step's transient
        memory is gone and the GPU is still busy (after launching the last optimizer step before a
        rollout): the driver's page calls then overlap that work, and from here to the next switch G
        holds model/tg of memory. A failure is raised by that switch, which then leaves the buffer in
        training state. No-op without VMM or when the pages are mapped."""
        self._expect("training", "prepare_generation")
        self.gen.map_others_in_background()

    def release_generation_pages(self) -> None:
        """Release the pages kept by `switch_to_training(release=False)` (deferred, as that call does);
        a no-op when none are kept or without VMM."""
        self._expect("training", "release_generation_pages")
        self.gen.release_others_deferred()

    def wait_released(self) -> None:
        """Wait until the generation pages released by `switch_to_training` are back with the driver."""
        self.gen.wait_released()

    def generation_views(self) -> dict[str, torch.Tensor]:
        """TP-slice views of every parameter in G (valid in the generation state)."""
        self._expect("generation", "generation_views")
        return self.flat_buffer.views()

    def shard_views(self) -> list[torch.Tensor]:
        """This rank's training shard of every unit (views of G; the optimizer writes here)."""
        return self.flat_buffer.shard_views()

    def _expect(self, state: str, what: str) -> None:
        if self.state != state:
            raise RuntimeError(f"rank {self.rank}: {what}() needs the {state} state, the buffer is in {self.state}")

    # -- training view ------------------------------------------------------------------------------

    def _table(self, u: int, pack: bool) -> torch.Tensor:
        cache = self._pack if pack else self._unpack
        if cache[u] is None:
            unit = self.layout.units[u]
            src_n, dst_n = (unit.natural_numel, unit.numel) if pack else (unit.numel, unit.natural_numel)
            table = unit.pack_table() if pack else unit.unpack_table()
            cache[u] = prepare_table(table, self.layout.element_size, src_numel=src_n, dst_numel=dst_n,
                                     device=self.device)
        return cache[u]

    def pack_unit(self, u: int, natural: torch.Tensor) -> torch.Tensor:
        """Natural -> slice-major (padding zero; replicated params copied into every slice)."""
        unit = self.layout.units[u]
        assert natural.dim() == 1 and natural.numel() >= unit.natural_numel, (unit.name, tuple(natural.shape))
        packed = torch.zeros(unit.numel, dtype=natural.dtype, device=natural.device)
        if self.layout.tp_size == 1:
            packed[:unit.natural_numel].copy_(natural[:unit.natural_numel])
        else:
            launch_segment_copy(natural, packed, self._table(u, pack=True))
        return packed

    def _gather_packed(self, u: int, own_experts: bool = False) -> torch.Tensor:
        """Unit u slice-major (all-gathered from every rank), or its natural view when no copy is needed.
        `own_experts` (expert-parallel training): of the experts only this rank's own (`expert_comm`)."""
        unit = self.layout.units[u]
        if own_experts and self._own_experts(u):
            return self.expert_comm.gather_packed(u)
        if self.world_size == 1 and self.layout.tp_size == 1:
            return self.gen.unit_slice(u)[:unit.natural_numel]  # the shard is the whole unit: zero-copy
        full = torch.empty(unit.numel, dtype=self.gen.data.dtype, device=self.device)
        _all_gather(full, self._shards[u], group=self.group)
        if self.layout.tp_size == 1:
            return full[:unit.natural_numel]  # slice-major with one slice is the natural layout
        return full

    def _unpack_unit(self, u: int, full: torch.Tensor, max_blocks: int = 0) -> torch.Tensor:
        natural = torch.empty(self.layout.units[u].natural_numel, dtype=full.dtype, device=self.device)
        launch_segment_copy(full, natural, self._table(u, pack=False), max_blocks)
        return natural

    def _own_experts(self, u: int) -> bool:
        return self.expert_comm is not None and u in self.expert_comm.units

    def _gather(self, u: int, own_experts: bool = False) -> torch.Tensor:
        full = self._gather_packed(u, own_experts)
        return self._unpack_unit(u, full) if self.layout.tp_size > 1 else full

    def prefetch_unit(self, u: int) -> None:
        """Start gathering unit u for the trainer (CUDA: on a side stream, so it overlaps the current unit's
        compute); with `expert_comm`, of its experts only this rank's own. A unit already prefetched, or an
        index past either end, is a no-op.

        With tg > 1 the unpack to natural layout runs on a third stream: the side stream's next
        all-gather does not queue behind it, so consecutive prefetches pipeline gather and unpack."""
        if u in self._prefetched or not 0 <= u < len(self.layout.units):
            return
        own = self._own_experts(u)
        if self._side_stream is None:
            self._prefetched[u] = _Prefetch(self._gather(u, own), None, own)
            return
        self._side_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._side_stream):
            natural = self._gather_packed(u, own)
        last = self._side_stream
        if self.layout.tp_size > 1:
            full, last = natural, self._unpack_stream
            last.wait_stream(self._side_stream)
            with torch.cuda.stream(last):
                natural = self._unpack_unit(u, full, self.prefetch_unpack_blocks)
            full.record_stream(last)
        event = torch.cuda.Event()
        event.record(last)
        self._prefetched[u] = _Prefetch(natural, event, own)

    def clear_prefetch(self) -> None:
        """Drop prefetched units not used (they would be stale after the next optimizer step)."""
        self._prefetched.clear()

    def gather_unit(self, u: int, own_experts: bool = False) -> torch.Tensor:
        """Unit u's parameters in natural layout (a transient buffer); use `natural_view` for each one.
        `own_experts` (the trainer's layers): with `expert_comm`, of the experts only this rank's own, the
        others zero."""
        self._expect("training", "gather_unit")
        own = own_experts and self._own_experts(u)
        pre = self._prefetched.pop(u, None)
        if pre is None or pre.own_experts != own:
            return self._gather(u, own)
        if pre.event is not None:
            torch.cuda.current_stream(self.device).wait_event(pre.event)
            pre.natural.record_stream(torch.cuda.current_stream(self.device))
        return pre.natural

    def natural_view(self, natural: torch.Tensor, name: str) -> torch.Tensor:
        """Parameter `name` (its full shape) inside a unit's natural-layout buffer from `gather_unit`."""
        return self.layout.natural_view(natural, name)

    def reduce_scatter_grad(self, u: int, natural_grad: torch.Tensor, out: torch.Tensor,
                            op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM, async_op: bool = False):
        """out (this rank's shard of unit u) = reduction over ranks of the packed natural gradients.
        With `async_op` returns the collective's work (None when nothing was communicated): `out` holds
        the result once `work.wait()` has run (on CUDA: the current stream waits for it)."""
        unit = self.layout.units[u]
        assert natural_grad.dim() == 1 and natural_grad.numel() >= unit.natural_numel, (unit.name, natural_grad.shape)
        assert out.shape == (unit.shard_numel,) and out.dtype == natural_grad.dtype, (unit.name, out.shape, out.dtype)
        if self.layout.tp_size == 1 and natural_grad.numel() == unit.numel:
            packed = natural_grad  # caller allocated the padded unit: no copy at all
        else:
            packed = self.pack_unit(u, natural_grad)
        if self._own_experts(u):  # the trainer's gradients: other slices' experts are zero on this rank
            self.expert_comm.reduce_scatter(u, packed, out)
            return None
        if self.world_size == 1:
            out.copy_(packed[:unit.shard_numel])
            return None
        return _reduce_scatter(out, packed, op=op, group=self.group, async_op=async_op)

    def close(self) -> None:
        """Release G (and with it every mapping); the buffer is unusable afterwards."""
        self._prefetched.clear()
        self.flat_buffer = self._shards = None
        gen, self.gen = self.gen, None
        if gen is not None:
            gen.wait_released()
