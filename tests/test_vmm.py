"""The CUDA VMM range and the VMM-backed generation buffer (GPU only)."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.needs_extension]


def vmm_range(nbytes):
    from hybridengine.sharding.vmm import VmmRange

    return VmmRange(nbytes, torch.cuda.current_device())


def test_map_write_read_unmap():
    r = vmm_range(3 << 21)
    g = r.granularity
    assert g > 0 and r.size == 3 * g and r.mapped_bytes() == 0
    r.map(0, g)
    r.map(2 * g, g)
    assert r.mapped_bytes() == 2 * g and r.is_mapped(0) and not r.is_mapped(g)
    t = r.tensor(torch.float32)
    n = g // 4
    t[:n].copy_(torch.arange(n, dtype=torch.float32, device="cuda"))
    t[2 * n:].fill_(7)
    torch.cuda.synchronize()
    assert torch.equal(t[:n].cpu(), torch.arange(n, dtype=torch.float32))
    assert bool((t[2 * n:] == 7).all())
    r.unmap(2 * g)
    r.map(2 * g, g)  # remapping gives usable memory again
    t[2 * n:].fill_(3)
    assert bool((t[2 * n:] == 3).all()) and torch.equal(t[:n].cpu(), torch.arange(n, dtype=torch.float32))


def test_deferred_release_waits_for_queued_work():
    """unmap_after_current_stream returns at once; the pages stay until the work queued before it
    (a copy out of them, behind ~25 ms of GPU sleep) has run, then go back to the driver."""
    r = vmm_range(2 << 21)
    g = r.granularity
    r.map(0, g)
    r.map(g, g)
    t = r.tensor(torch.float32)
    n = g // 4
    t[n:2 * n].fill_(4)
    out = torch.empty(n, device="cuda")
    torch.cuda._sleep(50_000_000)
    out.copy_(t[n:2 * n])
    r.unmap_after_current_stream([g, g])  # a repeated offset counts once
    assert r.mapped_bytes() == 2 * g and not r.is_mapped(g)  # pending: still backed, no longer mappable by us
    r.wait_released()
    assert r.mapped_bytes() == g
    assert bool((out == 4).all())
    with pytest.raises(ValueError, match="nothing was mapped at offset"):
        r.unmap_after_current_stream([0, g])  # checked before anything changes
    assert r.mapped_bytes() == g and r.is_mapped(0)
    r.map(g, g)  # the offset is free again
    assert r.mapped_bytes() == 2 * g


def test_driver_call_timings():
    r = vmm_range(2 << 21)
    r.timings(reset=True)
    r.map(0, r.granularity)
    r.unmap(0)
    t = r.timings()
    assert all(t[k][1] == 1 and t[k][0] > 0 for k in ("create", "map", "set_access", "unmap", "release")), t
    assert r.timings(reset=True)["map"][1] == 1  # a reset returns the counts, then zeroes them
    assert all(n == 0 for _, n in r.timings().values())


def test_errors():
    r = vmm_range(4 << 21)
    g = r.granularity
    with pytest.raises(ValueError, match="multiples of the granularity"):
        r.map(1, g)
    with pytest.raises(ValueError, match="outside the reserved"):
        r.map(0, 8 * g)
    r.map(0, 2 * g)
    with pytest.raises(ValueError, match="overlaps a range that is already mapped"):
        r.map(g, g)
    with pytest.raises(ValueError, match="nothing was mapped at offset"):
        r.unmap(g)
    assert r.mapped_bytes() == 2 * g  # failed calls changed nothing
    with pytest.raises(RuntimeError, match="OUT_OF_MEMORY|out of memory|INVALID"):
        huge = vmm_range(1 << 50)
        huge.map(0, 1 << 50)
    with pytest.raises(ValueError, match="outside the reserved"):
        r.tensor(torch.uint8, 0, 8 * g)


def test_map_in_background():
    """map_in_background returns at once; after wait_mapped the pieces are mapped (an allocation each)
    and usable; bad pieces raise before any thread starts; calls that change mappings join the thread;
    a failing background mapping maps nothing and wait_mapped raises it (once)."""
    r = vmm_range(8 << 21)
    g = r.granularity
    r.map(g, g)
    r.timings(reset=True)
    r.map_in_background([(3 * g, 2 * g), (0, g), (6 * g, g)])
    r.wait_mapped()
    t = r.timings(reset=True)
    assert (t["create"][1], t["map"][1], t["set_access"][1]) == (3, 3, 3), t
    assert r.mapped_bytes() == 5 * g and all(r.is_mapped(o) for o in (0, g, 3 * g, 6 * g))
    x = r.tensor(torch.float32, 3 * g, 2 * g)
    x.copy_(torch.arange(x.numel(), dtype=torch.float32, device="cuda"))
    torch.cuda.synchronize()
    assert torch.equal(x.cpu(), torch.arange(x.numel(), dtype=torch.float32))
    with pytest.raises(ValueError, match="overlaps a range that is already mapped"):
        r.map_in_background([(2 * g, g), (3 * g, g)])
    with pytest.raises(ValueError, match="overlap"):
        r.map_in_background([(2 * g, 2 * g), (2 * g, g)])
    assert r.mapped_bytes() == 5 * g and not r.is_mapped(2 * g)
    r.map_in_background([(2 * g, g)])
    r.unmap(2 * g)  # joins the mapping thread first
    r.map_in_background([])
    r.wait_mapped()
    assert r.mapped_bytes() == 5 * g
    huge = vmm_range(1 << 39)  # 512 GiB of addresses; 256 GiB of memory is more than the GPU has
    huge.map(0, huge.granularity)
    huge.map_in_background([(1 << 38, 1 << 38), (huge.granularity, huge.granularity)])
    with pytest.raises(RuntimeError, match="background .* failed with .*(OUT_OF_MEMORY|INVALID)"):
        huge.wait_mapped()
    huge.wait_mapped()  # the error was reported once
    assert huge.mapped_bytes() == huge.granularity and not huge.is_mapped(huge.granularity)


def test_tensor_keeps_range_alive():
    r = vmm_range(1 << 21)
    r.map(0, r.granularity)
    t = r.tensor(torch.uint8, 0, 1 << 21)
    del r
    t.fill_(5)
    torch.cuda.synchronize()
    assert int(t[123]) == 5


def test_map_unit_keeps_mapped_pages(monkeypatch):
    """The generation buffer of rank 1 of 4 (no process group needed): map_unit backs only the other
    shards not mapped yet, so pages kept by switch_to_training(release=False) keep their memory and
    contents; a failed map_unit unmaps only what it mapped itself. (A ShardedBuffer of one process
    has no other shards, so this is tested on GenerationBuffer.)"""
    import os
    import sys

    from hybridengine.sharding.layout import ShardedLayout
    from hybridengine.sharding.generation_memory import GenerationBuffer

    sys.path.insert(0, os.path.dirname(__file__))
    from _models import MODELS, model_specs

    device = torch.device("cuda", torch.cuda.current_device())
    layout = ShardedLayout(model_specs(**MODELS["odd-hidden"]), world_size=4, tp_size=1, element_size=4,
                           shard_align_bytes=vmm_range(1).granularity)
    gen = GenerationBuffer(layout, 1, torch.float32, device, use_vmm=True)
    own = layout.shard_numel * 4
    assert gen.mapped_bytes() == own
    others = gen._other_shard_bytes(0)
    offsets = [off for off, _ in others]
    assert len(others) == 3
    assert gen.map_unit(0) == offsets
    kept = gen.data[offsets[0] // 4:(offsets[0] + others[0][1]) // 4]
    kept.fill_(5)
    assert gen.map_unit(0) == []  # all mapped already: nothing new, the contents stay
    assert bool((kept == 5).all())
    gen.vmm.unmap(offsets[1])
    gen.vmm.unmap(offsets[2])
    real_map, calls = gen.vmm.map, []

    def failing_map(off, n):
        calls.append(off)
        if len(calls) == 2:
            raise RuntimeError("VmmRange on cuda:0: cuMemCreate failed with CUDA_ERROR_OUT_OF_MEMORY")
        real_map(off, n)

    monkeypatch.setattr(gen.vmm, "map", failing_map)
    with pytest.raises(RuntimeError, match="OUT_OF_MEMORY"):
        gen.map_unit(0)
    monkeypatch.undo()
    assert calls == offsets[1:]
    assert [gen.vmm.is_mapped(o) for o in offsets] == [True, False, False]  # the kept page stays
    assert bool((kept == 5).all())
    assert gen.map_unit(0) == offsets[1:]
    for u in range(len(layout.units)):
        gen.map_unit(u)
    assert gen.mapped_bytes() == layout.gen_numel * 4
    gen.release_others_deferred()
    assert gen.mapped_bytes() == own
