"""The zero-copy switch over gloo processes on CPU: N in {1, 2, 3, 4}, every tg dividing N."""

import os
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hybridengine import ops

sys.path.insert(0, os.path.dirname(__file__))
from _models import MODELS, model_specs, reference_tp_slice  # noqa: E402

pytestmark = pytest.mark.skipif(ops.EXTENSION_ERROR is not None, reason="hybridengine._C is not built")


def full_params(specs, dtype, seed=1234):
    gen = torch.Generator().manual_seed(seed)
    return {s.name: torch.randn(s.shape, generator=gen).to(dtype) for s in specs}


def _check_world(rank, world_size, init_file, model, dtype, errors):
    """Every check of the issue for one world size, all tg dividing it; failures go to `errors`."""
    from hybridengine.sharded import ShardedBuffer

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        specs = model_specs(**MODELS[model])
        params = full_params(specs, dtype)
        for tp in [d for d in range(1, world_size + 1) if world_size % d == 0]:
            buf = ShardedBuffer(specs, dtype=dtype, tp_size=tp)
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

            # Generation views equal the reference TP slices, bitwise, for 50 round trips.
            t = rank // (world_size // tp)
            for trip in range(50):
                buf.switch_to_generation()
                if trip in (0, 49):
                    views = buf.generation_views()
                    for s in specs:
                        expected = reference_tp_slice(params[s.name], s.role, t, tp)
                        assert torch.equal(views[s.name], expected), (tp, trip, s.name)
                        assert views[s.name].untyped_storage().data_ptr() == buf.gen.data.untyped_storage().data_ptr()
                buf.switch_to_training()
            assert all(torch.equal(a, b) for a, b in zip(buf.shard_views(), shards_before))
            assert [s.data_ptr() for s in buf.shard_views()] == ptrs_before

            # An optimizer write into the shard is what the next rollout sees: no sync step.
            for s in buf.shard_views():
                s.add_(1)
            buf.switch_to_generation()
            views = buf.generation_views()
            for s in specs:
                expected = reference_tp_slice(params[s.name], s.role, t, tp)
                assert torch.equal(views[s.name], expected + 1), (tp, s.name)
            buf.switch_to_training()

            # Reduce-scatter of packed gradients equals the reference sum.
            grad_gen = torch.Generator().manual_seed(100 + rank)
            for u, unit in enumerate(buf.layout.units):
                grad = torch.randn(unit.natural_numel, generator=grad_gen, dtype=torch.float64)
                out = torch.empty(unit.shard_numel, dtype=torch.float64)
                buf.reduce_scatter_grad(u, grad, out)
                grads = [torch.empty_like(grad) for _ in range(world_size)]
                dist.all_gather(grads, grad)
                packed = sum(buf.pack_unit(u, g) for g in grads)
                start, end = unit.shard_range(rank)
                assert torch.allclose(out, packed[start:end], rtol=0, atol=1e-12), (tp, unit.name)

            # Wrong-state calls raise and leave the state alone.
            try:
                buf.switch_to_training()
                raise AssertionError("switch_to_training in training state did not raise")
            except RuntimeError as e:
                assert f"rank {rank}" in str(e) and "needs the generation state" in str(e)
            assert buf.state == "training"
            buf.close()
    except Exception as e:  # noqa: BLE001  (reported to the parent with the rank)
        import traceback

        errors.put(f"rank {rank}: {traceback.format_exc()}")
        raise
    finally:
        dist.destroy_process_group()


def _mismatch(rank, world_size, init_file, errors):
    from hybridengine.sharded import ShardedBuffer

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        specs = model_specs(**MODELS["gqa-untied"], layers=1 + rank)  # rank 1 has an extra layer
        ShardedBuffer(specs, dtype=torch.float32)
        errors.put(f"rank {rank}: mismatched layouts did not raise")
    except ValueError as e:
        if "ranks [1] lay out a different model" not in str(e):
            errors.put(f"rank {rank}: wrong error {e}")
    finally:
        dist.destroy_process_group()


def _spawn(fn, world_size, *args):
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(fn, args=(world_size, os.path.join(tmp, "store"), *args, errors), nprocs=world_size,
                           start_method="spawn", join=True)
    messages = []
    while not errors.empty():
        messages.append(errors.get())
    assert not messages, "\n".join(messages)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_switch_gathers_and_reduce_scatter(world_size):
    model = "odd-hidden" if world_size != 4 else "gqa-untied"
    _spawn(_check_world, world_size, model, torch.float32)


def test_bf16_two_ranks():
    _spawn(_check_world, 2, "tied-no-bias", torch.bfloat16)


def test_mismatched_layouts_raise_on_every_rank():
    _spawn(_mismatch, 2)


def test_needs_initialised_process_group():
    from hybridengine.sharded import ShardedBuffer

    with pytest.raises(RuntimeError, match="needs torch.distributed initialised"):
        ShardedBuffer(model_specs(**MODELS["odd-hidden"]), dtype=torch.float32)
