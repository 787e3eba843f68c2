"""hybridengine rollout generation (the `hybridengine` provider of bench `generate`).

Each rank generates on the generation view (N = 1; N = 2 with tg = 1, each rank its own prompts, and
with tg = 2, both ranks one batch of twice the prompts):
64 prompts x 128 new tokens per GPU (the peers' workload) and a GRPO-shaped case (16 prompts x
n = 8 samples x 512 new tokens per GPU: decode batch 128, where the issue sets the step-time goal).
Rows: seconds per generate call, total tokens/s over all GPUs, decode step time (the whole decode
iteration: schedule, inputs, graph replay, sampling, bookkeeping), peaks, each with async scheduling
(the default) and without it (case async_scheduling=False, same engine, same run), and the grpo case
with the torch sampler (case sampler=torch; the default on CUDA is the fused one); plus each case's
decode-step floor (weights + the KV bytes of the batch at its mean context / 4.21 TB/s, the HBM copy
bandwidth measured on this machine).
"""

from __future__ import annotations

import os

import torch

from .common import GiB, Ctx, quantiles, random_ids

HBM_FALLBACK_GBPS = 4210.0


def generate(ctx: Ctx) -> None:
    import hybridengine as he

    if not ctx.cuda:
        ctx.rec.not_run("generate", "hybridengine", None, "GPU only")
        return
    only = os.environ.get("HE_BENCH_TG")  # e.g. "2": run only these TP degrees (to split a device call)
    degrees = [int(d) for d in only.split(",")] if only else (1, 2)
    for model in ctx.models:
        for tg in [d for d in degrees if ctx.world % d == 0]:
            _generate_tg(ctx, he, model, tg)


def _generate_tg(ctx: Ctx, he, model: str, tg: int) -> None:
    """One engine at TP degree tg: each TP group generates one batch, tg x the per-GPU workload, so
    every GPU carries the same sequences per GPU as at tg = 1."""
    cfg = he.model_config(model)
    w = ctx.work
    engine = he.HybridEngine(cfg, he.EngineConfig(dtype=torch.bfloat16, device=str(ctx.device), max_model_len=1024,
                                                  max_num_seqs=128 * tg, tp_generation=tg, gpu_memory_utilization=0.85))
    cases = [dict(name="rollout", prompts=w.batch * tg, n=1, new_tokens=w.new_tokens),
             dict(name="grpo", prompts=16 * tg, n=8, new_tokens=512)]
    groups = ctx.world // tg  # TP groups; each generates its own batch
    # Each case with async scheduling (the default) and, as a same-run variant, without it; the grpo
    # case also with the torch sampler (EngineTuning(sampler='torch')) instead of the fused one.
    variants = [(case, mode, "fused") for case in cases for mode in (True, False)]
    variants += [(case, True, "torch") for case in cases if case["name"] == "grpo"]
    with engine.rollout():
        ctx.log(f"  {model} tg={tg}: KV cache {engine.stats['kv_cache_GiB']:.1f} GiB, "
                f"{engine.stats['kv_blocks']} blocks, CUDA graph capture {engine.stats['cuda_graph_capture_s']:.2f} s")
        for case, async_scheduling, sampler in variants:
            _generate_case(ctx, he, engine, model, tg, groups, case, async_scheduling, sampler)
    # The decode-step floor of each case, per GPU: its weight bytes (1/tg of the model) once + its KV bytes
    # (1/tg of the heads) of the TP group's batch at the mean context of the decode phase (prompt + half
    # the new tokens). TP's all-reduces are not in the floor.
    weight_bytes = engine.model.flat_buffer.nbytes()
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    kv_per_token = 2 * cfg.num_hidden_layers * (cfg.num_key_value_heads // tg) * head_dim * 2
    for case in cases:
        batch, ctx_len = case["prompts"] * case["n"], w.prompt + case["new_tokens"] // 2
        floor_s = (weight_bytes + batch * ctx_len * kv_per_token) / (HBM_FALLBACK_GBPS * 1e9)
        ctx.rec.add("decode_step", "floor", model, dict(case=case["name"], tg=tg, batch_per_gpu=batch // tg,
                                                        mean_context=ctx_len, hbm_GBps=HBM_FALLBACK_GBPS,
                                                        weights_GiB=weight_bytes / GiB),
                    "seconds", floor_s)
    del engine


def _generate_case(ctx: Ctx, he, engine, model: str, tg: int, groups: int, case: dict, async_scheduling: bool,
                   sampler: str) -> None:
    """One timed case (warm-up + 3 generate calls) and its rows."""
    w = ctx.work
    engine.config.tuning.async_scheduling = async_scheduling
    engine.config.tuning.sampler = "auto" if sampler == "fused" else sampler
    ids = random_ids(ctx, case["prompts"], w.prompt, engine.vocab_size, seed=11).tolist()
    params = he.SamplingParams(n=case["n"], temperature=1.0, max_tokens=case["new_tokens"], seed=None)
    run = lambda: engine.generate(ids, params)  # noqa: E731
    with ctx.peak() as pm:
        times = ctx.measure(run, warmup=1, repeats=3, desc=f"generate {case['name']} tg={tg}")
    tokens = case["prompts"] * case["n"] * case["new_tokens"]  # one TP group's
    row_case = dict(case=case["name"], tg=tg, samples=case["n"], cuda_graphs=True,
                    batch_per_gpu=case["prompts"] * case["n"] // tg, prompt=w.prompt,
                    new_tokens=case["new_tokens"], async_scheduling=async_scheduling, sampler=sampler)
    ctx.rec.add("generate", "hybridengine", model, row_case, "seconds", times)
    ctx.rec.add("generate", "hybridengine", model, row_case, "tokens_per_s", [groups * tokens / t for t in times])
    ctx.record_peak(pm, "generate", "hybridengine", model, row_case)
    step = engine.stats["decode_s"] / max(1, engine.stats["steps"] - 1)
    ctx.rec.add("decode_step", "hybridengine", model, row_case, "seconds", step)
    ctx.log(f"  generate {model} tg={tg} {case['name']} async={async_scheduling} sampler={sampler}: "
            f"{quantiles(times)[1]:.2f} s, "
            f"{groups * tokens / quantiles(times)[1]:,.0f} tok/s total, decode step {step * 1e3:.2f} ms, "
            f"preemptions {engine.stats['preemptions']}, peak nvml {pm.nvml_gib:.1f} GiB")
