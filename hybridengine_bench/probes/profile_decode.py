"""Where a decode step of `HybridEngine.generate` goes: host ranges, GPU kernels by category, launch gaps.

    python -m hybridengine_bench.probes.profile_decode --model qwen2.5-1.5b --batch 64 --new-tokens 128 --out DIR

Random weights (no downloads), prompts of 128 random tokens, temperature 1 (the `generate` bench's
rollout case). One warm generate, one timed without the profiler (the honest step time), then one
under torch.profiler with ranges wrapped around the engine's stages from outside (monkeypatching; the
library carries no profiling code). A step runs from one `schedule` call to the next; per decode step:
host time of each range, GPU kernel time by category, GPU busy time (union of kernels and copies) and
the rest of the wall time, which is GPU idle: host work the GPU waits for. Writes DIR/profile_decode.json
and DIR/trace.json.gz (chrome://tracing or ui.perfetto.dev). On CPU (`--device cpu`, e.g. with
`--model tiny-qwen2`) it tests itself: host ranges only. Under torchrun with `--tg 2`, TP generation
(every rank runs the same batch; rank 0 writes).
"""

from __future__ import annotations

import argparse
import bisect
import os
import contextlib
import functools
import gzip
import json
import shutil
import time
from pathlib import Path

import torch

RANGES = ("schedule", "prepare_inputs", "forward", "prefill", "sample", "d2h", "bookkeeping")
CATEGORIES = {  # first match wins; names lower-cased
    "communication": ("nccl", "allreduce", "all_reduce", "allgather", "one_shot", "two_shot", "symm_mem"),
    "attention": ("paged_decode", "exact_decode", "exact_varlen", "prefill", "flash", "attn", "store_kv"),
    "gemm": ("gemm", "nvjet", "cutlass", "sm90", "cublas", "matmul"),
    "sampling": ("sort", "softmax", "exponential", "argmax", "log_softmax", "logsumexp", "cumsum", "scatter",
                 "gather"),
}
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
HBM_GBPS = 4210.0  # as hybridengine_bench/generate.py: the floor's bandwidth when no measured row is at hand


def category(name: str, cat: str) -> str:
    if cat != "kernel":
        return "memcpy/memset"
    low = name.lower()
    return next((c for c, keys in CATEGORIES.items() if any(k in low for k in keys)), "elementwise/other")


@contextlib.contextmanager
def ranges(kinds: list[bool]):
    """record_function ranges around the engine's stages; `kinds` gets is_prefill of each schedule()."""
    import hybridengine.rollout.async_decode as loop
    from hybridengine.rollout.runner import ModelRunner
    from hybridengine.rollout.sampler import Sampler
    from hybridengine.rollout.scheduler import Scheduler

    def wrap(fn, name, after=None):
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            with torch.profiler.record_function(name):
                out = fn(*args, **kwargs)
            if after is not None:
                after(out)
            return out
        return inner

    targets = [(Scheduler, "schedule", lambda b: kinds.append(b.is_prefill)), (ModelRunner, "_stage_decode", None),
               (ModelRunner, "_upload", None), (ModelRunner, "_decode_forward", None), (ModelRunner, "_prefill", None),
               (Sampler, "__call__", None), (loop, "launch", None), (loop.Sampled, "wait", None),
               (loop, "append", None), (loop, "reserve", None)]
    names = ["schedule", "prepare_inputs", "prepare_inputs", "forward", "prefill", "sample", "sample", "d2h",
             "bookkeeping", "bookkeeping"]
    if torch.cuda.is_available():
        targets.append((torch.cuda.CUDAGraph, "replay", None))
        names.append("forward")
    saved = [(obj, attr, getattr(obj, attr)) for obj, attr, _ in targets]
    try:
        for (obj, attr, after), name in zip(targets, names):
            setattr(obj, attr, wrap(getattr(obj, attr), name, after))
        yield
    finally:
        for obj, attr, fn in saved:
            setattr(obj, attr, fn)


def busy(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def analyse(trace: dict, kinds: list[bool]) -> dict:
    """Per-decode-step numbers from a chrome trace (times in us there, ms here)."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    host = [e for e in events if e.get("cat") == "user_annotation" and e["name"] in RANGES]
    gpu = [e for e in events if e.get("cat") in GPU_CATS]
    starts = sorted(e["ts"] for e in host if e["name"] == "schedule")
    if len(starts) != len(kinds):
        raise RuntimeError(f"{len(starts)} schedule ranges in the trace, {len(kinds)} schedule() calls")
    end = max(e["ts"] + e["dur"] for e in host)
    windows = [(s, e) for s, e, prefill in zip(starts, starts[1:] + [end], kinds) if not prefill]
    n = max(len(windows), 1)

    def window(ts: float) -> int | None:
        """Index of the decode step running at host time ts (GPU timestamps share the clock)."""
        i = bisect.bisect_right(windows, (ts, float("inf"))) - 1
        return i if i >= 0 and ts < windows[i][1] else None

    per_range = {name: dict(total_ms=0.0, per_step_ms=0.0, calls=0) for name in RANGES}
    for e in host:
        r = per_range[e["name"]]
        r["total_ms"] += e["dur"] / 1e3
        if window(e["ts"]) is not None:
            r["per_step_ms"] += e["dur"] / 1e3 / n
            r["calls"] += 1
    cats = {c: 0.0 for c in (*CATEGORIES, "elementwise/other", "memcpy/memset")}
    kernels: dict[str, float] = {}
    by_window: dict[int, list[tuple[float, float]]] = {}
    for e in gpu:
        i = window(e["ts"])
        if i is None:
            continue
        cats[category(e["name"], e["cat"])] += e["dur"] / 1e3 / n
        kernels[e["name"]] = kernels.get(e["name"], 0.0) + e["dur"] / n
        by_window.setdefault(i, []).append((e["ts"], min(e["ts"] + e["dur"], windows[i][1])))
    wall = sum(e - s for s, e in windows) / 1e3 / n
    gpu_busy = sum(busy(iv) for iv in by_window.values()) / 1e3 / n
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:15]
    return dict(decode_steps=len(windows), wall_ms_per_step=wall, gpu_busy_ms_per_step=gpu_busy,
                gpu_idle_ms_per_step=wall - gpu_busy, host_ranges=per_range, gpu_ms_per_step=cats,
                top_kernels_us_per_step=[dict(name=k[:120], us=v) for k, v in top])


def main(argv=None) -> dict:
    import hybridengine as he

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen2.5-1.5b")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--no-cuda-graphs", action="store_true", help="see each kernel's host launch (slower steps)")
    ap.add_argument("--sync", action="store_true",
                    help="async_scheduling off: each step waits for the last one's tokens")
    ap.add_argument("--kernel-configs", default=None,
                    help="instead of profiling, time the decode step with each paged-decode launch config, "
                         "'BLOCK_N:warps:stages:dot16bit[:prefetch],...' (e.g. 32:4:4:1,64:8:1:1:1), one rollout each")
    ap.add_argument("--tg", type=int, default=1, help="TP degree of generation (under torchrun)")
    ap.add_argument("--exact", action="store_true", help="EngineConfig(exact_logprobs=True): the exact mode's kernels")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    cuda = args.device.startswith("cuda")
    rank = 0
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl" if cuda else "gloo")
        rank = torch.distributed.get_rank()
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
            args.device = f"cuda:{torch.cuda.current_device()}"
    cfg = he.model_config(args.model)
    engine = he.HybridEngine(cfg, he.EngineConfig(
        dtype=torch.bfloat16 if cuda else torch.float32, device=args.device, max_model_len=1024,
        max_num_seqs=max(128, args.batch), tp_generation=args.tg,
        gpu_memory_utilization=0.85, cuda_graphs=not args.no_cuda_graphs, exact_logprobs=args.exact,
        tuning=he.EngineTuning(async_scheduling=not args.sync)))
    gen = torch.Generator().manual_seed(11 * 1000)  # hybridengine_bench.common.random_ids(seed=11) on rank 0
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.prompt), generator=gen).tolist()
    params = he.SamplingParams(temperature=1.0, top_p=1.0, top_k=-1, max_tokens=args.new_tokens, seed=None)
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    args.out.mkdir(parents=True, exist_ok=True)
    if args.kernel_configs:
        return _time_kernel_configs(engine, ids, params, args)
    kinds: list[bool] = []
    with engine.rollout():
        engine.generate(ids, params)  # warm-up: Triton autotuning, allocator, caches
        t0 = time.perf_counter()
        engine.generate(ids, params)
        plain = dict(generate_s=time.perf_counter() - t0,
                     step_ms=engine.stats["decode_s"] / max(1, engine.stats["steps"] - 1) * 1e3)
        with ranges(kinds), torch.profiler.profile(activities=acts) as prof:
            engine.generate(ids, params)
            if cuda:
                torch.cuda.synchronize()
    if rank != 0:
        return {}
    raw = args.out / "trace.json"
    prof.export_chrome_trace(str(raw))
    trace = json.loads(raw.read_text())
    with open(raw, "rb") as src, gzip.open(args.out / "trace.json.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    raw.unlink()
    m = engine.model_config
    kv_token = (2 * m.num_hidden_layers * m.num_key_value_heads // args.tg * m.head_dim
                * engine.model.flat_buffer.data.element_size())
    floor_ms = (engine.model.flat_buffer.nbytes() + args.batch * (args.prompt + args.new_tokens // 2) * kv_token) \
        / (HBM_GBPS * 1e9) * 1e3
    result = dict(model=args.model, batch=args.batch, prompt=args.prompt, new_tokens=args.new_tokens, tg=args.tg,
                  exact=args.exact, device=torch.cuda.get_device_name() if cuda else "cpu", torch=torch.__version__,
                  cuda_graphs=cuda and not args.no_cuda_graphs, async_scheduling=not args.sync, unprofiled=plain,
                  floor_ms=floor_ms,
                  **analyse(trace, kinds))
    (args.out / "profile_decode.json").write_text(json.dumps(result, indent=1))
    print(f"{args.model} B={args.batch} on {result['device']}: unprofiled step {plain['step_ms']:.3f} ms "
          f"(floor {floor_ms:.3f} ms, x{plain['step_ms'] / floor_ms:.2f}); profiled: {result['decode_steps']} decode "
          f"steps, wall {result['wall_ms_per_step']:.3f} ms, GPU busy {result['gpu_busy_ms_per_step']:.3f} ms, "
          f"GPU idle {result['gpu_idle_ms_per_step']:.3f} ms per step")
    print(f"{'host range':<16}{'total ms':>10}{'ms/step':>10}{'calls':>7}")
    for name, r in result["host_ranges"].items():
        print(f"{name:<16}{r['total_ms']:>10.2f}{r['per_step_ms']:>10.3f}{r['calls']:>7}")
    print(f"{'GPU category':<20}{'ms/step':>10}")
    for name, ms in result["gpu_ms_per_step"].items():
        print(f"{name:<20}{ms:>10.3f}")
    for k in result["top_kernels_us_per_step"]:
        print(f"  {k['us']:9.1f} us  {k['name']}")
    return result


def _time_kernel_configs(engine, ids, params, args) -> dict:
    """The unprofiled decode step with each paged-decode launch config (patched into
    `hybridengine.ops.paged_attention._decode_config` from outside; a rollout each, so its CUDA graphs capture
    that config): the real decode's contexts, block layout and L2 state, which the kernel sweep's
    synthetic shapes only approximate."""
    from hybridengine.ops import paged_attention

    original = paged_attention._decode_config
    results = []
    try:
        for spec in args.kernel_configs.split(","):
            n, w, s, dot, *prefetch = (int(x) for x in spec.split(":"))
            config = dict(BLOCK_N=n, num_warps=w, num_stages=s, DOT_16BIT=bool(dot),
                          PREFETCH=bool(prefetch and prefetch[0]))
            paged_attention._decode_config = (lambda device, head_dim, split=False, programs=None, config=config:
                                              dict(config))
            with engine.rollout():
                engine.generate(ids, params)  # warm-up and capture
                steps = []
                for _ in range(2):
                    engine.generate(ids, params)
                    steps.append(engine.stats["decode_s"] / max(1, engine.stats["steps"] - 1) * 1e3)
            results.append(dict(config=config, step_ms=min(steps), steps_ms=steps))
            print(f"{args.model} B={args.batch} {config}: decode step {min(steps):.3f} ms ({steps})")
    finally:
        paged_attention._decode_config = original
    result = dict(model=args.model, batch=args.batch, prompt=args.prompt, new_tokens=args.new_tokens,
                  device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", kernel_configs=results)
    (args.out / "decode_kernel_configs.json").write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
