"""A GRPO soak: the whole step repeated for minutes on shapes that change every iteration, recording each
step's time and memory, to see whether device memory and step time settle or drift.

Each iteration (GPU): 32 prompts of random tokens, each prompt's length drawn from 32-160, n = 4 samples,
max_tokens drawn from 64-256 (temperature 1, no stop tokens: every response is max_tokens long), random
0/1 rewards and group-normalised advantages; then the rollout (`engine.rollout()` + `engine.generate`),
`engine.log_probs`, `engine.ppo_step` and `engine.prepare_rollout()`, as hybridengine_bench/e2e.py. The draws are
seeded per step (--seed), so every run sees the same sequence of shapes. CPU (the harness check): a tiny
model, 2 prompts of 4-12 tokens x 2 samples x 2-6 tokens.

    python -m hybridengine_bench soak --minutes 8                    # qwen2.5-1.5b on one GPU until the budget is spent
    python -m hybridengine_bench soak --minutes 4 --alloc-conf default --alloc-conf expandable_segments:True
    python -m hybridengine_bench soak --cpu --steps 3                # tiny-qwen2 on CPU

`--alloc-conf` runs one child process per value with PYTORCH_CUDA_ALLOC_CONF set ('default': unset),
one after the other, under one run id: the allocator reads the variable once, at CUDA initialisation, so
it cannot change inside a process. `--minutes` and `--steps` apply to each child. `--fixed-shapes` pads
every sequence of the batch handed to `log_probs` / `ppo_step` to one length, the longest prompt +
response the workload allows rounded up to 64 (padding masked out, so the loss is the same), so the
training micro-batches have the same shapes at every step; the rollout is unchanged.

Rows (bench `soak`, provider `hybridengine`, metric `seconds`), appended as they come (a run cut off
keeps its steps): one per step, value the step's wall seconds, case the variant (`alloc_conf`,
`fixed_shapes`), the step's shapes (`step`, `max_tokens`, `tokens`, `trained_tokens`, ...) and its
readings: `phases` (rollout, log_probs, update seconds), `rollout` (the engine's stats of the rollout:
KV cache size, CUDA graph capture and decode seconds, preemptions), `memory_GiB` (NVML device used at
the step's end and its peak over the step, sampled every 20 ms; torch allocated and reserved at the
end and their peaks over the step; null where not measured) and `allocator` (segments, cudaMalloc
calls in the step, retries so far). Then one summary row per run (case `summary`): value the median
step time after warm-up (p20/p80), case the swing and drift of `hybridengine_bench.report.soak.summarize`.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from .common import GiB, REPO, RESULTS, Recorder, _nvml_handle, new_run_id, release_memory
from .report.soak import BENCH, summarize

PROVIDER = "hybridengine"
SHAPE_MULTIPLE = 64
"""--fixed-shapes pads every training sequence to the workload's longest, rounded up to this."""
NVML_INTERVAL_S = 0.02
ROLLOUT_STATS = ("switch_to_generation_s", "cuda_graph_capture_s", "decode_s", "preemptions", "kv_cache_GiB",
                 "kv_blocks")
"""Entries of `engine.stats` each step row keeps (case.rollout): what the rollout sized and spent."""


@dataclass(kw_only=True, slots=True, frozen=True)
class SoakWork:
    """One iteration's workload: `prompts` x `n` samples, lengths drawn per prompt, max_tokens per iteration."""

    prompts: int
    n: int
    prompt_len: tuple[int, int]
    """Inclusive range of each prompt's length."""
    max_tokens: tuple[int, int]
    """Inclusive range of the iteration's max_tokens."""

    @property
    def max_len(self) -> int:
        return self.prompt_len[1] + self.max_tokens[1]

    @property
    def padded_len(self) -> int:
        return -(-self.max_len // SHAPE_MULTIPLE) * SHAPE_MULTIPLE


GPU_SOAK = SoakWork(prompts=32, n=4, prompt_len=(32, 160), max_tokens=(64, 256))
CPU_SOAK = SoakWork(prompts=2, n=2, prompt_len=(4, 12), max_tokens=(2, 6))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hybridengine_bench soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=8.0,
                   help="time budget of one run from the model's set-up (default 8); no step starts that would "
                   "end past it")
    p.add_argument("--steps", type=int, default=None, help="at most this many steps")
    p.add_argument("--model", default=None, help="embedded model config (default qwen2.5-1.5b; tiny-qwen2 on CPU)")
    p.add_argument("--seed", type=int, default=0, help="seed of the shapes, prompts and rewards")
    p.add_argument("--fixed-shapes", action="store_true",
                   help="pad the training batch to one length every step (see above)")
    p.add_argument("--alloc-conf", action="append", default=None, metavar="CONF",
                   help="PYTORCH_CUDA_ALLOC_CONF of a run in its own process ('default': unset); repeat to compare")
    p.add_argument("--out", default=os.environ.get("HE_BENCH_RESULTS", str(RESULTS)),
                   help="rows file to append to "
                        "(default $HE_BENCH_RESULTS or hybridengine_bench/results/results.jsonl)")
    p.add_argument("--cpu", action="store_true", help="run on CPU even where CUDA is available")
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    if args.minutes <= 0:
        raise SystemExit(f"--minutes must be > 0, got {args.minutes}")
    if args.steps is not None and args.steps < 1:
        raise SystemExit(f"--steps must be >= 1, got {args.steps}")
    os.environ.setdefault("HE_BENCH_RUN_ID", new_run_id())
    if args.alloc_conf:
        raise SystemExit(run_children(args))
    soak(args)


def run_children(args) -> int:
    """One `python -m hybridengine_bench.soak` per --alloc-conf value, in turn; the first nonzero exit status
    (0 if none)."""
    common = ["--minutes", str(args.minutes), "--seed", str(args.seed), "--out", args.out,
              *(["--steps", str(args.steps)] if args.steps else []), *(["--model", args.model] if args.model else []),
              *(["--fixed-shapes"] if args.fixed_shapes else []), *(["--cpu"] if args.cpu else [])]
    status = 0
    for conf in args.alloc_conf:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        if conf not in ("", "default"):
            env["PYTORCH_CUDA_ALLOC_CONF"] = conf
        tqdm.write(f"soak: PYTORCH_CUDA_ALLOC_CONF={env.get('PYTORCH_CUDA_ALLOC_CONF', '(unset)')}")
        code = subprocess.run([sys.executable, "-m", "hybridengine_bench.soak", *common], env=env).returncode
        if code:
            tqdm.write(f"soak: the run with alloc conf {conf!r} exited with status {code}")
            status = status or code
    return status


class NvmlSampler:
    """The device's used memory (NVML) now and its peak since the last `take`, sampled on a thread; None
    throughout where NVML is unavailable (no pynvml, no driver, or a CPU run)."""

    def __init__(self, device: torch.device):
        self._handle, self._peak = None, 0
        self._stop = threading.Event()
        if device.type != "cuda":
            return
        try:
            self._handle = _nvml_handle(device)
            self._peak = self._used()
        except Exception as e:  # noqa: BLE001 - NVML is optional: the torch readings stand
            tqdm.write(f"soak: NVML unavailable ({type(e).__name__}: {e}); the nvml fields stay null")
            self._handle = None
            return
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _used(self) -> int:
        import pynvml

        return pynvml.nvmlDeviceGetMemoryInfo(self._handle).used

    def _sample(self) -> None:
        try:
            while not self._stop.wait(NVML_INTERVAL_S):
                self._peak = max(self._peak, self._used())
        except Exception as e:  # noqa: BLE001 - stop sampling; take() still reads the current value
            tqdm.write(f"soak: the NVML sampler stopped ({type(e).__name__}: {e})")

    def take(self) -> tuple[float | None, float | None]:
        """(used now, peak since the last take) in GiB; the peak restarts from now."""
        if self._handle is None:
            return None, None
        try:
            now = self._used()
        except Exception:  # noqa: BLE001
            return None, None
        peak, self._peak = max(self._peak, now), now
        return now / GiB, peak / GiB

    def close(self) -> None:
        self._stop.set()


def torch_memory(device: torch.device) -> tuple[dict, dict]:
    """(GiB: allocated and reserved now, their peaks since the last call; allocator counters: segments now,
    cudaMalloc calls and allocation retries so far), then resets the peaks. All null off CUDA."""
    keys = ("allocated", "reserved", "max_allocated", "max_reserved")
    if device.type != "cuda":
        return dict.fromkeys(keys), dict(segments=None, cuda_mallocs=None, alloc_retries=None)
    s = torch.cuda.memory_stats(device)
    gib = dict(zip(keys, (s.get(k, 0) / GiB for k in ("allocated_bytes.all.current", "reserved_bytes.all.current",
                                                       "allocated_bytes.all.peak", "reserved_bytes.all.peak"))))
    counts = dict(segments=s.get("segment.all.current", 0), cuda_mallocs=s.get("num_device_alloc", 0),
                  alloc_retries=s.get("num_alloc_retries", 0))
    torch.cuda.reset_peak_memory_stats(device)
    return gib, counts


def draw(work: SoakWork, vocab: int, seed: int, step: int) -> tuple[list[list[int]], int]:
    """Step `step`'s prompts and max_tokens: the same for a (seed, step) in every run."""
    rng = random.Random(f"soak-{seed}-{step}")
    max_tokens = rng.randint(*work.max_tokens)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(*work.prompt_len))] for _ in range(work.prompts)]
    return prompts, max_tokens


def training_batch(outs, rewards: torch.Tensor, n: int, pad_to: int | None):
    """(ids, response masks, advantages per sequence) of the rollout; with `pad_to`, every sequence padded
    to that many tokens with token 0 and mask 0 (no loss, and each sequence attends only to itself)."""
    from hybridengine.train.advantages import grpo_advantages

    ids, masks = [], []
    for o in outs:
        for s in o.outputs:
            p, r = o.prompt_token_ids, s.token_ids
            pad = 0 if pad_to is None else pad_to - len(p) - len(r)
            assert pad >= 0, (pad_to, len(p), len(r))
            ids.append(torch.tensor(p + r + [0] * pad))
            masks.append(torch.tensor([0.0] * (len(p) - 1) + [1.0] * len(r) + [0.0] * pad))
    adv = grpo_advantages(rewards, n).tolist()
    return ids, masks, [a * m for a, m in zip(adv, masks)]


def soak(args) -> None:
    """One run in this process: the loop until the budget or --steps, then the summary row."""
    start = time.monotonic()
    deadline = start + 60 * args.minutes
    import hybridengine as he

    cuda = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    work = GPU_SOAK if cuda else CPU_SOAK
    model = args.model or ("qwen2.5-1.5b" if cuda else "tiny-qwen2")
    rec = Recorder(path=Path(args.out), run_id=os.environ["HE_BENCH_RUN_ID"],
                   gpu=torch.cuda.get_device_name(device) if cuda else "cpu", num_gpus=1 if cuda else 0)
    variant = dict(alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or "default", fixed_shapes=args.fixed_shapes)
    workload = dict(prompts=work.prompts, samples=work.n, prompt_len=list(work.prompt_len),
                    max_tokens_range=list(work.max_tokens), seed=args.seed)
    tqdm.write(f"soak run {rec.run_id}: {model} on {rec.gpu}, {variant}, budget {args.minutes:g} min"
               + (f", at most {args.steps} steps" if args.steps else "") + f", commit {rec.commit} -> {args.out}")

    cfg = he.model_config(model)
    engine = he.HybridEngine(cfg, he.EngineConfig(
        dtype=torch.bfloat16 if cuda else torch.float32, device=str(device), max_model_len=work.max_len,
        max_num_seqs=work.prompts * work.n, gpu_memory_utilization=0.85, seed=args.seed))
    ppo = he.PPOConfig(lr=1e-6, clip_low=0.2, clip_high=0.28, micro_batch_tokens=16384)
    pad_to = work.padded_len if args.fixed_shapes else None
    nvml = NvmlSampler(device)
    mallocs = [torch_memory(device)[1]["cuda_mallocs"]]  # and the peaks count from here

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    def step(index: int) -> dict:
        prompts, max_tokens = draw(work, cfg.vocab_size, args.seed, index)
        sync()
        t0 = time.perf_counter()
        with engine.rollout():
            outs = engine.generate(prompts, he.SamplingParams(n=work.n, temperature=1.0, max_tokens=max_tokens))
        sync()
        t1 = time.perf_counter()
        g = torch.Generator().manual_seed(args.seed * 1_000_003 + index)
        rewards = torch.randint(0, 2, (work.prompts * work.n,), generator=g).float()
        ids, masks, adv = training_batch(outs, rewards, work.n, pad_to)
        old = engine.log_probs(he.PPOBatch(input_ids=ids)).float().cpu()  # one copy, not one per sequence
        old = [old[b, :len(ids[b]) - 1] for b in range(len(ids))]
        t2 = time.perf_counter()
        engine.ppo_step(he.PPOBatch(input_ids=ids, response_mask=masks, old_logprobs=old, advantages=adv), ppo)
        engine.prepare_rollout()
        sync()
        t3 = time.perf_counter()
        used, used_peak = nvml.take()
        mem, counts = torch_memory(device)
        if counts["cuda_mallocs"] is not None:  # cumulative -> this step's
            counts["cuda_mallocs"], mallocs[0] = counts["cuda_mallocs"] - mallocs[0], counts["cuda_mallocs"]
        response = sum(len(s.token_ids) for o in outs for s in o.outputs)
        prompt = sum(len(o.prompt_token_ids) * len(o.outputs) for o in outs)
        return dict(step=index, max_tokens=max_tokens, tokens=prompt + response, response_tokens=response,
                    trained_tokens=sum(len(t) for t in ids), seconds=t3 - t0,
                    phases=dict(rollout=t1 - t0, log_probs=t2 - t1, update=t3 - t2),
                    rollout={k: engine.stats.get(k) for k in ROLLOUT_STATS},
                    memory_GiB=dict(nvml_used=used, nvml_peak=used_peak, **mem), allocator=counts)

    rows, last = [], None
    bar = tqdm(total=args.steps, desc=f"soak {variant['alloc_conf']}", unit="step", mininterval=10)
    try:
        while args.steps is None or len(rows) < args.steps:
            if last is not None and time.monotonic() + 1.2 * last > deadline:
                break
            try:
                s = step(len(rows))
            except Exception as e:  # noqa: BLE001 - keep the steps so far and their summary
                tqdm.write(traceback.format_exc())
                rec.not_run(BENCH, PROVIDER, model, f"failed at step {len(rows)}: {type(e).__name__}: {str(e)[:300]}",
                            **variant, **workload)
                break
            last = s.pop("seconds")
            rows.append(rec.add(BENCH, PROVIDER, model, {**variant, **workload, **s}, "seconds", last))
            mem = s["memory_GiB"]
            left = max(0.0, deadline - time.monotonic()) / 60
            bar.set_postfix_str(f"{last:.2f} s/step, nvml {_gib(mem['nvml_peak'])}, reserved "
                                f"{_gib(mem['max_reserved'])}, {left:.1f} min left", refresh=False)
            bar.update()
    finally:
        bar.close()
        nvml.close()
    summary = summarize(rows)
    if summary is None:
        rec.not_run(BENCH, PROVIDER, model, f"summary: {len(rows)} steps, too few after warm-up", **variant, **workload,
                    summary=True)
    else:
        times = summary.pop("step_seconds")
        row = rec.add(BENCH, PROVIDER, model, {**variant, **workload, "summary": True, **summary,
                                               "minutes": round((time.monotonic() - start) / 60, 2)}, "seconds", times)
        swing = summary["swing_GiB"]
        tqdm.write(f"soak {variant}: {summary['steps']} steps ({summary['warmup_steps']} warm-up), median "
                   f"{row['value']:.2f} s/step; swing NVML peak ±{_gib(swing['nvml_peak'])}, "
                   f"reserved peak ±{_gib(swing['max_reserved'])}; step-time drift {summary['drift']:.3f}, per token "
                   f"{summary['drift_per_token']:.3f}")
    del engine
    release_memory()


def _gib(x: float | None) -> str:
    return "–" if x is None else f"{x:.2f} GiB"


if __name__ == "__main__":
    main()
