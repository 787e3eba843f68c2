"""The zero-copy switch over gloo processes on CPU: N in {1, 2, 3, 4}, every tg dividing N."""

import os
import re
import sys

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from _dist import reporting, spawn  # noqa: E402
from _models import MODELS, model_specs, reference_tp_slice  # noqa: E402

pytestmark = pytest.mark.needs_extension


def full_params(specs, dtype, seed=1234):
    gen = torch.Generator().manual_seed(seed)
    return {s.name: torch.randn(s.shape, generator=gen).to(dtype) for s in specs}


def check_sharded_buffer(rank, world_size, model, dtype, device="cpu", **buffer_kwargs):
    """Every check of the issue for one world size, all tg dividing it (gloo on CPU, NCCL on GPU)."""
    from hybridengine.sharding.switch import ShardedBuffer

    specs = model_specs(**MODELS[model])
    params = {k: v.to(device) for k, v in full_params(specs, dtype).items()}
    for tp in [d for d in range(1, world_size + 1) if world_size % d == 0]:
        buf = ShardedBuffer(specs, dtype=dtype, tp_size=tp, device=device, **buffer_kwargs)
        buf.load_(params)
        shards_before = [s.clone() for s in buf.shard_views()]
        ptrs_before = [s.data_ptr() for s in buf.shard_views()]

        # Training gathers reproduce the full parameters bitwise.
        for u, unit in enumerate(buf.layout.units):
            natural = buf.gather_unit(u)
            for s in unit.params:
                assert torch.equal(buf.natural_view(natural, s.name), params[s.name]), (tp, s.name)
        buf.prefetch_unit(1)
        assert torch.equal(buf.natural_view(buf.gather_unit(1), specs[1].name), params[specs[1].name])
        for u in range(len(buf.layout.units)):  # every unit prefetched at once: gathers and unpacks pipeline
            buf.prefetch_unit(u)
        for u, unit in enumerate(buf.layout.units):
            natural = buf.gather_unit(u)
            for s in unit.params:
                assert torch.equal(buf.natural_view(natural, s.name), params[s.name]), (tp, "prefetched", s.name)

        # Generation views equal the reference TP slices, bitwise, for 50 round trips.
        t = rank // (world_size // tp)
        for trip in range(50):
            buf.switch_to_generation()
            if trip in (0, 49):
                views = buf.generation_views()
                for s in specs:
                    expected = reference_tp_slice(params[s.name].cpu(), s.role, t, tp)
                    assert torch.equal(views[s.name].cpu(), expected), (tp, trip, s.name)
                    assert views[s.name].untyped_storage().data_ptr() == buf.gen.data.untyped_storage().data_ptr()
            buf.switch_to_training()
        assert all(torch.equal(a, b) for a, b in zip(buf.shard_views(), shards_before))
        assert [s.data_ptr() for s in buf.shard_views()] == ptrs_before
        if buf.gen.vmm is not None:  # only the own shards stay mapped between rollouts
            assert buf.gen.mapped_bytes() == buf.layout.shard_numel * buf.layout.element_size

        # Pages mapped ahead (prepare_generation, a host thread with VMM): the switch then only gathers, and
        # an optimizer write after the call still shows up in the rollout.
        for s in buf.shard_views():
            s.add_(2)
        buf.prepare_generation()
        for s, before in zip(buf.shard_views(), shards_before):
            s.copy_(before)
        if buf.gen.vmm is not None:
            assert buf.gen.mapped_bytes() == buf.layout.gen_numel * buf.layout.element_size
        buf.switch_to_generation()
        views = buf.generation_views()
        for s in specs:
            assert torch.equal(views[s.name].cpu(),
                               reference_tp_slice(params[s.name].cpu(), s.role, t, tp)), (tp, s.name)
        buf.switch_to_training()

        # Generation pages kept mapped between rollouts (release=False): the next switch only all-gathers
        # into them, and optimizer writes between rollouts (+1, then -1) show up in it all the same.
        for trip, bump in enumerate([0, 1, 0]):
            buf.switch_to_generation()
            views = buf.generation_views()
            for s in specs:
                expected = reference_tp_slice(params[s.name].cpu(), s.role, t, tp)
                assert torch.equal(views[s.name].cpu(), expected + 1 if bump else expected), (tp, "kept", trip, s.name)
            buf.switch_to_training(release=False)
            assert buf.state == "training"
            if buf.gen.vmm is not None:  # the whole of G stays mapped
                assert buf.gen.mapped_bytes() == buf.layout.gen_numel * buf.layout.element_size
            for s, before in zip(buf.shard_views(), shards_before):
                if trip == 0:
                    s.add_(1)
                else:  # back to the loaded values exactly (x + 1 - 1 need not round to x)
                    s.copy_(before)
        buf.release_generation_pages()
        buf.release_generation_pages()  # nothing left to release: a no-op
        assert all(torch.equal(a, b) for a, b in zip(buf.shard_views(), shards_before))
        if buf.gen.vmm is not None:
            assert buf.gen.mapped_bytes() == buf.layout.shard_numel * buf.layout.element_size

        # An optimizer write into the shard is what the next rollout sees: no sync step.
        for s in buf.shard_views():
            s.add_(1)
        buf.switch_to_generation()
        views = buf.generation_views()
        for s in specs:
            expected = reference_tp_slice(params[s.name].cpu(), s.role, t, tp)
            assert torch.equal(views[s.name].cpu(), expected + 1), (tp, s.name)
        buf.switch_to_training()

        # Reduce-scatter of packed gradients equals the reference sum.
        grad_gen = torch.Generator().manual_seed(100 + rank)
        for u, unit in enumerate(buf.layout.units):
            gdtype = torch.float64 if device == "cpu" else torch.float32  # NCCL: no exact fp64 need
            grad = torch.randn(unit.natural_numel, generator=grad_gen, dtype=gdtype).to(device)
            out = torch.empty(unit.shard_numel, dtype=gdtype, device=device)
            buf.reduce_scatter_grad(u, grad, out)
            grads = [torch.empty_like(grad) for _ in range(world_size)]
            dist.all_gather(grads, grad)
            packed = sum(buf.pack_unit(u, g) for g in grads)
            start, end = unit.shard_range(rank)
            # Summation order may differ between the collective and this sum: fp rounding only.
            tol = 1e-12 if gdtype == torch.float64 else 1e-5
            assert torch.allclose(out, packed[start:end], rtol=0, atol=tol), (tp, unit.name)
            later = torch.empty_like(out)  # the asynchronous form gives the same bits once waited
            work = buf.reduce_scatter_grad(u, grad, later, async_op=True)
            if work is not None:
                work.wait()
            assert torch.equal(later, out), (tp, unit.name)

        # Wrong-state calls raise, naming the rank, and leave the state alone.
        for call, message, state in ((buf.switch_to_training, "needs the generation state", "training"),
                                     (buf.release_generation_pages,
                                      "release_generation_pages() needs the training state", "generation")):
            if state == "generation":
                buf.switch_to_generation()
            try:
                call()
                raise AssertionError(f"{call.__name__} in the {state} state did not raise")
            except RuntimeError as e:
                assert f"rank {rank}" in str(e) and message in str(e), str(e)
            assert buf.state == state
        buf.switch_to_training()
        buf.close()


def _check_world(rank, world_size, init_file, model, dtype, *rest):
    *kwargs, errors = rest  # optional ShardedBuffer kwargs (a dict) before the error queue
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    with reporting(errors, f"rank {rank}"):
        check_sharded_buffer(rank, world_size, model, dtype, **(kwargs[0] if kwargs else {}))


def _mismatch(rank, world_size, init_file, errors):
    from hybridengine.sharding.switch import ShardedBuffer

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    with reporting(errors, f"rank {rank}"):
        specs = model_specs(**MODELS["gqa-untied"], layers=1 + rank)  # rank 1 has an extra layer
        with pytest.raises(ValueError, match=r"ranks \[1\] lay out a different model"):
            ShardedBuffer(specs, dtype=torch.float32)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8])
def test_switch_gathers_and_reduce_scatter(world_size):
    """N = 8 (every tg in 1, 2, 4, 8) is the CPU part of the scaling issue."""
    model = "odd-hidden" if world_size not in (4, 8) else "gqa-untied"
    spawn(_check_world, world_size, model, torch.float32)


def test_bf16_two_ranks():
    spawn(_check_world, 2, "tied-no-bias", torch.bfloat16)


def test_mismatched_layouts_raise_on_every_rank():
    spawn(_mismatch, 2)


def test_without_torch_distributed_one_rank_alone():
    from hybridengine.sharding.switch import ShardedBuffer

    specs = model_specs(**MODELS["odd-hidden"])
    params = full_params(specs, torch.float32)
    buf = ShardedBuffer(specs, dtype=torch.float32)
    assert buf.world_size == 1 and buf.local
    buf.load_(params)
    natural = buf.gather_unit(1)
    assert natural.data_ptr() == buf.gen.unit_slice(1).data_ptr()  # zero-copy: the shard is the unit
    for s in buf.layout.units[1].params:
        assert torch.equal(buf.natural_view(natural, s.name), params[s.name])
    buf.switch_to_generation()
    assert all(torch.equal(v, params[n]) for n, v in buf.generation_views().items())
    buf.switch_to_training()
    grad = torch.randn(buf.layout.units[1].natural_numel, dtype=torch.float64)
    out = torch.empty(buf.layout.units[1].shard_numel, dtype=torch.float64)
    buf.reduce_scatter_grad(1, grad, out)
    assert torch.equal(out[:len(grad)], grad) and not out[len(grad):].any()
    with pytest.raises(ValueError, match="torch.distributed is not initialised"):
        ShardedBuffer(specs, dtype=torch.float32, group=object())


def test_failed_mapping_leaves_training_state(monkeypatch):
    """A mapping failure (e.g. out of memory) names the rank and unit and leaves the buffer as it was."""
    from hybridengine.sharding.generation_memory import GenerationBuffer
    from hybridengine.sharding.switch import ShardedBuffer

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        specs = model_specs(**MODELS["odd-hidden"])
        buf = ShardedBuffer(specs, dtype=torch.float32)
        buf.load_(full_params(specs, torch.float32))
        before = buf.gen.data.clone()
        unmapped = []
        real_map = GenerationBuffer.map_unit

        def failing_map(self, u):
            if u == 2:
                raise RuntimeError("VmmRange on cuda:0: cuMemCreate failed with CUDA_ERROR_OUT_OF_MEMORY")
            real_map(self, u)
            return [] if u == 0 else [1000 * u]  # unit 0 as if kept mapped by an earlier switch

        monkeypatch.setattr(GenerationBuffer, "map_unit", failing_map)
        monkeypatch.setattr(GenerationBuffer, "unmap_unit", lambda self, u, offsets=None: unmapped.append((u, offsets)))
        with pytest.raises(RuntimeError,
                           match=r"rank 0: switch_to_generation could not map unit 'layers.1'.*OUT_OF_MEMORY"):
            buf.switch_to_generation()
        # Only what this call mapped is unmapped again: never pages kept from an earlier switch.
        assert buf.state == "training" and unmapped == [(1, [1000])]
        assert torch.equal(buf.gen.data, before)
        monkeypatch.setattr(GenerationBuffer, "map_unit", real_map)
        buf.switch_to_generation()
        assert buf.state == "generation"
        with pytest.raises(RuntimeError, match="gather_unit\\(\\) needs the training state"):
            buf.gather_unit(0)
    finally:
        dist.destroy_process_group()


def test_switch_batches_cover_every_unit_once():
    """The switch's NCCL group calls: the smallest unit alone first, then units in layout order, each
    batch within switch_batch_bytes of received bytes unless one unit alone exceeds it."""
    from hybridengine.sharding.layout import ShardedLayout
    from hybridengine.sharding.switch import switch_batches

    specs = model_specs(**MODELS["odd-hidden"])
    lay = ShardedLayout(specs, world_size=4, tp_size=2)
    received = [u.shard_numel * (lay.num_shards - 1) * lay.element_size for u in lay.units]
    for limit in (1, min(received), 2 * max(received), sum(received)):
        batches = switch_batches(lay, limit)
        flat = [u for b in batches for u in b]
        assert sorted(flat) == list(range(len(lay.units)))
        assert received[batches[0][0]] == min(received) and len(batches[0]) == 1
        assert flat[1:] == sorted(flat[1:])
        for b in batches[1:]:
            assert len(b) == 1 or sum(received[u] for u in b) <= limit, (limit, b)
    assert [len(b) for b in switch_batches(lay, 0)] == [1] * len(lay.units)


class _FakeVmm:
    """VmmRange's bookkeeping alone (offset -> bytes); `map` fails at the offsets in `fail_at`."""

    def __init__(self):
        self.maps, self.fail_at = {}, set()

    def map(self, off, n):
        if off in self.fail_at:
            raise RuntimeError("VmmRange on cuda:0: cuMemCreate failed with CUDA_ERROR_OUT_OF_MEMORY")
        assert off not in self.maps, f"offset {off} mapped twice"
        self.maps[off] = n

    def unmap(self, off):
        del self.maps[off]

    def is_mapped(self, off):
        return off in self.maps

    def unmap_after_current_stream(self, offsets):
        assert offsets, "an empty release still joins the release thread"
        for off in offsets:
            del self.maps[off]

    def wait_released(self):
        pass

    def map_in_background(self, pieces):
        """Deferred to wait_mapped, all or nothing, as VmmRange.map_in_background."""
        for off, n in pieces:
            assert off not in self.maps, f"offset {off} mapped twice"
        self.pending = list(pieces)

    def wait_mapped(self):
        pieces, self.pending = getattr(self, "pending", []), []
        if any(off in self.fail_at for off, _ in pieces):
            raise RuntimeError("VmmRange on cuda:0: background cuMemCreate/cuMemMap/cuMemSetAccess failed with "
                               "CUDA_ERROR_OUT_OF_MEMORY")
        self.maps.update(pieces)

    def mapped_bytes(self):
        return sum(self.maps.values())


def test_map_others_in_background():
    """GenerationBuffer.map_others_in_background maps every other shard not mapped yet (kept ones are
    skipped); after wait_mapped a switch's map_unit finds nothing to map; a failure maps nothing; a
    release joins a pending background mapping first."""
    from hybridengine.sharding.layout import ShardedLayout
    from hybridengine.sharding.generation_memory import GenerationBuffer

    layout = ShardedLayout(model_specs(**MODELS["odd-hidden"]), world_size=2, tp_size=1)
    gen = GenerationBuffer(layout, 0, torch.float32, torch.device("cpu"), use_vmm=False)
    gen.vmm = vmm = _FakeVmm()
    others = {u: [off for off, _ in gen._other_shard_bytes(u)] for u in range(len(layout.units))}
    vmm.map(others[1][0], 1)  # kept from the last rollout
    gen.map_others_in_background()
    assert len(vmm.pending) == len(layout.units) - 1 and not vmm.is_mapped(others[0][0])
    gen.wait_mapped()
    assert all(gen.map_unit(u) == [] for u in range(len(layout.units)))
    gen.release_others_deferred()
    assert vmm.maps == {}
    vmm.fail_at = {others[2][0]}
    gen.map_others_in_background()
    with pytest.raises(RuntimeError, match="OUT_OF_MEMORY"):
        gen.wait_mapped()
    assert vmm.maps == {}
    vmm.fail_at = set()
    gen.map_others_in_background()
    gen.release_others_deferred()  # joins the mapping, then releases it
    assert vmm.maps == {} and vmm.pending == []


def test_prepare_generation_states_and_failure(monkeypatch):
    """prepare_generation needs the training state; a failed background mapping is raised by the next
    switch_to_generation, naming the rank, with the buffer left in training; the switch after works."""
    from hybridengine.sharding.generation_memory import GenerationBuffer
    from hybridengine.sharding.switch import ShardedBuffer

    specs = model_specs(**MODELS["odd-hidden"])
    buf = ShardedBuffer(specs, dtype=torch.float32)
    params = full_params(specs, torch.float32)
    buf.load_(params)
    started = []
    monkeypatch.setattr(GenerationBuffer, "map_others_in_background", lambda self: started.append(True))
    buf.prepare_generation()
    assert started == [True] and buf.state == "training"
    buf.switch_to_generation()
    with pytest.raises(RuntimeError, match=r"rank 0: prepare_generation\(\) needs the training state"):
        buf.prepare_generation()
    buf.switch_to_training()

    def failed(self):
        raise RuntimeError("VmmRange on cuda:0: background cuMemCreate failed with CUDA_ERROR_OUT_OF_MEMORY")

    monkeypatch.setattr(GenerationBuffer, "wait_mapped", failed)
    with pytest.raises(RuntimeError, match=r"rank 0: switch_to_generation: mapping the generation pages ahead "
                                           r"\(prepare_generation\) failed.*training state.*OUT_OF_MEMORY"):
        buf.switch_to_generation()
    assert buf.state == "training"
    monkeypatch.undo()
    buf.switch_to_generation()
    assert all(torch.equal(v, params[n]) for n, v in buf.generation_views().items())


def test_map_unit_maps_only_what_is_missing():
    """Pages kept mapped (switch_to_training(release=False)) are not mapped again; a failed map_unit
    unmaps only what it mapped itself, never kept pages."""
    from hybridengine.sharding.layout import ShardedLayout
    from hybridengine.sharding.generation_memory import GenerationBuffer

    layout = ShardedLayout(model_specs(**MODELS["odd-hidden"]), world_size=4, tp_size=1, element_size=4)
    gen = GenerationBuffer(layout, 1, torch.float32, torch.device("cpu"), use_vmm=False)
    gen.vmm = vmm = _FakeVmm()
    for off, n in layout.shard_in_gen(1):
        vmm.map(off * 4, n * 4)
    own = layout.shard_numel * 4
    others = [off for off, _ in gen._other_shard_bytes(0)]
    assert len(others) == 3
    assert gen.map_unit(0) == others
    assert gen.map_unit(0) == []  # all kept: nothing mapped again
    vmm.unmap(others[1])
    vmm.unmap(others[2])
    vmm.fail_at = {others[2]}
    with pytest.raises(RuntimeError, match="OUT_OF_MEMORY"):
        gen.map_unit(0)
    assert [vmm.is_mapped(o) for o in others] == [True, False, False]  # the kept page stays
    vmm.fail_at = set()
    assert gen.map_unit(0) == others[1:]
    gen.unmap_unit(0, others[1:])
    assert [vmm.is_mapped(o) for o in others] == [True, False, False]
    for u in range(len(layout.units)):
        gen.map_unit(u)
    assert gen.mapped_bytes() == layout.gen_numel * 4
    gen.release_others_deferred()
    assert gen.mapped_bytes() == own
    gen.release_others_deferred()  # nothing to release: the range is not called


def test_switch_batch_bytes_argument():
    from hybridengine.sharding.switch import SWITCH_BATCH_BYTES, ShardedBuffer

    specs = model_specs(**MODELS["odd-hidden"])
    for bad in (-1, 1.5, "2GiB"):
        with pytest.raises(ValueError, match="switch_batch_bytes must be None or an int >= 0"):
            ShardedBuffer(specs, dtype=torch.float32, switch_batch_bytes=bad)
    # Alone nothing is received: the automatic batch sits at its lower bound.
    assert ShardedBuffer(specs, dtype=torch.float32).switch_batch_bytes == SWITCH_BATCH_BYTES[0]
    assert ShardedBuffer(specs, dtype=torch.float32, switch_batch_bytes=0).switch_batch_bytes == 0


def test_constructor_and_load_arguments():
    """The public boundary: every bad argument of ShardedBuffer(...) and load_ raises, naming it."""
    from hybridengine.sharding.switch import ShardedBuffer

    specs = model_specs(**MODELS["odd-hidden"])
    for bad, match in (([], "specs must be a non-empty list of ParamSpec"),
                       ([("model.norm.weight", (4,))], "specs must be a non-empty list of ParamSpec, got list"),
                       ("model.norm.weight", "specs must be a non-empty list of ParamSpec, got str")):
        with pytest.raises(ValueError, match=match):
            ShardedBuffer(bad, dtype=torch.float32)
    for kwargs, match in (({"dtype": torch.int32}, "dtype must be a floating torch.dtype, got torch.int32"),
                          ({"dtype": "bf16"}, "dtype must be a floating torch.dtype, got 'bf16'"),
                          ({"tp_size": 0}, r"tp_size must be in \[1, inf\), got 0"),
                          ({"tp_size": 1.0}, "tp_size must be a finite integer, got 1.0"),
                          ({"tp_size": 2}, "tp_size=2 must divide the group's world_size=1"),
                          ({"use_vmm": "yes"}, "use_vmm must be one of"),
                          ({"use_vmm": True}, "use_vmm=True needs a CUDA device, got device=cpu"),
                          ({"timeout": 30}, "timeout must be None or a datetime.timedelta, got int 30"),
                          ({"switch_batch_bytes": True}, "switch_batch_bytes must be None or an int >= 0")):
        with pytest.raises(ValueError, match="ShardedBuffer: " + match):
            ShardedBuffer(specs, **({"dtype": torch.float32} | kwargs))

    buf = ShardedBuffer(specs, dtype=torch.float32)
    params = full_params(specs, torch.float32)
    name = specs[0].name
    with pytest.raises(ValueError, match="ShardedBuffer.load_: params must be a mapping"):
        buf.load_(list(params.values()))
    with pytest.raises(ValueError, match=rf"load_: parameters missing: \['{name}'\]"):
        buf.load_({n: p for n, p in params.items() if n != name})
    for bad, match in ((params[name].t(), rf"params\['{name}'\] must have shape {re.escape(str(specs[0].shape))}"),
                       (params[name].long(), rf"params\['{name}'\] must be a float tensor"),
                       (params[name].tolist(), rf"params\['{name}'\] must be a torch.Tensor")):
        with pytest.raises(ValueError, match=match):
            buf.load_(params | {name: bad})
    assert not any(s.any() for s in buf.shard_views())  # nothing was written by the failed loads
    buf.load_(params | {"not.a.parameter": torch.zeros(1)})  # names outside the layout are ignored
    buf.switch_to_generation()
    with pytest.raises(RuntimeError, match=r"rank 0: load_\(\) needs the training state"):
        buf.load_(params)


def test_views_are_the_flat_buffer():
    """shard_views and generation_views are FlatParamBuffer's views of G (one implementation); close()
    drops every reference to G."""
    from hybridengine.sharding.buffer import FlatParamBuffer
    from hybridengine.sharding.layout import ShardedLayout
    from hybridengine.sharding.switch import ShardedBuffer

    specs = model_specs(**MODELS["odd-hidden"])
    buf = ShardedBuffer(specs, dtype=torch.float32)
    buf.load_(full_params(specs, torch.float32))
    flat = buf.flat_buffer
    assert isinstance(flat, FlatParamBuffer) and flat.data is buf.gen.data and flat.layout is buf.layout
    assert [s.data_ptr() for s in buf.shard_views()] == [s.data_ptr() for s in flat.shard_views()]
    buf.switch_to_generation()
    views = buf.generation_views()
    assert list(views) == [s.name for s in specs]
    assert all(v.data_ptr() == flat.view(n).data_ptr() and v.shape == flat.view(n).shape for n, v in views.items())
    buf.switch_to_training()
    buf.close()
    assert buf.gen is None and buf.flat_buffer is None
    # The shard views of a rank of a larger world lie in its slice of G, one per unit.
    layout = ShardedLayout(specs, world_size=4, tp_size=2, element_size=4)
    other = FlatParamBuffer(layout, dtype=torch.float32, rank=3)
    assert [(s.data_ptr() - other.data.data_ptr()) // 4 for s in other.shard_views()] == \
        [off for off, _ in layout.shard_in_gen(3)]
