"""Where a training step of `HybridEngine.ppo_step` goes: GPU time by category, GPU busy vs wall, peak memory.

    python -m hybridengine_bench.probes.profile_train --model qwen2.5-1.5b --seqs 4 --seq-len 1024 --out DIR

Random weights (no downloads), one rank, the train_step bench's batch (random tokens, every target
trained on), with activation checkpointing on and off. Per setting: two warm-up steps, the median
of three unprofiled steps, then one step under torch.profiler: GPU kernel time by category
(GEMM, attention, the fused LM-head loss, AdamW, copies, elementwise), GPU busy time (union of
kernels) against the step's wall time, the top kernels, and the torch peak. Writes
DIR/profile_train.json. On CPU (`--device cpu --model tiny-qwen2`) it tests itself (host time only).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from .profile_decode import busy

CATEGORIES = {  # first match wins; names lower-cased
    "loss (fused LM head)": ("logit_stats", "logit_grad"),
    "attention": ("flash", "attn", "fmha", "sdpa", "efficient", "cudnn"),
    "gemm": ("gemm", "nvjet", "cutlass", "sm90", "cublas", "matmul"),
    "adamw": ("adamw",),
    "nccl": ("nccl",),
    "copy": ("copy", "cat", "index", "scatter", "gather"),
}


def category(name: str, cat: str) -> str:
    if cat != "kernel":
        return "memcpy/memset"
    low = name.lower()
    return next((c for c, keys in CATEGORIES.items() if any(k in low for k in keys)), "elementwise/other")


def main(argv=None) -> dict:
    import hybridengine as he

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen2.5-1.5b")
    ap.add_argument("--seqs", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    cuda = args.device.startswith("cuda")
    cfg = he.model_config(args.model)
    engine = he.HybridEngine(cfg, he.EngineConfig(dtype=torch.bfloat16 if cuda else torch.float32, device=args.device))
    g = torch.Generator().manual_seed(100)
    n = args.seq_len
    batch = he.PPOBatch(input_ids=[torch.randint(0, cfg.vocab_size, (n,), generator=g) for _ in range(args.seqs)],
                        response_mask=[torch.ones(n - 1) for _ in range(args.seqs)],
                        old_logprobs=[-5 + 0.1 * torch.randn(n - 1, generator=g) for _ in range(args.seqs)],
                        advantages=[torch.randn(n - 1, generator=g) for _ in range(args.seqs)])
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    args.out.mkdir(parents=True, exist_ok=True)
    result = dict(model=args.model, seqs=args.seqs, seq_len=n, device=torch.cuda.get_device_name() if cuda else "cpu",
                  torch=torch.__version__, settings={})
    for checkpointing in (True, False):
        ppo = he.PPOConfig(micro_batch_tokens=args.seqs * n, lr=1e-6, activation_checkpointing=checkpointing)
        for _ in range(2):
            engine.ppo_step(batch, ppo)
        times = []
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        for _ in range(3):
            sync()
            t0 = time.perf_counter()
            engine.ppo_step(batch, ppo)
            sync()
            times.append(time.perf_counter() - t0)
        step_s = sorted(times)[1]
        with torch.profiler.profile(activities=acts) as prof:
            sync()
            engine.ppo_step(batch, ppo)
            sync()
        events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA] if cuda else []
        cats: dict[str, float] = {}
        kernels: dict[str, float] = {}
        intervals = []
        for e in events:
            kind = "kernel" if "memcpy" not in e.name.lower() and "memset" not in e.name.lower() else "gpu_memcpy"
            ms = e.time_range.elapsed_us() / 1e3
            cats[category(e.name, kind)] = cats.get(category(e.name, kind), 0.0) + ms
            kernels[e.name] = kernels.get(e.name, 0.0) + ms
            intervals.append((e.time_range.start, e.time_range.end))
        gpu_busy_ms = busy(intervals) / 1e3 if intervals else 0.0
        setting = dict(step_s=step_s, tokens_per_s=args.seqs * n / step_s, gpu_busy_ms=gpu_busy_ms,
                       gpu_ms=dict(sorted(cats.items(), key=lambda kv: -kv[1])),
                       top_kernels_ms=[dict(name=k[:120], ms=v) for k, v in
                                       sorted(kernels.items(), key=lambda kv: -kv[1])[:12]],
                       peak_GiB=torch.cuda.max_memory_allocated() / 2**30 if cuda else None)
        key = "activation_checkpointing_on" if checkpointing else "activation_checkpointing_off"
        result["settings"][key] = setting
        print(f"{args.model} {args.seqs} x {n} tokens, {key}: {step_s * 1e3:.1f} ms/step "
              f"({setting['tokens_per_s']:,.0f} tok/s), GPU busy {gpu_busy_ms:.1f} ms, peak {setting['peak_GiB']} GiB")
        for name, ms in setting["gpu_ms"].items():
            print(f"  {name:<22}{ms:9.2f} ms")
        for k in setting["top_kernels_ms"]:
            print(f"    {k['ms']:8.2f} ms  {k['name']}")
    (args.out / "profile_train.json").write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
