"""Token-level losses for `HybridEngine.train_step`, written in plain torch on per-token log-probs.

`train_step(batch, loss_fn, config)` runs the fused LM-head pass (`ops.masked_logprobs.masked_logprobs`) on each
micro-batch and calls `loss_fn(logp, entropy, fields)`: logp and entropy are fp32 [B, T] tensors over the
micro-batch's B sequences (row i is the sequence `fields["seq_index"][i, 0]` of the rank's batch, position t
predicts its token t + 1), computed where `fields["mask"]` is True and 0 elsewhere. The loss returns a
scalar (or `(scalar, {name: scalar})`, the second part reported in the step's stats); autograd carries
dloss/dlogp and dloss/dentropy back into the fused pass. `fields` (a `LossFields`) holds:

- the batch's per-token fields as [B, T] fp32 (zero padded): response_mask, old_logprobs, advantages,
  ref_logprobs, rollout_logprobs, old_values, returns, whichever the batch has, and every `batch.extra`
  field (its own dtype);
- "mask" (bool [B, T]: response_mask != 0, or every target token when the batch has no response_mask),
  "valid" (bool [B, T]: a real target token, not padding), "targets" (int64 [B, T]) and "seq_index"
  (int64 [B, T]: the batch index of each row's sequence, -1 on the dummy row of an empty micro-batch);
- the counts "num_tokens" / "num_sequences" (this rank's batch: tokens in the mask, sequences with at
  least one) and "global_tokens" / "global_sequences" (summed over the ranks), as Python ints.

A micro-batch holds whole sequences (and whole `batch.groups`), so a sequence-level loss sees every token
of each of its sequences. How the micro-batch losses add up to the step's loss is
`TrainConfig.loss_scale`'s (see `TrainConfig`); each loss here aggregates its micro-batch accordingly.

The losses (each `fn(logp, entropy, fields, **options)`; bind the options with `functools.partial`):

- `ppo_clip`: the built-in PPO/GRPO loss of `ppo_step` (same code, same bits on the reference path);
- `gspo`: GSPO's sequence-level ratio (Zheng et al. 2025, arXiv 2507.18071);
- `cispo`: CISPO's clipped, stop-gradient importance weight times logp (MiniMax-M1, arXiv 2506.13585);
- `sft_nll`: the negative log-likelihood of the masked-in tokens;
- `dpo`: DPO's sigmoid loss over chosen/rejected pairs (Rafailov et al. 2023) with reference log-probs
  from `fields["ref_logprobs"]` (e.g. a frozen engine's `log_probs`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from hybridengine.ops.policy_loss import LOSS_AGGS, LOSS_FIELDS, LossConfig, aggregate, policy_loss

__all__ = ["LossFields", "LossFnError", "MissingFieldError", "cispo", "dpo", "gspo", "ppo_clip", "ppo_options",
           "sft_nll"]


class LossFnError(ValueError):
    """`train_step`'s loss function failed or returned something other than a finite scalar, on this rank or
    another; every rank raises it in the same micro-batch, before any optimizer update. The engine stays
    usable: weights and optimizer state are as they were before the step."""


class MissingFieldError(KeyError):
    """`fields[name]` for a field the batch does not have."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class LossFields(dict):
    """The per-token fields given to a loss function: a dict whose missing keys raise `MissingFieldError`
    naming the key and the fields there are."""

    def __missing__(self, key):
        raise MissingFieldError(f"fields[{key!r}]: this batch has no such field (batch.{key} is None, or it is "
                                f"not in batch.extra); the fields are {sorted(self)}")


def _require(op: str, fields, *names: str) -> None:
    missing = [n for n in names if n not in fields]
    if missing:
        raise MissingFieldError(f"{op} needs fields {', '.join(repr(n) for n in missing)} (batch."
                                f"{missing[0]}); the fields are {sorted(fields)}")


def _mask(fields) -> torch.Tensor:
    return fields["mask"]


def _seq_mean(values: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """Mean of per-sequence values over the live sequences (0 when none)."""
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    return torch.where(live, values, zero).sum() / live.sum().clamp_min(1).to(values.dtype)


# --------------------------------------------------------------------------------------------
# the losses


def ppo_clip(logp, entropy, fields, *, clip_low=0.2, clip_high=0.2, clip_ratio_c=None, kl_coef=0.0,
             kl_estimator="k3", entropy_coef=0.0, loss_agg="token-mean", rollout_correction=None,
             rollout_correction_cap=2.0):
    """The PPO/GRPO clipped surrogate of `ppo_step` (`ops.ppo_loss.ppo_loss`'s formulas and metrics: both run
    `ops.policy_loss.policy_loss`) on the hook's log-probs: needs old_logprobs and advantages (ref_logprobs for
    kl_coef != 0, rollout_logprobs for a rollout correction). Returns (loss, metrics). With the options of a
    `PPOConfig` (`ppo_options`) and the same config, `train_step(batch, partial(ppo_clip, **ppo_options(cfg)),
    cfg)` is `ppo_step`."""
    try:
        cfg = LossConfig(clip_low=clip_low, clip_high=clip_high, clip_ratio_c=clip_ratio_c, kl_coef=kl_coef,
                         kl_estimator=kl_estimator, entropy_coef=entropy_coef, loss_agg=loss_agg,
                         rollout_correction=rollout_correction, rollout_correction_cap=rollout_correction_cap)
    except ValueError as e:
        raise ValueError(f"ppo_clip: {e}") from None
    _require("ppo_clip", fields, "old_logprobs", "advantages")
    if kl_coef:
        _require("ppo_clip (kl_coef != 0)", fields, "ref_logprobs")
    if rollout_correction is not None:
        _require(f"ppo_clip (rollout_correction={rollout_correction!r})", fields, "rollout_logprobs")
    return policy_loss(logp, entropy, fields["old_logprobs"], fields["advantages"], _mask(fields),
                       fields.get("ref_logprobs"), cfg, fields.get("rollout_logprobs"))


def ppo_options(cfg) -> dict:
    """The `ppo_clip` options a `PPOConfig` sets (its loss fields)."""
    return {name: getattr(cfg, name) for name in LOSS_FIELDS}


def gspo(logp, entropy, fields, *, clip_low=3e-4, clip_high=4e-4, loss_agg="seq-mean-token-mean"):
    """GSPO (Group Sequence Policy Optimization, arXiv 2507.18071): the clipped surrogate on the
    sequence-level ratio `s_i = exp(mean_t(logp - old))` over each sequence's masked-in tokens, in its
    GSPO-token form `s_it = sg(s_i) * exp(logp_t - sg(logp_t))` (the value s_i, the gradient s_i *
    dlogp_t), which equals GSPO's when the advantage is constant over each sequence (GRPO's) and allows
    per-token advantages. `pg_it = max(-A_it * s_it, -A_it * clamp(s_it, 1 - clip_low, 1 + clip_high))`,
    aggregated by loss_agg (the paper's "seq-mean-token-mean": use loss_scale "sequences"). The
    paper's clip range is [1 - 3e-4, 1 + 4e-4]. The log-ratio is capped at 10 (verl's guard). Needs
    old_logprobs and advantages. Returns (loss, metrics: pg_clipfrac, seq_ratio)."""
    _require("gspo", fields, "old_logprobs", "advantages")
    _check_options("gspo", clip_low=clip_low, clip_high=clip_high, loss_agg=loss_agg)
    mask = _mask(fields)
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    diff = torch.where(mask, logp - fields["old_logprobs"], zero)
    tokens = mask.sum(-1, keepdim=True)
    seq_log_ratio = diff.sum(-1, keepdim=True) / tokens.clamp_min(1).to(logp.dtype)
    log_ratio = torch.clamp(logp - logp.detach() + seq_log_ratio.detach(), max=10.0)
    ratio = torch.exp(log_ratio)
    adv = fields["advantages"].to(logp.dtype)
    pg1 = -adv * ratio
    pg2 = -adv * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    loss = aggregate(torch.maximum(pg1, pg2), mask, loss_agg)
    live = tokens.squeeze(-1) > 0
    metrics = dict(pg_clipfrac=aggregate((pg2 > pg1).to(logp.dtype), mask, "token-mean"),
                   seq_ratio=_seq_mean(torch.exp(seq_log_ratio.squeeze(-1).detach()), live))
    return loss, {k: v.detach() for k, v in metrics.items()}


def cispo(logp, entropy, fields, *, clip_low=None, clip_high=0.28, loss_agg="token-mean"):
    """CISPO (MiniMax-M1, arXiv 2506.13585): `-agg(sg(clamp(r, 1 - clip_low, 1 + clip_high)) * A * logp)`
    with `r = exp(logp - old)` per token: the importance weight is clipped and carries no gradient, so
    every token keeps a gradient (PPO's clip drops the clipped tokens'). clip_low None: no lower bound
    (the paper tunes only the upper one). Needs old_logprobs and advantages. Returns (loss, metrics:
    is_clipfrac, is_weight)."""
    _require("cispo", fields, "old_logprobs", "advantages")
    _check_options("cispo", clip_low=clip_low, clip_high=clip_high, loss_agg=loss_agg)
    mask = _mask(fields)
    ratio = torch.exp(torch.clamp(logp.detach() - fields["old_logprobs"], -20, 20))
    weight = torch.clamp(ratio, min=None if clip_low is None else 1 - clip_low, max=1 + clip_high)
    adv = fields["advantages"].to(logp.dtype)
    loss = aggregate(-weight * adv * logp, mask, loss_agg)
    metrics = dict(is_clipfrac=aggregate((weight != ratio).to(logp.dtype), mask, "token-mean"),
                   is_weight=aggregate(weight, mask, "token-mean"))
    return loss, metrics


def sft_nll(logp, entropy, fields, *, loss_agg="token-mean"):
    """Supervised fine-tuning: the negative log-likelihood `-agg(logp)` of the masked-in target tokens
    (every target token when the batch has no response_mask). Returns (loss, metrics: nll per token)."""
    _check_options("sft_nll", loss_agg=loss_agg)
    mask = _mask(fields)
    loss = aggregate(-logp, mask, loss_agg)
    return loss, dict(nll=aggregate(-logp.detach(), mask, "token-mean"))


def dpo(logp, entropy, fields, *, beta=0.1, label_smoothing=0.0):
    """DPO's sigmoid loss (Rafailov et al. 2023) over chosen/rejected pairs: with `z = beta * ((pi_c -
    ref_c) - (pi_r - ref_r))`, each pair's loss is `-(1 - ls) * logsigmoid(z) - ls * logsigmoid(-z)`
    (ls = label_smoothing, cDPO), where pi and ref are sums of logp and of fields["ref_logprobs"] over a
    sequence's masked-in tokens (the response). The loss is the mean over the micro-batch's pairs: use
    loss_scale "sequences" (each pair counts two sequences, so the step's loss is the mean over pairs).

    Layout: sequence 2k of the batch is the chosen response of pair k, 2k + 1 the rejected one, and
    `batch.groups` keeps each pair in one micro-batch (e.g. groups = [0, 0, 1, 1, ...]). The reference
    log-probs come from a frozen engine: `ref.log_probs(batch)` (the same temperature). Returns (loss,
    metrics: reward_accuracy, reward_margin, chosen_reward, rejected_reward)."""
    _require("dpo", fields, "ref_logprobs")
    if not (isinstance(beta, (int, float)) and not isinstance(beta, bool) and math.isfinite(beta) and beta > 0):
        raise ValueError(f"dpo: beta must be a finite number > 0, got {beta!r}")
    if not (isinstance(label_smoothing, (int, float)) and 0 <= label_smoothing < 0.5):
        raise ValueError(f"dpo: label_smoothing must be in [0, 0.5), got {label_smoothing!r}")
    seq = fields["seq_index"][:, 0]
    if seq.numel() % 2 or bool((seq[0::2] % 2 != 0).any()) or bool((seq[1::2] != seq[0::2] + 1).any()):
        raise ValueError(f"dpo: the micro-batch holds sequences {seq.tolist()}; it must hold whole pairs (2k chosen, "
                         "2k + 1 rejected): set batch.groups = [0, 0, 1, 1, ...]")
    mask = _mask(fields)
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    policy = torch.where(mask, logp, zero).sum(-1)
    ref = torch.where(mask, fields["ref_logprobs"].to(logp.dtype), zero).sum(-1)
    chosen, rejected = (policy - ref)[0::2], (policy - ref)[1::2]
    z = beta * (chosen - rejected)
    losses = -(1 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)
    metrics = dict(reward_accuracy=(z > 0).to(logp.dtype).mean(), reward_margin=z.mean(),
                   chosen_reward=(beta * chosen).mean(), rejected_reward=(beta * rejected).mean())
    return losses.mean(), {k: v.detach() for k, v in metrics.items()}


def _check_options(op: str, *, loss_agg=None, **clips) -> None:
    if loss_agg is not None and loss_agg not in LOSS_AGGS:
        raise ValueError(f"{op}: loss_agg must be one of {LOSS_AGGS}, got {loss_agg!r}")
    for name, value in clips.items():
        if value is None and name == "clip_low" and op == "cispo":
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ValueError(f"{op}: {name} must be a finite number >= 0, got {value!r}")
        if name == "clip_low" and value >= 1:
            raise ValueError(f"{op}: clip_low must be < 1, got {value!r}")
