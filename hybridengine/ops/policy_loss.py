"""The per-token loss math in plain torch, shared by every loss of the package.

- `LossOptions`: the scalar options of the PPO/GRPO policy loss, declared once. `LossConfig` holds them for
  one `ppo_loss` / `losses.ppo_clip` call; `train.config.PPOConfig` adds them to an optimizer step's.
- `aggregate` / `agg_weights`: a [B, T] loss under a bool mask, reduced by `loss_agg` (token-mean,
  seq-mean-token-mean, seq-mean-token-sum), and the linear weights of that reduction.
- `policy_terms` / `policy_loss`: the clipped surrogate (+ dual clip), the rollout correction's weight, the
  KL estimators and the entropy bonus per token, and the loss and metrics they aggregate to;
  `policy_grad_logp`: dloss/dlogp written out by hand, for the fused path that knows its gradient in the
  forward.
- `check_bt` / `bool_mask`: the checks of a per-token [B, T] argument and of the mask.

The reference (`ppo_loss_ref`), the fused path (`ppo_loss`) and the loss hook (`train.losses.ppo_clip`) run
this same code on their log-probs, so they agree bit for bit on the same log-probs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

from hybridengine import checks

KL_ESTIMATORS = ("k1", "k2", "k3")
LOSS_AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
ROLLOUT_CORRECTIONS = ("tis", "mis")
METRICS = ("pg_loss", "pg_clipfrac", "pg_clipfrac_lower", "ppo_kl", "entropy", "kl_loss", "rollout_corr_weight",
           "rollout_corr_clipfrac", "rollout_corr_logprob_diff")


# --------------------------------------------------------------------------------------------
# the options


@dataclass(kw_only=True)
class LossOptions:
    """The scalar options of the PPO/GRPO policy loss (names as in verl where they exist): the one declaration
    of these fields. `LossConfig` and `PPOConfig` derive from it and add the storage."""

    # No storage here: two bases that both add slots cannot be combined (PPOConfig is also a TrainConfig),
    # so each concrete config's dataclass(slots=True) makes the slots of these fields.
    __slots__ = ()

    clip_low: float = 0.2
    """Lower PPO clip: the ratio is clamped at 1 - clip_low (0 <= clip_low < 1)."""
    clip_high: float = 0.2
    """Upper PPO clip: the ratio is clamped at 1 + clip_high (>= 0)."""
    clip_ratio_c: float | None = None
    """Dual clip (> 1): for A < 0 the per-token loss is capped at -A * clip_ratio_c; None: off."""
    kl_coef: float = 0.0
    """Weight of agg(kl) in the loss; nonzero needs ref_logprobs."""
    kl_estimator: str = "k3"
    """k1, k2 or k3: Schulman's estimators of KL(pi || ref) from samples of pi (`_kl`)."""
    entropy_coef: float = 0.0
    """Weight of -agg(entropy) in the loss."""
    loss_agg: str = "token-mean"
    """token-mean, seq-mean-token-mean or seq-mean-token-sum."""
    rollout_correction: str | None = None
    """None, "tis" or "mis": weight each token's policy-gradient term by `min(r, cap)` ("tis") or by
    `1 / cap <= r <= cap` ("mis"), r = pi_old / pi_rollout = exp(old_logprobs - rollout_logprobs), for
    rollouts whose log-probs differ from the trainer's; needs rollout_logprobs."""
    rollout_correction_cap: float = 2.0
    """The cap of the rollout correction (finite, > 1)."""

    def check_loss(self) -> None:
        """Raise ValueError naming the first bad option (the message names no op: callers prefix theirs)."""
        for name in ("clip_low", "clip_high", "clip_ratio_c", "kl_coef", "entropy_coef"):
            value = getattr(self, name)
            if (value is not None or name != "clip_ratio_c") and (isinstance(value, bool)
                                                                   or not isinstance(value, (int, float))):
                raise ValueError(f"{name} must be a number, got {value!r}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {self.kl_estimator!r}")
        if self.loss_agg not in LOSS_AGGS:
            raise ValueError(f"loss_agg must be one of {LOSS_AGGS}, got {self.loss_agg!r}")
        if not 0 <= self.clip_low < 1:
            raise ValueError(f"clip_low must be in [0, 1), got {self.clip_low}")
        if not self.clip_high >= 0:
            raise ValueError(f"clip_high must be >= 0, got {self.clip_high}")
        if self.clip_ratio_c is not None and not self.clip_ratio_c > 1:
            raise ValueError(f"clip_ratio_c must be > 1 (or None), got {self.clip_ratio_c}")
        for name in ("kl_coef", "entropy_coef"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be finite, got {getattr(self, name)}")
        if self.rollout_correction is not None and self.rollout_correction not in ROLLOUT_CORRECTIONS:
            raise ValueError(f"rollout_correction must be None, 'tis' or 'mis', got {self.rollout_correction!r}")
        cap = self.rollout_correction_cap
        if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not (math.isfinite(cap) and cap > 1):
            raise ValueError(f"rollout_correction_cap must be a finite number > 1, got {cap!r}")


@dataclass(kw_only=True, slots=True)
class LossConfig(LossOptions):
    """The options of one policy-loss call, validated on construction."""

    def __post_init__(self):
        self.check_loss()


LOSS_FIELDS = tuple(f.name for f in fields(LossOptions))
"""The names of the loss options, in declaration order: the keyword arguments of `ppo_loss` and
`losses.ppo_clip` that a `PPOConfig` sets."""


# --------------------------------------------------------------------------------------------
# per-token arguments


def check_bt(op: str, name: str, x, shape, device, *, floating: bool = True) -> None:
    """x is a [B, T] tensor of `shape` on `device` (float unless `floating` is False)."""
    if not isinstance(x, torch.Tensor) or tuple(x.shape) != tuple(shape):
        raise ValueError(f"{op}: {name} must be [B, T] = {list(shape)}, got {checks.describe(x)}")
    checks.tensor(op, name, x, floating=floating, device=device)


def bool_mask(op: str, mask, shape, device, *, strict: bool) -> torch.Tensor:
    """mask [B, T] as bool (strict: 0/1 checked here, one host sync; else by the caller's value check)."""
    check_bt(op, "mask", mask, shape, device, floating=False)
    return checks.mask_bool(op, mask, shape, device, strict=strict)


# --------------------------------------------------------------------------------------------
# aggregation


def aggregate(values: torch.Tensor, mask: torch.Tensor, loss_agg: str) -> torch.Tensor:
    """agg(L) under a bool mask, 0 when nothing is masked in; masked-out entries never reach the sum."""
    masked = torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device))
    if loss_agg == "token-mean":
        return masked.sum() / mask.sum().clamp_min(1).to(values.dtype)
    tokens = mask.sum(-1)
    num_seqs = (tokens > 0).sum().clamp_min(1).to(values.dtype)
    if loss_agg == "seq-mean-token-mean":
        return (masked.sum(-1) / tokens.clamp_min(1).to(values.dtype)).sum() / num_seqs
    return masked.sum() / num_seqs


def agg_weights(mask: torch.Tensor, loss_agg: str, dtype: torch.dtype) -> torch.Tensor:
    """w with agg(L) = sum(w * L) for every L: the linear map `aggregate` applies."""
    m = mask.to(dtype)
    if loss_agg == "token-mean":
        return m / m.sum().clamp_min(1)
    tokens = m.sum(-1, keepdim=True)
    num_seqs = (tokens > 0).sum().clamp_min(1).to(dtype)
    if loss_agg == "seq-mean-token-mean":
        return m / (tokens.clamp_min(1) * num_seqs)
    return m / num_seqs


# --------------------------------------------------------------------------------------------
# the policy terms


def _kl(logp: torch.Tensor, ref: torch.Tensor, estimator: str) -> torch.Tensor:
    if estimator == "k1":
        return logp - ref
    if estimator == "k2":
        return 0.5 * (logp - ref) ** 2
    x = torch.clamp(ref - logp, -20, 20)
    return torch.clamp(torch.exp(x) - x - 1, -10, 10)


def rollout_weight(old: torch.Tensor, rollout: torch.Tensor | None, cfg: LossOptions, dt: torch.dtype
                   ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Per-token (w, flagged) of the rollout correction, (None, None) when it is off: r = exp(old - rollout)
    in `dt` (inf past exp's range, which min() and the band handle), "tis": w = min(r, cap), flagged where
    r > cap; "mis": w = 1 where 1 / cap <= r <= cap, else 0 (flagged). No gradient. w is finite even
    where r is NaN (garbage on masked-out tokens: cap for "tis", 0 for "mis"), so the zero gradient of a
    masked-out token stays zero through `pg * w` (0 * NaN would be NaN)."""
    if cfg.rollout_correction is None:
        return None, None
    cap = cfg.rollout_correction_cap
    r = torch.exp(old.detach().to(dt) - rollout.detach().to(dt))
    if cfg.rollout_correction == "tis":
        kept = r <= cap
        return torch.where(kept, r, cap), ~kept
    inside = (r >= 1 / cap) & (r <= cap)
    return inside.to(dt), ~inside


def policy_terms(logp: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                 ref_logprobs: torch.Tensor | None, cfg: LossOptions, rollout_logprobs: torch.Tensor | None = None
                 ) -> dict[str, torch.Tensor]:
    """Per-token pg (rollout-corrected), kl (None without ref_logprobs), d, the clip indicators (of the
    uncorrected terms) and the rollout correction's (w, flagged) (None when off): the issue's semantics,
    verbatim."""
    dt = logp.dtype
    adv = advantages.to(dt)
    d = torch.clamp(logp - old_logprobs.to(dt), -20, 20)
    ratio = torch.exp(d)
    pg1 = -adv * ratio
    pg2 = -adv * torch.clamp(ratio, 1 - cfg.clip_low, 1 + cfg.clip_high)
    pg = torch.maximum(pg1, pg2)
    clipped = pg2 > pg1
    if cfg.clip_ratio_c is not None:
        pg3 = -adv * cfg.clip_ratio_c
        dual = (adv < 0) & (pg > pg3)
        pg = torch.where(adv < 0, torch.minimum(pg, pg3), pg)
    else:
        dual = torch.zeros_like(clipped)
    w, flagged = rollout_weight(old_logprobs, rollout_logprobs, cfg, dt)
    if w is not None:
        pg = pg * w
    kl = None if ref_logprobs is None else _kl(logp, ref_logprobs.to(dt), cfg.kl_estimator)
    return dict(pg=pg, kl=kl, d=d, clipped=clipped, dual=dual, rollout_weight=w, rollout_flagged=flagged)


def policy_loss(logp: torch.Tensor, entropy: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, ref_logprobs: torch.Tensor | None, cfg: LossOptions,
                rollout_logprobs: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """loss and metrics (`METRICS`, detached) from per-token logp and entropy [B, T] under a bool mask."""
    dt = logp.dtype
    terms = policy_terms(logp, old_logprobs, advantages, ref_logprobs, cfg, rollout_logprobs)
    agg = lambda x: aggregate(x, mask, cfg.loss_agg)  # noqa: E731
    token_mean = lambda x: aggregate(x, mask, "token-mean")  # noqa: E731
    pg_loss = agg(terms["pg"])
    ent = agg(entropy)
    kl_loss = torch.zeros((), dtype=dt, device=logp.device) if terms["kl"] is None else agg(terms["kl"])
    loss = pg_loss - cfg.entropy_coef * ent + cfg.kl_coef * kl_loss
    w, flagged = terms["rollout_weight"], terms["rollout_flagged"]
    zeros = torch.zeros_like(logp)
    diff = zeros if rollout_logprobs is None else (old_logprobs.to(dt) - rollout_logprobs.to(dt)).abs()
    metrics = dict(pg_loss=pg_loss, pg_clipfrac=token_mean(terms["clipped"].to(dt)),
                   pg_clipfrac_lower=token_mean(terms["dual"].to(dt)), ppo_kl=token_mean(-terms["d"]), entropy=ent,
                   kl_loss=kl_loss, rollout_corr_weight=token_mean(torch.ones_like(logp) if w is None else w),
                   rollout_corr_clipfrac=token_mean(zeros if flagged is None else flagged.to(dt)),
                   rollout_corr_logprob_diff=token_mean(diff))
    return loss, {k: v.detach() for k, v in metrics.items()}


def policy_grad_logp(logp, old, adv, ref, weights, cfg: LossOptions, rollout_weight=None) -> torch.Tensor:
    """dloss/dlogp per token (1-D), written out by hand with torch autograd's conventions for the
    same expressions as `policy_loss`: clamp passes the gradient on its closed interval, maximum and
    minimum split it in half on ties, where() routes it to the chosen branch. weights: `agg_weights`
    per token; rollout_weight: the rollout correction's w per token (`rollout_weight`), None when off."""
    dt = logp.dtype
    adv = adv.to(dt)
    raw = logp - old.to(dt)
    d = raw.clamp(-20, 20)
    ratio = torch.exp(d)
    lo, hi = 1 - cfg.clip_low, 1 + cfg.clip_high
    pg1 = -adv * ratio
    pg2 = -adv * ratio.clamp(lo, hi)
    g1 = -adv  # dpg1/dratio
    g2 = torch.where((ratio >= lo) & (ratio <= hi), -adv, 0.0)  # dpg2/dratio
    g = torch.where(pg1 > pg2, g1, torch.where(pg1 < pg2, g2, 0.5 * (g1 + g2)))
    if cfg.clip_ratio_c is not None:
        pg = torch.maximum(pg1, pg2)
        pg3 = -adv * cfg.clip_ratio_c
        capped = torch.where(pg < pg3, g, torch.where(pg == pg3, 0.5 * g, 0.0))
        g = torch.where(adv < 0, capped, g)
    grad = g * ratio * ((raw >= -20) & (raw <= 20)).to(dt)
    if rollout_weight is not None:
        grad = grad * rollout_weight
    if ref is not None and cfg.kl_coef != 0:
        ref = ref.to(dt)
        if cfg.kl_estimator == "k1":
            dkl = torch.ones_like(logp)
        elif cfg.kl_estimator == "k2":
            dkl = logp - ref
        else:
            x_raw = ref - logp
            x = x_raw.clamp(-20, 20)
            k3 = torch.exp(x) - x - 1
            live = (x_raw >= -20) & (x_raw <= 20) & (k3 >= -10) & (k3 <= 10)
            dkl = torch.where(live, 1 - torch.exp(x), 0.0)
        grad = grad + cfg.kl_coef * dkl
    # A zero weight zeroes the gradient even where the masked-out inputs are inf or NaN.
    return torch.where(weights != 0, weights * grad, 0.0)
