"""Probe: where a decode step's time goes through `engine.step()` and through `generate`.

    python -m hybridengine_bench.probes.probe_request_step [--models M ...]
    (CUDA; on CPU the tiny model, a harness check)

`step()` and `generate` both run `RolloutSession.step` (async decode: step k+1 is launched before step k's
tokens are read); `step()` adds the outputs of the requests that progressed. If the loop overlaps host and
device, the outputs' host time hides behind the step in flight and only `_Sampled.wait` shrinks. This probe
times, per decode step of 256 requests (all running), the whole iteration, `RolloutSession.step`, the wait for
the step's tokens inside it, the outputs, and the garbage collector's pauses, for `generate` and for `step()`
with delta outputs.
Rows (JSONL): hybridengine_bench/results/probe_request_step.jsonl.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import statistics
import time
from pathlib import Path

import torch

from hybridengine_bench.common import append_jsonl


class _Timers:
    """Accumulates seconds per name within one step; `gc` pauses come from gc.callbacks."""

    def __init__(self):
        self.now: dict[str, float] = {}
        self._gc_t0 = 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase, info):
        if phase == "start":
            self._gc_t0 = time.perf_counter()
        else:
            self.add("gc", time.perf_counter() - self._gc_t0)
            if info.get("generation") == 2:
                self.add("gc_full_count", 1)

    def add(self, name: str, dt: float) -> None:
        self.now[name] = self.now.get(name, 0.0) + dt

    def take(self) -> dict[str, float]:
        out, self.now = self.now, {}
        return out

    def close(self):
        gc.callbacks.remove(self._on_gc)


def _wrap(owner, name: str, timers: _Timers, key: str):
    fn = getattr(owner, name)

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            timers.add(key, time.perf_counter() - t0)

    setattr(owner, name, timed)
    return fn


def _summary(steps: list[dict[str, float]]) -> dict[str, float]:
    keys = sorted({k for s in steps for k in s})
    return {k: statistics.median([s.get(k, 0.0) for s in steps]) for k in keys} | {
        f"{k}_mean": statistics.fmean([s.get(k, 0.0) for s in steps]) for k in keys}


def main(argv: list[str] | None = None) -> None:
    import hybridengine as he
    from hybridengine.rollout import async_decode, requests

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=["qwen2.5-1.5b", "qwen2-7b"])
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "probe_request_step.jsonl"))
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    models = args.models if cuda else ["tiny-qwen2"]
    seqs, prompt_len, new_tokens = (256, 128, 256) if cuda else (16, 8, 24)
    meta = dict(gpu=torch.cuda.get_device_name() if cuda else "cpu", torch=torch.__version__,
                commit=os.environ.get("HE_COMMIT", "unknown"), run_id=os.environ.get("HE_BENCH_RUN_ID", "probe"),
                seqs=seqs, prompt=prompt_len, new_tokens=new_tokens, gc_frozen_at_start=gc.get_freeze_count())
    timers = _Timers()
    originals = [(requests.RolloutSession, "step", _wrap(requests.RolloutSession, "step", timers, "session_step")),
                 (async_decode.Sampled, "wait", _wrap(async_decode.Sampled, "wait", timers, "wait")),
                 (requests.Request, "output", _wrap(requests.Request, "output", timers, "outputs"))]
    rows = []
    try:
        for model in models:
            engine = he.HybridEngine(he.model_config(model), he.EngineConfig(
                dtype=torch.bfloat16 if cuda else torch.float32, device="cuda" if cuda else "cpu",
                gpu_memory_utilization=0.85, max_model_len=1024 if cuda else 64, max_num_seqs=seqs,
                max_num_batched_tokens=max(16384, seqs * prompt_len)))
            g = torch.Generator().manual_seed(0)
            prompts = torch.randint(0, engine.vocab_size, (seqs, prompt_len), generator=g).tolist()
            params = he.SamplingParams(temperature=1.0, max_tokens=new_tokens)
            with engine.rollout():
                meta_model = dict(meta, model=model, gc_frozen_in_rollout=gc.get_freeze_count())
                for rep in range(3):
                    for api in ("generate", "step"):
                        per_step = []
                        if api == "generate":  # generate's own loop, each iteration timed
                            session = engine._session
                            reqs = [session.admit(p, params) for p in prompts]
                            while not all(r.finished for r in reqs):
                                timers.take()
                                t0 = time.perf_counter()
                                session.step()
                                per_step.append(timers.take() | dict(total=time.perf_counter() - t0,
                                                                     n=session.num_scheduled))
                            [r.output() for r in reqs]
                        else:
                            delta = dataclasses.replace(params, output_kind="delta")
                            for i, p in enumerate(prompts):
                                engine.add_request(f"{rep}-{i}", p, delta)
                            while engine.has_unfinished_requests():
                                timers.take()
                                t0 = time.perf_counter()
                                outs = engine.step()
                                per_step.append(timers.take() | dict(total=time.perf_counter() - t0, n=len(outs)))
                        steady = [s for s in per_step[3:-3] if s["n"] == seqs]
                        if rep == 0 or not steady:
                            continue
                        row = dict(meta_model, api=api, rep=rep, steps=len(steady), **_summary(steady))
                        rows.append(row)
                        print(f"{model} {api}: " + ", ".join(f"{k} {row[k] * 1e3:.3f} ms" for k in
                                                             ("total", "session_step", "wait", "outputs", "gc")
                                                             if k in row)
                              + f", full collections {row.get('gc_full_count_mean', 0) * len(steady):.0f}")
            del engine
            if cuda:
                torch.cuda.empty_cache()
    finally:
        for owner, name, fn in originals:
            setattr(owner, name, fn)
        timers.close()
    if cuda:
        append_jsonl(args.out, rows)


if __name__ == "__main__":
    main()
