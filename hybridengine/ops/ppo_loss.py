"""`ppo_loss`: the PPO/GRPO clipped policy loss (+ dual clip, KL, entropy, rollout correction) straight from the
last hidden states and the LM head, without materialising the logits.

Three layers, as for every op: the plain-torch reference (`ppo_loss_ref`: full logits in fp32, autograd does
the rest), the fused path (`lm_head.head_pass`: cuBLAS chunk GEMMs + the row kernels of
`hybridengine.kernels.ppo_loss`, wrapped in an `autograd.Function`), and the public `ppo_loss` that validates
and picks one: the kernels on CUDA, the reference on CPU. Both aggregate the same per-token math
(`policy_loss.policy_loss`) over their log-probs.

The fused loss computes its gradients in the forward (exact: each token's gradient needs only its own logits
row and the aggregation weights, which come from the mask alone): per chunk, `policy_loss.policy_grad_logp`
gives dloss/dlogp and the entropy coefficient dloss/dentropy, and the head pass turns them into the hidden,
weight and bias gradients (6*M*H*V flops in all, one [C, V] logits chunk at a time). The backward only scales
the saved gradients by grad_output. Masked-out tokens are never computed (their loss terms and gradients are
zero): with 40% padding the op costs 60% of the flops. One host sync per call validates targets and mask and
counts tokens.

Exact log-probs (`exact=True`): the log-probs are those of the rollout's sampler for the same hidden states
(see `hybridengine.ops.lm_head`), so old log-probs taken from the rollout give a ratio of exactly 1 before the
first update.

Rollout correction (`rollout_correction`): where the rollout's log-probs still differ from the
trainer's (`old_logprobs`), each token's policy-gradient term is weighted by a function of
`r = pi_old / pi_rollout = exp(old - rollout)` (no gradient): "tis" (truncated importance
sampling) `w = min(r, cap)`, "mis" (masked importance sampling) `w = 1` inside `[1 / cap, cap]`,
else 0. The KL and entropy terms are not weighted, and the aggregation denominators stay the
response mask's (a masked token still counts as a token). It costs O(M) elementwise work, fused
into the per-chunk coefficients.
"""

from __future__ import annotations

import torch

from hybridengine.ops.lm_head import (check_head, check_temperature, check_values, computed_rows, grad_buffers,
                                      gradient_bytes, head_pass, logprobs_ref, needs_grad, scatter_rows,
                                      use_kernels)
from hybridengine.ops.policy_loss import (METRICS, LossConfig, agg_weights, bool_mask, check_bt, policy_grad_logp,
                                          policy_loss, rollout_weight)


# --------------------------------------------------------------------------------------------
# checks and the reference


def _check_policy(op, hidden, weight, bias, targets, old_logprobs, advantages, mask, ref_logprobs, temperature,
                  cfg: LossConfig, rollout_logprobs=None) -> tuple[torch.Tensor, int]:
    """All of ppo_loss's checks; returns the bool mask and the number of masked-in tokens."""
    check_head(op, hidden, weight, bias, targets)
    check_temperature(temperature)
    shape, device = targets.shape, hidden.device
    check_bt(op, "old_logprobs", old_logprobs, shape, device)
    check_bt(op, "advantages", advantages, shape, device)
    if ref_logprobs is not None:
        check_bt(op, "ref_logprobs", ref_logprobs, shape, device)
    elif cfg.kl_coef != 0:
        raise ValueError(f"{op}: kl_coef = {cfg.kl_coef} needs ref_logprobs")
    if rollout_logprobs is not None:
        check_bt(op, "rollout_logprobs", rollout_logprobs, shape, device)
    elif cfg.rollout_correction is not None:
        raise ValueError(f"{op}: rollout_correction = {cfg.rollout_correction!r} needs rollout_logprobs")
    mask_bool = bool_mask(op, mask, shape, device, strict=False)  # 0/1 checked with the targets, one sync
    num_tokens = check_values(op, targets, weight.shape[0], mask, mask_bool)
    return mask_bool, num_tokens


def ppo_loss_ref(hidden, weight, targets, old_logprobs, advantages, mask, *, bias=None, temperature=1.0,
                 clip_low=0.2, clip_high=0.2, clip_ratio_c=None, ref_logprobs=None, kl_coef=0.0, kl_estimator="k3",
                 entropy_coef=0.0, loss_agg="token-mean", rollout_logprobs=None, rollout_correction=None,
                 rollout_correction_cap=2.0, exact=False) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Plain-torch `ppo_loss`: materialises the full logits in fp32 (the tests' and benches' reference)."""
    cfg = LossConfig(clip_low=clip_low, clip_high=clip_high, clip_ratio_c=clip_ratio_c, kl_coef=kl_coef,
                     kl_estimator=kl_estimator, entropy_coef=entropy_coef, loss_agg=loss_agg,
                     rollout_correction=rollout_correction, rollout_correction_cap=rollout_correction_cap)
    mask_bool, _ = _check_policy("ppo_loss_ref", hidden, weight, bias, targets, old_logprobs, advantages, mask,
                                 ref_logprobs, temperature, cfg, rollout_logprobs)
    return _ppo_loss_ref(hidden, weight, targets, old_logprobs, advantages, mask_bool, bias, temperature,
                         ref_logprobs, cfg, rollout_logprobs, exact)


def _ppo_loss_ref(hidden, weight, targets, old_logprobs, advantages, mask_bool, bias, temperature, ref_logprobs, cfg,
                  rollout_logprobs=None, exact=False):
    safe_targets = torch.where(mask_bool, targets, torch.zeros_like(targets))  # masked-out targets may be padding
    logp, entropy = logprobs_ref(hidden, weight, safe_targets, bias, temperature, exact)
    return policy_loss(logp, entropy, old_logprobs, advantages, mask_bool, ref_logprobs, cfg, rollout_logprobs)


# --------------------------------------------------------------------------------------------
# the fused path


class _FusedPolicyLoss(torch.autograd.Function):
    """Forward computes loss, metrics and all gradients; backward scales the gradients by grad_output."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, old_logprobs, advantages, mask_bool, ref_logprobs,
                rollout_logprobs, rows, cfg, temperature, needs, chunk_rows, block_v, exact):
        B, T, H = hidden.shape

        def flat(x):  # [B, T] -> the computed rows
            if x is None:
                return None
            return x.reshape(-1) if rows is None else x.reshape(-1)[rows]

        weights = flat(agg_weights(mask_bool, cfg.loss_agg, torch.float32))
        old, adv, ref = flat(old_logprobs), flat(advantages), flat(ref_logprobs)
        rollout_w, _ = rollout_weight(old, flat(rollout_logprobs), cfg, torch.float32)
        g_ent = -cfg.entropy_coef * weights

        def coefs(start, end, logp, ent):
            part = slice(start, end)
            g_logp = policy_grad_logp(logp, old[part], adv[part], None if ref is None else ref[part],
                                      weights[part], cfg, None if rollout_w is None else rollout_w[part])
            return g_logp, g_ent[part]

        grad_h, grad_w, grad_b = grad_buffers(hidden, weight, bias, needs, rows)
        _, logp, entropy = head_pass(hidden, weight, bias, targets.reshape(-1).long(), rows, temperature=temperature,
                                     coefs=coefs if any(needs) else None, grad_hidden=grad_h, grad_weight=grad_w,
                                     grad_bias=grad_b, chunk_rows=chunk_rows, block_v=block_v,
                                     grad_bytes=gradient_bytes(hidden, weight, needs), exact=exact)
        loss, metrics = policy_loss(scatter_rows(logp, rows, B, T), scatter_rows(entropy, rows, B, T), old_logprobs,
                                    advantages, mask_bool, ref_logprobs, cfg, rollout_logprobs)
        ctx.hidden_shape = hidden.shape
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.consumed = False
        ctx.save_for_backward(grad_h, grad_w, grad_b)
        outputs = tuple(metrics[k] for k in METRICS)
        ctx.mark_non_differentiable(*outputs)
        return (loss, *outputs)

    @staticmethod
    def backward(ctx, grad_loss, *_):
        if ctx.consumed:
            raise RuntimeError("ppo_loss: a second backward through one fused ppo_loss call (retain_graph=True) is "
                               "not supported: its gradients were computed in the forward and scaled in place")
        ctx.consumed = True
        grad_h, grad_w, grad_b = ctx.saved_tensors
        # In place: a second [M, H] and [V, H] would add 2 GiB at M = 128k, V = 152k.
        if grad_h is not None:
            grad_h = grad_h.mul_(grad_loss).view(ctx.hidden_shape)
        if grad_w is not None:
            grad_w = grad_w.mul_(grad_loss)
        if grad_b is not None:
            grad_b = grad_b.mul_(grad_loss).to(ctx.bias_dtype)
        return grad_h, grad_w, grad_b, *([None] * 13)


def _ppo_loss_fused(hidden, weight, targets, old_logprobs, advantages, mask_bool, num_tokens, *, bias, temperature,
                    ref_logprobs, cfg, rollout_logprobs=None, exact=False, chunk_rows=None, block_v=None):
    """The Triton path (inputs already validated); runs on CPU tensors under TRITON_INTERPRET=1 too."""
    rows, needs = computed_rows(mask_bool, num_tokens), needs_grad(hidden, weight, bias)
    loss, *values = _FusedPolicyLoss.apply(hidden, weight, bias, targets, old_logprobs, advantages, mask_bool,
                                           ref_logprobs, rollout_logprobs, rows, cfg, temperature, needs, chunk_rows,
                                           block_v, exact)
    return loss, dict(zip(METRICS, values))


def ppo_loss(hidden, weight, targets, old_logprobs, advantages, mask, *, bias=None, temperature=1.0, clip_low=0.2,
             clip_high=0.2, clip_ratio_c=None, ref_logprobs=None, kl_coef=0.0, kl_estimator="k3", entropy_coef=0.0,
             loss_agg="token-mean", rollout_logprobs=None, rollout_correction=None, rollout_correction_cap=2.0,
             exact=False) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO/GRPO clipped policy loss straight from the last hidden states and the LM head.

    hidden [B, T, H] (bf16/fp32), weight [V, H], bias [V] or None, targets [B, T] int (any value
    where mask is 0), old_logprobs / advantages / ref_logprobs / rollout_logprobs [B, T] float,
    mask [B, T] 0/1. `z = (hidden @ weight.T + bias) / temperature`, `logp = log_softmax(z)[targets]`,
    `d = clamp(logp - old, -20, 20)`, `ratio = exp(d)`, `pg = max(-A * ratio, -A * clamp(ratio,
    1 - clip_low, 1 + clip_high))`, capped at `-A * clip_ratio_c` where A < 0 (dual clip), and
    `loss = agg(w * pg) - entropy_coef * agg(entropy) + kl_coef * agg(kl(logp, ref))`.

    w is the rollout correction (1 when `rollout_correction` is None), from `r = exp(old -
    rollout_logprobs)` without gradient: "tis" `w = min(r, rollout_correction_cap)`, "mis" `w = 1`
    where `1 / cap <= r <= cap`, else 0. Only the policy-gradient term is weighted; the aggregation
    denominators stay the mask's. `exact=True`: the log-probs are `chosen_logprobs` of the
    batch-invariant `linear_exact` logits (with `inv_t = 1 / temperature` in fp32), the same bits the
    sampler reports for the same hidden states, whatever the batch.

    Returns (loss, metrics): metrics are detached 0-dim fp32 tensors `pg_loss`, `pg_clipfrac`,
    `pg_clipfrac_lower` (both of the uncorrected terms), `ppo_kl` (token-mean of -d), `entropy`
    (agg), `kl_loss` (agg; 0 without ref_logprobs), and over the response tokens (token means):
    `rollout_corr_weight` (w; 1 when off), `rollout_corr_clipfrac` (tokens with r > cap for "tis",
    r outside [1 / cap, cap] for "mis"; 0 when off) and `rollout_corr_logprob_diff` (|old -
    rollout|, whenever rollout_logprobs is given; 0 without). All are 0 when no token is masked in.
    Gradients flow to hidden, weight and bias. On CUDA the fused Triton path runs (one pass, one
    [C, V] chunk of logits at a time); elsewhere the plain-torch reference.
    """
    cfg = LossConfig(clip_low=clip_low, clip_high=clip_high, clip_ratio_c=clip_ratio_c, kl_coef=kl_coef,
                     kl_estimator=kl_estimator, entropy_coef=entropy_coef, loss_agg=loss_agg,
                     rollout_correction=rollout_correction, rollout_correction_cap=rollout_correction_cap)
    mask_bool, num_tokens = _check_policy("ppo_loss", hidden, weight, bias, targets, old_logprobs, advantages, mask,
                                          ref_logprobs, temperature, cfg, rollout_logprobs)
    if use_kernels("ppo_loss", hidden):
        return _ppo_loss_fused(hidden, weight, targets, old_logprobs, advantages, mask_bool, num_tokens, bias=bias,
                               temperature=temperature, ref_logprobs=ref_logprobs, cfg=cfg,
                               rollout_logprobs=rollout_logprobs, exact=exact)
    return _ppo_loss_ref(hidden, weight, targets, old_logprobs, advantages, mask_bool, bias, temperature,
                         ref_logprobs, cfg, rollout_logprobs, exact)
