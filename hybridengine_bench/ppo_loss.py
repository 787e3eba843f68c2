"""The fused PPO/GRPO loss over the LM head (`hybridengine.ops.ppo_loss`), forward + backward, and its peers.

Shapes: Qwen2-7B's LM head (H = 3584, V = 152064, bf16) and M in {8k, 32k, 128k} response tokens as
M / 1024 sequences of 1024 (CPU: H = 64, V = 1000, M in {256, 1024}). The loss is GRPO-like: clip
0.2 / 0.2, k3 KL to the reference with coefficient 0.04, token-mean, per-sequence advantages, every
token masked in (padding would favour hybridengine, which skips masked-out tokens).

TFLOP/s counts 6*M*H*V for every provider: the floor of a forward + backward that computes the
logits once. Peak extra memory (`peak_GiB`, case
scope "extra") is torch's allocator peak during one call minus what was allocated before it, the
gradients of hidden and weight included (their size is in the case as grads_GiB).

Providers:
- hybridengine: `ppo_loss` (cuBLAS chunk GEMMs + Triton row kernels, 6*M*H*V flops), with the
  default chunk (sized so that gradients + chunk stay within LOSS_MEMORY_BYTES = 2 GiB), and at
  M = 32k and 128k a sweep of the chunk size (case chunk_rows, sweep) that shows what the target costs;
- torch_ref: `ppo_loss_ref`, the full [M, V] logits (not run where ~16 B per logit cannot fit);
- torch_chunked: the reference per sequence under activation checkpointing (the backward recomputes
  the logits: 8*M*H*V);
- liger: Liger-Kernel's LigerFusedLinearGRPOLoss (loss_type bnpo = token-mean, beta = the KL
  coefficient); a failure is recorded as not_run with its error.
"""

from __future__ import annotations

import importlib
import math

import torch
from torch.utils.checkpoint import checkpoint

from .common import GiB, Ctx, quantiles, release_memory

BENCH = "ppo_loss"
GPU_HEAD = dict(hidden=3584, vocab=152064)  # Qwen2-7B
GPU_TOKENS = (8192, 32768, 131072)
CPU_HEAD = dict(hidden=64, vocab=1000)
CPU_TOKENS = (256, 1024)
SEQ_GPU, SEQ_CPU = 1024, 128
LOSS = dict(clip_low=0.2, clip_high=0.2, kl_coef=0.04, kl_estimator="k3", loss_agg="token-mean")
CHUNK_SWEEP = {32768: (1024, 2048, 4096, 8192), 131072: (256, 1024, 3456)}
NAIVE_BYTES_PER_LOGIT = 16
"""torch_ref's peak extra per logit (the fp32 logits, their log-softmax and its gradient). Used to skip M where
it cannot fit."""
SECONDS_PER_PROVIDER = 15.0
"""Repeats are cut so that one provider at one M measures for about this long (Liger at 128k: ~8 s a call)."""


def _module():
    # `hybridengine.ops.ppo_loss` is also the op's name in the package namespace: fetch the module itself.
    return importlib.import_module("hybridengine.ops.ppo_loss")


def make_inputs(ctx: Ctx, tokens: int, hidden_size: int, vocab: int, seq: int, seed: int = 0) -> dict:
    """Random bf16 head and hidden states; old/ref log-probs near the policy's own (ratios near 1, some clipped)."""
    from hybridengine.ops.token_logprobs import token_logprobs

    g = torch.Generator(device=ctx.device).manual_seed(seed)
    num_seqs = tokens // seq

    def randn(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=g, device=ctx.device, dtype=dtype)

    hidden = randn(num_seqs, seq, hidden_size, dtype=torch.bfloat16).requires_grad_()
    weight = randn(vocab, hidden_size, dtype=torch.bfloat16).mul_(2 / math.sqrt(hidden_size)).requires_grad_()
    targets = torch.randint(0, vocab, (num_seqs, seq), generator=g, device=ctx.device)
    with torch.no_grad():
        logp = token_logprobs(hidden, weight, targets)
    return dict(hidden=hidden, weight=weight, targets=targets, old=logp + 0.1 * randn(num_seqs, seq),
                ref=logp + 0.1 * randn(num_seqs, seq), adv=randn(num_seqs, 1).expand(num_seqs, seq).contiguous(),
                mask=torch.ones(num_seqs, seq, dtype=torch.bool, device=ctx.device))


def _clear_grads(x: dict) -> None:
    x["hidden"].grad = None
    x["weight"].grad = None


def step_hybridengine(x: dict, chunk_rows: int | None = None):
    from hybridengine.ops.policy_loss import LossConfig

    P = _module()
    if chunk_rows is None:
        loss, _ = P.ppo_loss(x["hidden"], x["weight"], x["targets"], x["old"], x["adv"], x["mask"],
                             ref_logprobs=x["ref"], **LOSS)
    else:  # the same path with a forced chunk size (inputs validated once, outside the timing)
        cfg = LossConfig(**{k: v for k, v in LOSS.items()})
        mask_bool, num = P._check_policy(BENCH, x["hidden"], x["weight"], None, x["targets"], x["old"], x["adv"],
                                         x["mask"], x["ref"], 1.0, cfg)
        loss, _ = P._ppo_loss_fused(x["hidden"], x["weight"], x["targets"], x["old"], x["adv"], mask_bool, num,
                                    bias=None, temperature=1.0, ref_logprobs=x["ref"], cfg=cfg, chunk_rows=chunk_rows)
    loss.backward()
    return loss.detach()


def step_torch_ref(x: dict):
    loss, _ = _module().ppo_loss_ref(x["hidden"], x["weight"], x["targets"], x["old"], x["adv"], x["mask"],
                                     ref_logprobs=x["ref"], **LOSS)
    loss.backward()
    return loss.detach()


def _sequence_loss(hidden, weight, targets, old, adv, ref, weights):
    """One sequence's share of the token-mean loss, from its full [T, V] logits (checkpointed)."""
    from hybridengine.ops import lm_head, policy_loss

    logp, _ = lm_head.logprobs_ref(hidden, weight, targets, None, 1.0)
    terms = policy_loss.policy_terms(logp, old, adv, ref, policy_loss.LossConfig(**LOSS))
    return (weights * (terms["pg"] + LOSS["kl_coef"] * terms["kl"])).sum()


def step_torch_chunked(x: dict):
    from hybridengine.ops.policy_loss import agg_weights

    weights = agg_weights(x["mask"], LOSS["loss_agg"], torch.float32)
    loss = sum(checkpoint(_sequence_loss, x["hidden"][b], x["weight"], x["targets"][b], x["old"][b], x["adv"][b],
                          x["ref"][b], weights[b], use_reentrant=False) for b in range(x["hidden"].shape[0]))
    loss.backward()
    return loss.detach()


def liger_step():
    """A step function over Liger's GRPO loss, or raises (ImportError where the wheel is missing)."""
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    loss_fn = LigerFusedLinearGRPOLoss(beta=LOSS["kl_coef"], epsilon_low=LOSS["clip_low"],
                                       epsilon_high=LOSS["clip_high"], loss_type="bnpo", use_ref_model=True)

    def step(x: dict):
        out = loss_fn(x["hidden"], x["weight"], x["targets"], x["mask"].long(), x["adv"][:, 0],
                      ref_per_token_logps=x["ref"], old_per_token_logps=x["old"])
        loss = out[0] if isinstance(out, (tuple, list)) else out
        loss.backward()
        return loss.detach()

    return step


def measure(ctx: Ctx, provider: str, step, x: dict, case: dict, flops: float, model: str | None) -> float | None:
    """Rows of one provider at one shape: seconds, TFLOP/s, tokens/s, peak extra memory; median seconds."""
    tokens = x["targets"].numel()
    try:
        _clear_grads(x)
        first = ctx.timed(lambda: step(x))  # compiles (Triton, torch.compile) and proves it runs
        _clear_grads(x)
        ctx.sync()
        base = torch.cuda.memory_allocated(ctx.device) if ctx.cuda else 0
        with ctx.peak() as pm:
            loss = step(x)
        repeats = max(3, min(10, int(SECONDS_PER_PROVIDER / max(first, 1e-6))))
        times = ctx.measure(lambda: (_clear_grads(x), step(x)), warmup=1, repeats=repeats,
                            desc=f"{BENCH} {provider} M={tokens}")
    except Exception as e:  # noqa: BLE001 - a failing peer is a row, not a crash (OOM, compile errors)
        ctx.rec.not_run(BENCH, provider, model, f"failed: {type(e).__name__}: {str(e)[:300]}", **case)
        ctx.log(f"{BENCH} M={tokens} {provider}: failed: {type(e).__name__}: {str(e)[:200]}")
        _clear_grads(x)
        release_memory()
        return None
    ctx.rec.add(BENCH, provider, model, case, "seconds", times)
    ctx.rec.add(BENCH, provider, model, case, "TFLOP_per_s", [flops / t / 1e12 for t in times])
    ctx.rec.add(BENCH, provider, model, case, "tokens_per_s", [tokens / t for t in times])
    extra = pm.torch_gib - base / GiB
    if ctx.cuda:
        ctx.rec.add(BENCH, provider, model, {**case, "source": "torch", "scope": "extra"}, "peak_GiB", extra)
        ctx.record_peak(pm, BENCH, provider, model, case)
    median = quantiles(times)[1]
    chunk = f" (chunk {case['chunk_rows']})" if "chunk_rows" in case else ""
    ctx.log(f"{BENCH} M={tokens} {provider}{chunk}: {median * 1e3:.1f} ms, "
            f"{flops / median / 1e12:.0f} TFLOP/s, extra {extra:.2f} GiB, loss {loss.item():.6f}")
    _clear_grads(x)
    return median


def ppo_loss(ctx: Ctx) -> None:
    from hybridengine.ops.lm_head import rows_per_chunk

    head = GPU_HEAD if ctx.cuda else CPU_HEAD
    H, V = head["hidden"], head["vocab"]
    seq = SEQ_GPU if ctx.cuda else SEQ_CPU
    model = "qwen2-7b" if ctx.cuda else None
    try:
        liger = liger_step()
        liger_error = None
    except Exception as e:  # noqa: BLE001 - not installed, or an API this version lacks
        liger, liger_error = None, f"{type(e).__name__}: {str(e)[:300]}"
    for tokens in GPU_TOKENS if ctx.cuda else CPU_TOKENS:
        x = make_inputs(ctx, tokens, H, V, seq)
        flops = 6.0 * tokens * H * V
        grads = (tokens * H + V * H) * 2
        chunk = rows_per_chunk(tokens, V, 2, grads)
        case = dict(tokens=tokens, seq=seq, hidden=H, vocab=V, dtype="bf16", grads_GiB=round(grads / GiB, 3))
        medians = {}
        he_path = "triton" if ctx.cuda else "reference (cpu)"
        medians["hybridengine"] = measure(ctx, "hybridengine", step_hybridengine, x,
                                          {**case, "chunk_rows": chunk, "path": he_path}, flops, model)
        need = NAIVE_BYTES_PER_LOGIT * tokens * V
        free = torch.cuda.mem_get_info(ctx.device)[0] if ctx.cuda else None
        if free is not None and need > free:
            ctx.rec.not_run(BENCH, "torch_ref", model, f"needs ~{need / GiB:.0f} GiB for the [M, V] logits and their "
                            f"fp32 intermediates ({NAIVE_BYTES_PER_LOGIT} B per logit), {free / GiB:.0f} GiB free",
                            **case)
        else:
            medians["torch_ref"] = measure(ctx, "torch_ref", step_torch_ref, x, case, flops, model)
        medians["torch_chunked"] = measure(ctx, "torch_chunked", step_torch_chunked, x, case, flops, model)
        if liger is None:
            ctx.rec.not_run(BENCH, "liger", model, f"LigerFusedLinearGRPOLoss unavailable: {liger_error}", **case)
        else:
            medians["liger"] = measure(ctx, "liger", liger, x, case, flops, model)
        if ctx.cuda:
            for rows in CHUNK_SWEEP.get(tokens, ()):
                measure(ctx, "hybridengine", lambda x, rows=rows: step_hybridengine(x, rows), x,
                        {**case, "chunk_rows": rows, "path": "triton", "sweep": True}, flops, model)
        ours = medians["hybridengine"]
        if ours:
            ratios = ", ".join(f"{t / ours:.2f}x vs {p}" for p, t in medians.items() if t and p != "hybridengine")
            ctx.log(f"{BENCH} M={tokens}: hybridengine speed-up {ratios}")
        del x
        release_memory()
