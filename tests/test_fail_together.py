"""Ranks fail together: a rank that raises in a collective phase, and stays alive, makes every other
rank raise a `CollectiveError` naming it and the phase within `collective_timeout_s`; a rejected input
raises on every rank at once and leaves the engine usable. 2 and 4 gloo ranks, every phase."""

import contextlib
import itertools
import json
import time
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

import hybridengine as he
from hybridengine.faults import CollectiveError

from _dist import reporting, spawn

TIMEOUT_S = 2.0  # the engines' collective_timeout_s here
SLACK_S = 12.0  # start-up of the phase and a loaded CI machine, on top of the timeout
VOCAB = 128


def build():
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(he.model_config("tiny-qwen2"), attn_implementation="eager").eval()


def engine_for(tp=1, role="actor"):
    cfg = he.EngineConfig(dtype=torch.float32, device="cpu", tp_generation=tp, max_model_len=64, max_num_seqs=4,
                          collective_timeout_s=TIMEOUT_S)
    return he.HybridEngine(build(), cfg, role=role)


def batch(rank, bad_id=False, critic=False):
    g = torch.Generator().manual_seed(rank)
    lengths = [9, 14, 6][: 2 + rank % 2]  # ranks hold different batches
    ids = [torch.randint(0, VOCAB, (n,), generator=g) for n in lengths]
    if bad_id:
        ids[1][3] = VOCAB + 5
    fields = dict(response_mask=[torch.ones(n - 1) for n in lengths])
    if critic:
        fields.update(old_values=[torch.randn(n - 1, generator=g) for n in lengths],
                      returns=[torch.randn(n - 1, generator=g) for n in lengths])
    else:
        fields.update(old_logprobs=[torch.randn(n - 1, generator=g) - 4 for n in lengths],
                      advantages=[torch.randn(n - 1, generator=g) for n in lengths])
    return he.PPOBatch(input_ids=ids, **fields)


CFG = he.PPOConfig(lr=1e-3, micro_batch_tokens=16)


def fail_on_call(n, fn):
    """fn, raising an injected error at its n-th call (after the phase's first collectives)."""
    calls = itertools.count(1)

    def failing(*args, **kwargs):
        if next(calls) == n:
            raise RuntimeError("injected failure")
        return fn(*args, **kwargs)

    return failing


# phase -> (engine kwargs, the call, how rank 1 fails inside it)
def _ppo_step(e, rank):
    return e.ppo_step(batch(rank), CFG)


def _log_probs(e, rank):
    return e.log_probs(batch(rank))


def _values(e, rank):
    return e.values(batch(rank, critic=True))


def _rollout(e, rank):
    with e.rollout():
        pass


def _generate(e, rank):
    with e.rollout():
        return e.generate([[1, 2, 3]], he.SamplingParams(max_tokens=4, temperature=0.0))


def _save(e, rank, path):
    e.save(path)


def _inject(phase, engine):
    if phase in ("ppo_step", "log_probs", "values"):
        engine.sharded.gather_unit = fail_on_call(2, engine.sharded.gather_unit)
        return contextlib.nullcontext()
    if phase == "rollout":
        engine.sharded._gather_slices = fail_on_call(2, engine.sharded._gather_slices)
        return contextlib.nullcontext()
    if phase == "generate":
        engine._sampler = fail_on_call(2, engine._sampler)
        return contextlib.nullcontext()
    if phase == "save":
        return mock.patch.object(torch, "save", side_effect=OSError("injected: no space left on device"))
    raise AssertionError(phase)


CALLS = dict(ppo_step=_ppo_step, log_probs=_log_probs, values=_values, rollout=_rollout, generate=_generate,
             save=_save)
def _fail_phase(rank, world, phase, tmp):
    """One phase: a good call, then rank 1 fails inside the next one and calls again; seconds to raise."""
    role = "critic" if phase == "values" else "actor"
    engine = engine_for(tp=world if phase == "generate" else 1, role=role)
    call = CALLS[phase]
    first, second = ((f"{tmp}/{phase}{world}",), (f"{tmp}/{phase}{world}b",)) if phase == "save" else ((), ())
    call(engine, rank, *first)  # a good call first: every rank is in step
    t0 = time.monotonic()
    if phase == "save":  # save shares a rank's error with every rank itself: all raise, the engine stays usable
        with _inject(phase, engine) if rank == 1 else contextlib.nullcontext():  # rank 1: its own OSError
            with pytest.raises((RuntimeError, OSError), match=r"inject" if rank == 1 else
                               r"not written: ranks \[1\] failed to write their files .*inject"):
                call(engine, rank, *second)
        took = time.monotonic() - t0
        assert took < TIMEOUT_S, f"rank {rank} took {took:.1f} s to raise in save"
        call(engine, rank, *second)  # and the next save works
        return took
    if rank == 1:
        with _inject(phase, engine):
            with pytest.raises((RuntimeError, OSError), match="injected"):
                call(engine, rank, *second)
        took = time.monotonic() - t0
        # It stays alive and calls again: refused at once, without entering a collective.
        t1 = time.monotonic()
        with pytest.raises(CollectiveError, match=f"rank 1 failed in {phase}") as info:
            call(engine, rank, *first)
        assert info.value.usable is False and time.monotonic() - t1 < 1.0
        return took
    with pytest.raises(CollectiveError, match=r"rank 1 failed in a collective phase") as info:
        call(engine, rank, *second)
    took = time.monotonic() - t0
    assert any(f"{phase}: {kind}: injected" in str(info.value) for kind in ("RuntimeError", "OSError")), \
        str(info.value)
    assert list(info.value.failed) == [1] and info.value.usable is False
    assert took < TIMEOUT_S + SLACK_S, f"rank {rank} took {took:.1f} s to raise in {phase}"
    with pytest.raises(CollectiveError, match="must be rebuilt"):  # and later calls are refused
        call(engine, rank, *first)
    return took


def _reject_and_mismatch(rank):
    """A rejected input (a token id outside the vocabulary on rank 1) raises on every rank at once and
    the engine stays usable; so do ranks that call different phases."""
    engine = engine_for()
    for phase in ("ppo_step", "log_probs"):
        step = (lambda b: engine.ppo_step(b, CFG)) if phase == "ppo_step" else engine.log_probs
        step(batch(rank))
        t0 = time.monotonic()
        if rank == 1:  # found before any collective
            with pytest.raises(ValueError, match="vocab"):
                step(batch(rank, bad_id=True))
        else:
            with pytest.raises(CollectiveError, match=rf"{phase}: rank 1 rejected its inputs before any work") as info:
                step(batch(rank))
            assert info.value.usable and list(info.value.failed) == [1]
        assert time.monotonic() - t0 < TIMEOUT_S, "a rejected input must not wait for the timeout"
        step(batch(rank))  # every rank carries on: nothing ran, the engine is usable
    assert engine.trainer.optimizer.num_steps == 2
    with pytest.raises(CollectiveError, match="called different phases"):
        if rank == 0:
            engine.log_probs(batch(rank))
        else:
            engine.ppo_step(batch(rank), CFG)
    engine.log_probs(batch(rank))
    assert engine.trainer.optimizer.num_steps == 2


def _fail_worker(rank, world, init_file, phases, tmp, errors):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    with reporting(errors, f"rank {rank} (N={world})"):
        _reject_and_mismatch(rank)
        took = {}
        for phase in phases:  # a fresh engine (and process group) per phase: the failure breaks the last one
            took[phase] = _fail_phase(rank, world, phase, tmp)
        with open(f"{tmp}/took{rank}.json", "w") as f:
            json.dump(took, f)


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_fail_together(world, tmp_path):
    """First a rejected input and a mismatched call (every rank raises at once, the engine stays usable);
    then every phase: ppo_step, log_probs, values (critic), the switch (rollout), TP generation (tg = N,
    at N = 2: tiny-qwen2 has 2 KV heads), save. Rank 1 raises inside the phase's work and stays alive.
    (save agrees on a failed write itself: every rank raises it at once and the engine stays usable.)
    One set of processes per N: their start-up is most of the test's time."""
    phases = [p for p in CALLS if not (p == "generate" and world > 2)]
    spawn(_fail_worker, world, phases, str(tmp_path))
    took = {r: json.loads((tmp_path / f"took{r}.json").read_text()) for r in range(world)}
    for phase in phases:
        print(f"N={world} {phase}: seconds to raise, per rank: "
              + ", ".join(f"{r}: {took[r][phase]:.2f}" for r in range(world)))
        assert all(took[r][phase] < TIMEOUT_S + SLACK_S for r in range(world) if r != 1)


def test_alone_the_checks_still_run_and_nothing_is_collective():
    engine = engine_for()
    with pytest.raises(ValueError, match="vocab"):
        engine.ppo_step(batch(0, bad_id=True), CFG)
    engine.ppo_step(batch(0), CFG)
    assert engine.trainer.optimizer.num_steps == 1
