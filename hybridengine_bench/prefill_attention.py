"""Prefill attention (`prefill_attention.prefill_attention_triton` over dense packed k/v, as the rollout's prefill
calls it) against torch's varlen flash attention and SDPA, with a launch sweep of the Triton kernel.

Qwen2-7B heads (28 q, 4 kv, head_dim 128), bf16, causal, packed sequences of one length per case,
16k tokens each: (B, L) in CASES_GPU. TFLOP/s counts the causal work, 4 x Hq x D x sum_b L (L + 1) / 2 (two
matmuls, 2 flops a multiply-add, the lower triangle with its diagonal); the reference is the run's `gemm`
row (bf16 8192^3 `torch.mm`).

Providers, same inputs, same run:
- `hybridengine`: the Triton kernel at its default launch; with case sweep=True, each launch of SWEEP
  (tiles, warps, stages; case path `dot16-p8`: 16-bit dots with P rounded once to bf16, as flash-attention
  does, the kernel's only bf16 path) on SWEEP_CASE, and the SHORTLIST of its best launches on the other cases.
- `torch_varlen`: `torch.nn.attention.varlen.varlen_attn`, the kernel the training path uses (GQA heads
  expanded beforehand, outside the timing, where the API lacks `enable_gqa`).
- `sdpa`: `F.scaled_dot_product_attention(is_causal=True, enable_gqa=True)` on the [B, H, L, D] batch.
Every output is compared with torch_varlen's (max |diff| in the log). On CPU (the harness check) one tiny
case runs the package's plain-torch reference (`torch_ref`) and SDPA, no Triton.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .common import Ctx, quantiles

MODEL = "qwen2-7b"
NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 28, 4, 128
CASES_GPU = ((32, 512), (8, 2048), (2, 8192))
SWEEP_CASE = (8, 2048)
PATH = "dot16-p8"
"""The rows' `path` (the report's launch column): the kernel's dot path, as in earlier runs' rows."""
SWEEP = [dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=s)
         for m, n in ((64, 64), (128, 64), (128, 128), (64, 128)) for w in (4, 8) for s in (2, 3)]
SHORTLIST = [c for c in SWEEP if (c["BLOCK_M"], c["BLOCK_N"], c["num_warps"], c["num_stages"]) in
             {(64, 64, 4, 3), (128, 64, 4, 2), (128, 128, 8, 3)}]
"""The best launches of the sweep on SWEEP_CASE, timed on the other cases too."""


def causal_flops(batch: int, length: int) -> float:
    return 4.0 * NUM_Q_HEADS * HEAD_DIM * batch * length * (length + 1) / 2


def prefill_attention(ctx: Ctx) -> None:
    from hybridengine.ops import prefill_attention as PF

    cases = CASES_GPU if ctx.cuda else ((2, 24),)
    for batch, length in cases:
        g = torch.Generator(device=ctx.device).manual_seed(batch * length)
        total = batch * length
        q = torch.randn(total, NUM_Q_HEADS, HEAD_DIM, device=ctx.device, generator=g).to(torch.bfloat16)
        k = torch.randn(total, NUM_KV_HEADS, HEAD_DIM, device=ctx.device, generator=g).to(torch.bfloat16)
        v = torch.randn(total, NUM_KV_HEADS, HEAD_DIM, device=ctx.device, generator=g).to(torch.bfloat16)
        cu = torch.arange(0, total + 1, length, dtype=torch.int32, device=ctx.device)
        args = dict(q=q, k=k, v=v, cu_seqlens_q=cu, cu_seqlens_k=cu, scale=HEAD_DIM ** -0.5, max_seqlen_q=length,
                    max_seqlen_k=length)
        flops = causal_flops(batch, length)
        case = dict(batch=batch, length=length, tokens=total, q_heads=NUM_Q_HEADS, kv_heads=NUM_KV_HEADS,
                    head_dim=HEAD_DIM, dtype="bf16", flops=flops)
        runs = {}
        if ctx.cuda:
            runs["hybridengine"] = lambda: PF.prefill_attention_triton(**args)
            varlen = _torch_varlen(q, k, v, cu, length)
            if varlen is not None:
                runs["torch_varlen"] = varlen
        else:
            runs["torch_ref"] = lambda: PF.prefill_attention_ref(**args)
        qb, kb, vb = (t.view(batch, length, -1, HEAD_DIM).transpose(1, 2) for t in (q, k, v))
        runs["sdpa"] = lambda: F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, enable_gqa=True)
        outs = {}
        for provider, fn in runs.items():
            times = ctx.measure(fn, warmup=3, repeats=10 if ctx.cuda else 1,
                                desc=f"prefill {provider} {batch}x{length}")
            ctx.rec.add("prefill_attention", provider, MODEL, case, "seconds", times)
            ctx.rec.add("prefill_attention", provider, MODEL, case, "TFLOP_per_s", [flops / t / 1e12 for t in times])
            out = fn()
            outs[provider] = out.transpose(1, 2).reshape(total, NUM_Q_HEADS, HEAD_DIM) if provider == "sdpa" else out
            ctx.log(f"prefill {batch}x{length} {provider}: {quantiles(times)[1] * 1e3:.3f} ms, "
                    f"{flops / quantiles(times)[1] / 1e12:.0f} TFLOP/s")
        ref = outs.get("torch_varlen", outs.get("sdpa", outs.get("torch_ref")))
        for provider, out in outs.items():
            ctx.log(f"  {provider} max |out - {'torch_varlen' if 'torch_varlen' in outs else 'ref'}| "
                    f"{(out.float() - ref.float()).abs().max().item():.3g}")
        if ctx.cuda:
            _sweep(ctx, PF, args, case, flops, ref, SWEEP if (batch, length) == SWEEP_CASE else SHORTLIST)


def _sweep(ctx: Ctx, PF, args: dict, case: dict, flops: float, ref: torch.Tensor, configs: list[dict]) -> None:
    for launch in configs:
        label = f"{launch['BLOCK_M']}x{launch['BLOCK_N']} w{launch['num_warps']} s{launch['num_stages']}"
        row_case = dict(case, sweep=True, path=PATH, **launch)
        try:
            fn = lambda: PF.prefill_attention_triton(**args, config=launch)  # noqa: E731
            err = (fn().float() - ref.float()).abs().max().item()
            times = ctx.measure(fn, warmup=2, repeats=8, desc=f"prefill sweep {label}")
        except Exception as e:  # noqa: BLE001 - a launch that does not fit (shared memory) is a row, not a crash
            ctx.rec.not_run("prefill_attention", "hybridengine", MODEL, f"{type(e).__name__}: {str(e)[:200]}",
                            **row_case)
            ctx.log(f"prefill sweep {label}: {type(e).__name__}")
            continue
        ctx.rec.add("prefill_attention", "hybridengine", MODEL, row_case, "seconds", times)
        ctx.rec.add("prefill_attention", "hybridengine", MODEL, row_case, "TFLOP_per_s",
                    [flops / t / 1e12 for t in times])
        ctx.log(f"prefill sweep {label}: {quantiles(times)[1] * 1e3:.3f} ms, "
                f"{flops / quantiles(times)[1] / 1e12:.0f} TFLOP/s, max |diff| {err:.3g}")


def _torch_varlen(q, k, v, cu, length):
    """A call of torch's varlen flash attention on these inputs, or None where this torch lacks it."""
    from hybridengine.train.packed_attention import _varlen_api

    api = _varlen_api()
    if api is None:
        return None
    varlen_attn, params = api
    kw = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    if "enable_gqa" in params:
        kw["enable_gqa"] = True
    else:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return lambda: varlen_attn(q, k, v, cu, cu, length, length, **kw)
