"""Custom losses through the fused LM-head pass (bench `loss_hook`, suite `loss_hook`): what
`HybridEngine.train_step(batch, loss_fn, config)` costs against `ppo_step`, and against the same loss on
full logits in plain torch.

One GPU, Qwen2.5-1.5B shapes (H = 1536, V = 151936 tied, 28 layers, bf16); CPU: the tiny preset at the CPU
workload (a check that the bench runs: there every provider runs the plain-torch head).

Step level (case level "step"): per GPU `batch` sequences of `seq` tokens (the workload's train_seq), the
first quarter of each a masked-out prompt, micro-batches of 16384 tokens: batch 8 (one micro-batch, 6144
response tokens: two logits chunks, one recomputed in the hook's backward) and batch 32 (two micro-batches
of 12288 response tokens: four chunks each, three recomputed). Providers, one engine, the same batch:

- ppo_step: the built-in step (the fused `ppo_loss`: gradients in one pass over the head, 6*M*H*V);
- hook: `train_step` with `losses.ppo_clip` and the same options (`masked_logprobs` + autograd: the forward
  keeps the last chunk, the backward recomputes the others: 6*M*H*V + 2*M*H*V per recomputed chunk);
- hook_full_logits: the same `train_step` with the head op swapped for the plain-torch reference (the
  [tokens, V] logits in fp32 and their autograd graph): the cost of writing the loss in torch without
  the fused pass;
- hook_gspo, hook_sft: two other shipped losses through the hook (time only).

Rows: seconds and tokens/s per step, torch and NVML peaks, and `fraction` rows: hook / ppo_step (the goal is
<= 1.05) and hook_full_logits / hook.

Head level (case level "head"): the LM head alone on M response tokens (sequences of `seq`), forward +
backward: `ppo_loss` (fused), `masked_logprobs` + `ppo_clip` (hook), and the reference with full logits
(torch_full; not run where ~16 B per logit cannot fit): seconds, TFLOP/s against 6*M*H*V, peak extra memory
(torch allocator, inputs excluded).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from unittest import mock

import torch

from .common import GiB, Ctx, quantiles, release_memory

BENCH = "loss_hook"
GPU_MODEL, CPU_MODEL = "qwen2.5-1.5b", "tiny-qwen2"
PPO = dict(clip_low=0.2, clip_high=0.28, kl_coef=0.0, entropy_coef=0.0, loss_agg="token-mean")
HEAD_TOKENS_GPU, HEAD_TOKENS_CPU = (8192, 16384), (256,)
FULL_LOGITS_BYTES = 16
"""Peak bytes per logit of the full-logits reference (bf16 logits, their fp32 copy, log-softmax, its
gradient); a provider that cannot fit is a not_run row."""


def _ops():
    return importlib.import_module("hybridengine.ops.masked_logprobs")  # the module (the package exports the op's name)


def _full_logits(hidden, weight, targets, mask, *, temperature=1.0, exact=False, bias=None):
    """`masked_logprobs` on the plain-torch reference whatever the device: full logits, autograd."""
    P = _ops()
    return P._masked_logprobs_ref(hidden, weight, targets, mask.bool(), bias, temperature, exact)


def _fits(ctx: Ctx, tokens: int, vocab: int) -> tuple[bool, str]:
    if not ctx.cuda:
        return True, ""
    need, free = FULL_LOGITS_BYTES * tokens * vocab, torch.cuda.mem_get_info(ctx.device)[0]
    return need <= free, f"needs ~{need / GiB:.0f} GiB for the full logits, {free / GiB:.0f} GiB free"


def make_batch(cfg, batch: int, seq: int, seed: int):
    """Token ids, response masks (the first quarter of each sequence is the prompt), per-sequence advantages."""
    g = torch.Generator().manual_seed(seed)
    prompt = seq // 4
    ids = [torch.randint(0, cfg.vocab_size, (seq,), generator=g) for _ in range(batch)]
    mask = [(torch.arange(seq - 1) >= prompt - 1).float() for _ in range(batch)]
    adv = [torch.full((seq - 1,), float(torch.randn((), generator=g))) for _ in range(batch)]
    return ids, mask, adv


def step_level(ctx: Ctx, model: str) -> None:
    import hybridengine as he
    from hybridengine.train import losses, trainer as trainer_module

    cfg = he.model_config(model)
    w = ctx.work
    seq, micro = w.train_seq, 4 * w.train_batch * w.train_seq
    engine = he.HybridEngine(cfg, he.EngineConfig(dtype=torch.bfloat16, device=str(ctx.device)))
    for batch_size in (2 * w.train_batch, 8 * w.train_batch):
        ids, mask, adv = make_batch(cfg, batch_size, seq, seed=100 + ctx.rank)
        scoring = he.PPOBatch(input_ids=ids)
        old = engine.log_probs(scoring)  # ratios near 1: some tokens clip once the weights move
        batch = he.PPOBatch(input_ids=ids, response_mask=mask, advantages=adv,
                            old_logprobs=[old[b, :seq - 1].cpu() for b in range(batch_size)])
        ppo = he.PPOConfig(micro_batch_tokens=micro, lr=1e-7, max_grad_norm=1.0, **PPO)
        train = he.TrainConfig(micro_batch_tokens=micro, lr=1e-7, max_grad_norm=1.0)
        seq_cfg = he.TrainConfig(micro_batch_tokens=micro, lr=1e-7, max_grad_norm=1.0, loss_scale="sequences")
        hook = functools.partial(losses.ppo_clip, **PPO)
        tokens = batch_size * seq
        response = sum(int(m.sum()) for m in mask)
        case = dict(level="step", batch_per_gpu=batch_size, seq=seq, response_tokens=response,
                    micro_batch_tokens=micro, dtype="bf16")
        providers = {
            "ppo_step": lambda: engine.ppo_step(batch, ppo),
            "hook": lambda: engine.train_step(batch, hook, ppo),
            "hook_full_logits": lambda: engine.train_step(batch, hook, ppo),
            "hook_gspo": lambda: engine.train_step(batch, functools.partial(losses.gspo, clip_low=0.2, clip_high=0.2),
                                                   seq_cfg),
            "hook_sft": lambda: engine.train_step(batch, losses.sft_nll, train),
        }
        medians = {}
        for name, fn in providers.items():
            if name == "hook_full_logits":
                ok, why = _fits(ctx, min(micro, tokens), cfg.vocab_size)
                if not ok:
                    ctx.rec.not_run(BENCH, name, model, why, **case)
                    continue
                patch = mock.patch.object(trainer_module, "masked_logprobs", _full_logits)
            else:
                patch = contextlib.nullcontext()
            try:
                with patch, ctx.peak() as pm:
                    times = ctx.measure(fn, warmup=2, repeats=6, desc=f"{BENCH} {name} B={batch_size}")
            except Exception as e:  # noqa: BLE001 - a provider that fails (OOM) is a row
                ctx.rec.not_run(BENCH, name, model, f"failed: {type(e).__name__}: {str(e)[:300]}", **case)
                ctx.log(f"{BENCH} {name} B={batch_size}: failed: {type(e).__name__}: {str(e)[:200]}")
                release_memory()
                continue
            medians[name] = quantiles(times)[1]
            ctx.rec.add(BENCH, name, model, case, "seconds", times)
            ctx.rec.add(BENCH, name, model, case, "tokens_per_s", [ctx.world * tokens / t for t in times])
            ctx.record_peak(pm, BENCH, name, model, case)
            ctx.log(f"{BENCH} step B={batch_size} {name}: {medians[name] * 1e3:.1f} ms, peak {pm.torch_gib:.2f} GiB "
                    f"(nvml {pm.nvml_gib:.2f})")
        for num, den in (("hook", "ppo_step"), ("hook_full_logits", "hook")):
            if medians.get(num) and medians.get(den):
                ratio = medians[num] / medians[den]
                ctx.rec.add(BENCH, "hybridengine", model, {**case, "ratio": f"{num}/{den}"}, "fraction", ratio)
                ctx.log(f"{BENCH} step B={batch_size}: {num} / {den} = {ratio:.3f}")
    del engine
    release_memory()


def head_level(ctx: Ctx, model: str) -> None:
    import hybridengine as he
    from hybridengine.train import losses

    cfg = he.model_config(model)
    H, V = cfg.hidden_size, cfg.vocab_size
    seq = ctx.work.train_seq
    for tokens in HEAD_TOKENS_GPU if ctx.cuda else HEAD_TOKENS_CPU:
        g = torch.Generator(device=ctx.device).manual_seed(tokens)
        B = tokens // seq
        hidden = torch.randn(B, seq, H, generator=g, device=ctx.device, dtype=torch.bfloat16).requires_grad_()
        weight = (torch.randn(V, H, generator=g, device=ctx.device, dtype=torch.bfloat16) * H ** -0.5).requires_grad_()
        targets = torch.randint(0, V, (B, seq), generator=g, device=ctx.device)
        mask = torch.ones(B, seq, dtype=torch.bool, device=ctx.device)
        with torch.no_grad():
            logp = he.token_logprobs(hidden, weight, targets)
        fields = losses.LossFields(mask=mask, old_logprobs=logp + 0.1 * torch.randn(B, seq, generator=g,
                                                                                   device=ctx.device),
                                   advantages=torch.randn(B, 1, generator=g, device=ctx.device).expand(B, seq))

        def fused():
            loss, _ = he.ppo_loss(hidden, weight, targets, fields["old_logprobs"], fields["advantages"], mask, **PPO)
            loss.backward()

        def hook(op):
            logp, entropy = op(hidden, weight, targets, mask)
            loss, _ = losses.ppo_clip(logp, entropy, fields, **PPO)
            loss.backward()

        case = dict(level="head", tokens=tokens, seq=seq, hidden=H, vocab=V, dtype="bf16")
        flops = 6.0 * tokens * H * V
        providers = {"ppo_loss": fused, "hook": lambda: hook(he.masked_logprobs),
                     "torch_full": lambda: hook(_full_logits)}
        for name, fn in providers.items():
            if name == "torch_full":
                ok, why = _fits(ctx, tokens, V)
                if not ok:
                    ctx.rec.not_run(BENCH, name, model, why, **case)
                    continue

            def call(fn=fn):
                hidden.grad = weight.grad = None
                fn()

            try:
                call()
                hidden.grad = weight.grad = None
                ctx.sync()
                base = torch.cuda.memory_allocated(ctx.device) if ctx.cuda else 0
                with ctx.peak() as pm:
                    call()
                times = ctx.measure(call, warmup=1, repeats=8, desc=f"{BENCH} head {name} M={tokens}")
            except Exception as e:  # noqa: BLE001
                ctx.rec.not_run(BENCH, name, model, f"failed: {type(e).__name__}: {str(e)[:300]}", **case)
                hidden.grad = weight.grad = None
                release_memory()
                continue
            hidden.grad = weight.grad = None
            ctx.rec.add(BENCH, name, model, case, "seconds", times)
            ctx.rec.add(BENCH, name, model, case, "TFLOP_per_s", [flops / t / 1e12 for t in times])
            if ctx.cuda:
                ctx.rec.add(BENCH, name, model, {**case, "source": "torch", "scope": "extra"}, "peak_GiB",
                            pm.torch_gib - base / GiB)
                ctx.record_peak(pm, BENCH, name, model, case)
            ctx.log(f"{BENCH} head M={tokens} {name}: {quantiles(times)[1] * 1e3:.1f} ms")
        del hidden, weight, fields
        release_memory()


def loss_hook(ctx: Ctx) -> None:
    """Both levels for each model of the run (default Qwen2.5-1.5B; the tiny preset on CPU)."""
    models = ctx.models if ctx.cuda else [CPU_MODEL]
    for model in models:
        step_level(ctx, model)
        head_level(ctx, model)
