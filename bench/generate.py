"""hybridengine rollout generation (the `hybridengine` provider of bench `generate`).

Each rank generates for its own prompts on the generation view (N = 1, or N = 2 with tg = 1):
64 prompts x 128 new tokens per GPU (the peers' workload) and a GRPO-shaped case (16 prompts x
n = 8 samples x 512 new tokens per GPU: decode batch 128, where the issue sets the step-time goal).
Rows: seconds per generate call, total tokens/s over all GPUs, decode step time (the whole decode
iteration: schedule, inputs, graph replay, sampling, bookkeeping), peaks; plus each case's
decode-step floor (weights + the KV bytes of the batch at its mean context / 4.21 TB/s, the HBM copy
bandwidth measured on this machine).
"""

from __future__ import annotations

import torch

from .common import GiB, Ctx, quantiles, random_ids, record_generate

HBM_FALLBACK_GBPS = 4210.0


def generate(ctx: Ctx) -> None:
    import hybridengine as he

    if not ctx.cuda:
        ctx.rec.not_run("generate", "hybridengine", None, "GPU only")
        return
    for model in ctx.models:
        cfg = he.model_config(model)
        engine = he.HybridEngine(cfg, he.EngineConfig(dtype=torch.bfloat16, device=str(ctx.device), max_model_len=1024,
                                                      max_num_seqs=128, gpu_memory_utilization=0.85))
        w = ctx.work
        cases = [dict(name="rollout", prompts=w.batch, n=1, new_tokens=w.new_tokens),
                 dict(name="grpo", prompts=16, n=8, new_tokens=512)]
        with engine.rollout():
            ctx.log(f"  {model}: KV cache {engine.stats['kv_cache_GiB']:.1f} GiB, {engine.stats['kv_blocks']} blocks, "
                    f"CUDA graph capture {engine.stats['cuda_graph_capture_s']:.2f} s")
            for case in cases:
                ids = random_ids(ctx, case["prompts"], w.prompt, cfg.vocab_size, seed=11).tolist()
                params = he.SamplingParams(n=case["n"], temperature=1.0, max_tokens=case["new_tokens"], seed=None)
                run = lambda: engine.generate(ids, params)  # noqa: E731
                with ctx.peak() as pm:
                    times = ctx.measure(run, warmup=1, repeats=3, desc=f"generate {case['name']}")
                tokens = case["prompts"] * case["n"] * case["new_tokens"]
                row_case = dict(case=case["name"], tg=1, samples=case["n"], cuda_graphs=True,
                                batch_per_gpu=case["prompts"] * case["n"], prompt=w.prompt, new_tokens=case["new_tokens"])
                ctx.rec.add("generate", "hybridengine", model, row_case, "seconds", times)
                ctx.rec.add("generate", "hybridengine", model, row_case, "tokens_per_s",
                            [ctx.world * tokens / t for t in times])
                ctx.record_peak(pm, "generate", "hybridengine", model, row_case)
                step = engine.stats["decode_s"] / max(1, engine.stats["steps"] - 1)
                ctx.rec.add("decode_step", "hybridengine", model, row_case, "seconds", step)
                ctx.log(f"  generate {model} {case['name']}: {quantiles(times)[1]:.2f} s, "
                        f"{ctx.world * tokens / quantiles(times)[1]:,.0f} tok/s total, decode step {step * 1e3:.2f} ms, "
                        f"preemptions {engine.stats['preemptions']}, peak nvml {pm.nvml_gib:.1f} GiB")
        # The decode-step floor of each case: every weight byte once + the KV bytes of its batch at the
        # mean context of the decode phase (prompt + half the new tokens).
        weight_bytes = engine.model.flat_buffer.nbytes()
        kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 2
        for case in cases:
            batch, ctx_len = case["prompts"] * case["n"], w.prompt + case["new_tokens"] // 2
            floor_s = (weight_bytes + batch * ctx_len * kv_per_token) / (HBM_FALLBACK_GBPS * 1e9)
            ctx.rec.add("decode_step", "floor", model, dict(case=case["name"], batch_per_gpu=batch, mean_context=ctx_len,
                                                            hbm_GBps=HBM_FALLBACK_GBPS, weights_GiB=weight_bytes / GiB),
                        "seconds", floor_s)
        del engine
