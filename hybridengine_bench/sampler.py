"""The decode step's sampler: `ops.sample_fused` (the Triton kernels) against `rollout.sampler.sample`
(torch: fp32 copy, softmax, exponential noise, divide, argmax, log_softmax, gather), on bf16 logits
[B, V] with Qwen2's vocabulary, temperature 1, unseeded rows (the rollout's case). Floor: one read of
the logits at the run's HBM copy bandwidth. A split sweep at B = 128 (case sweep) checks the plan.
"""

from __future__ import annotations

import torch

from .common import Ctx, quantiles

VOCAB = 152064  # qwen2-7b
BATCHES_GPU = (1, 16, 64, 128, 256)


def sampler(ctx: Ctx) -> None:
    from hybridengine.ops.sample_fused import fused_splits, sample_fused
    from hybridengine.rollout.sampler import sample
    from hybridengine.rollout.sampling_params import SamplingParams

    if not ctx.cuda:
        ctx.rec.not_run("sampler", "hybridengine", None, "GPU only (the CPU runs the kernels in the interpreter)")
        return
    params = SamplingParams(temperature=1.0)
    for B in BATCHES_GPU:
        g = torch.Generator(device=ctx.device).manual_seed(B)
        logits = (torch.randn(B, VOCAB, device=ctx.device, generator=g) * 3).to(torch.bfloat16)
        inv = torch.ones(B, device=ctx.device)
        keys = torch.arange(B, dtype=torch.int64, device=ctx.device) * 7919 + 1
        draws = torch.zeros(B, dtype=torch.int32, device=ctx.device)
        runs = {"hybridengine": lambda: sample_fused(logits, inv, keys, draws),
                "torch_sample": lambda: sample(logits, [params] * B, [None] * B)}
        splits = fused_splits(B, VOCAB, 1024, ctx.device)
        for provider, fn in runs.items():
            times = ctx.measure(fn, warmup=5, repeats=50, desc=f"sampler B={B} {provider}")
            case = dict(batch=B, vocab=VOCAB, dtype="bf16", logits_bytes=2 * B * VOCAB,
                        **({"splits": splits, "block": 1024} if provider == "hybridengine" else {}))
            ctx.rec.add("sampler", provider, None, case, "seconds", times)
            ctx.log(f"sampler B={B} {provider}: {quantiles(times)[1] * 1e6:.1f} us")
        if B == 128:  # the split plan against fixed splits and tile widths
            for s in (1, 2, 4, 8, 16, 32):
                for block in (512, 1024, 2048):
                    times = ctx.measure(lambda: sample_fused(logits, inv, keys, draws, splits=s, block=block),
                                        warmup=3, repeats=20, desc=f"sampler sweep s={s} b={block}")
                    ctx.rec.add("sampler", "hybridengine", None,
                                dict(batch=B, vocab=VOCAB, dtype="bf16", sweep=True, logits_bytes=2 * B * VOCAB,
                                     splits=s, block=block),
                                "seconds", times)
                    ctx.log(f"sampler sweep B=128 splits={s} block={block}: {quantiles(times)[1] * 1e6:.1f} us")
