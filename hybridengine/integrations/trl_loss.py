"""TRL's GRPO objective in plain torch, for `HybridGRPOTrainer` (`hybridengine.integrations.trl`).

`grpo_loss` is `GRPOTrainer._compute_loss` (every `loss_type`) written as a function of the per-token
log-probs and entropies of the engine's fused LM-head pass and the batch's per-token fields; `token_weights`
turns TRL's per-micro-batch normalisations (`grpo`, `bnpo`, `dr_grpo`, `dapo`, ...) into per-token weights, so
one engine step over a whole gradient-accumulation window has TRL's objective whatever the engine's own
micro-batching; `importance_sampling_ratio` is TRL's correction of a rollout sampled by another engine.
`GRPOLossConfig` holds the loss's knobs, named as in `GRPOConfig`. Nothing here imports TRL.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["GRPOLossConfig", "IS_MODES", "LOSS_TYPES", "grpo_loss", "importance_sampling_ratio", "token_weights"]

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
"""TRL's `loss_type` values `grpo_loss` implements (all of TRL's)."""
IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
"""TRL's `vllm_importance_sampling_mode` values `importance_sampling_ratio` implements (all of TRL's)."""


@dataclass(kw_only=True, slots=True)
class GRPOLossConfig:
    """The knobs of TRL's GRPO loss (`GRPOTrainer._compute_loss`), named as in `GRPOConfig`."""

    loss_type: str = "dapo"
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    delta: float | None = None
    """Upper clip of the unclipped ratio (two-sided clipping); None: off."""
    beta: float = 0.0
    """KL coefficient (k3 estimator against `ref_logprobs`)."""
    use_bias_correction_kl: bool = True
    """Multiply the KL term by the importance ratio."""
    importance_sampling_level: str = "token"
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    off_policy_mask_threshold: float | None = None
    entropy_coef: float = 0.0
    is_correction: bool = False
    """Weigh each token by the `is_ratio` field (TRL's vLLM importance-sampling correction)."""

    def __post_init__(self):
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"GRPOLossConfig.loss_type must be one of {LOSS_TYPES}, got {self.loss_type!r}")
        if self.importance_sampling_level not in ("token", "sequence"):
            raise ValueError(f"GRPOLossConfig.importance_sampling_level must be 'token' or 'sequence', got "
                             f"{self.importance_sampling_level!r}")

    @classmethod
    def from_args(cls, args, *, is_correction: bool) -> "GRPOLossConfig":
        return cls(loss_type=args.loss_type, epsilon_low=args.epsilon,
                   epsilon_high=args.epsilon_high if args.epsilon_high is not None else args.epsilon,
                   delta=args.delta, beta=args.beta, use_bias_correction_kl=args.use_bias_correction_kl,
                   importance_sampling_level=args.importance_sampling_level,
                   sapo_temperature_pos=args.sapo_temperature_pos, sapo_temperature_neg=args.sapo_temperature_neg,
                   vespo_k_pos=args.vespo_k_pos, vespo_lambda_pos=args.vespo_lambda_pos,
                   vespo_k_neg=args.vespo_k_neg, vespo_lambda_neg=args.vespo_lambda_neg,
                   off_policy_mask_threshold=args.off_policy_mask_threshold, entropy_coef=args.entropy_coef,
                   is_correction=is_correction)


def grpo_loss(logp: torch.Tensor, entropy: torch.Tensor | None, fields: dict, cfg: GRPOLossConfig,
              stats: dict | None = None) -> torch.Tensor:
    """TRL's GRPO objective (`GRPOTrainer._compute_loss`, every `loss_type`) over one micro-batch of tokens.

    logp, entropy: per-token log-probs (at the sampling temperature) and entropies of the target tokens,
    any shape; `fields` holds tensors of the same shape: `mask` (1 on trained completion tokens),
    `advantages` (the sequence's advantage on each of its tokens), `seq_index` (each token's sequence
    index), `weight` (the token's share of the objective: `token_weights`), and as the config
    needs them `old_logprobs` (absent: on-policy, `logp.detach()`), `ref_logprobs` (beta > 0),
    `rollout_logprobs` (the sampler's; the off-policy mask reads them), `is_ratio` (the importance-sampling
    correction, 1 outside completions), `entropy_weight` (entropy_coef != 0). Sequence-level quantities
    (GSPO's ratio, the off-policy mask, VESPO's weights) reduce over each sequence's tokens, so a sequence
    must lie whole in one call. Returns sum(weight * mask * per-token loss) - entropy_coef *
    sum(entropy_weight * mask * entropy). `stats`, when given, accumulates detached metric sums."""
    f = {k: v.reshape(-1) if isinstance(v, torch.Tensor) else v for k, v in fields.items()}
    logp = logp.reshape(-1).float()
    mask, adv, weight = f["mask"].float(), f["advantages"].float(), f["weight"].float()
    seq = f["seq_index"].long().clamp(min=0)
    old = f.get("old_logprobs")
    old = logp.detach() if old is None else old.float()
    num_seqs = int(seq.max()) + 1 if seq.numel() else 0

    def seq_sum(x):  # per-sequence sums, broadcast back onto the tokens
        return torch.zeros(num_seqs, dtype=x.dtype, device=x.device).index_add_(0, seq, x)[seq]

    seq_tokens = seq_sum(mask).clamp(min=1.0)
    log_ratio = logp - old
    if cfg.importance_sampling_level == "token":
        log_iw = log_ratio
    else:  # GSPO: the sequence's mean log-ratio on each of its tokens
        log_iw = seq_sum(log_ratio * mask) / seq_tokens
    coef_1 = torch.exp(log_iw)

    if cfg.beta != 0.0:
        d = f["ref_logprobs"].float() - logp
        kl = torch.exp(d) - d - 1
        if cfg.use_bias_correction_kl:
            kl = kl * coef_1

    lt = cfg.loss_type
    if lt == "cispo":
        per_token = -torch.clamp(coef_1, max=cfg.epsilon_high).detach() * adv * logp
    elif lt in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
        coef_2 = torch.clamp(coef_1, 1 - cfg.epsilon_low, 1 + cfg.epsilon_high)
        unclipped = coef_1 if cfg.delta is None else torch.clamp(coef_1, max=cfg.delta)
        per_token = -torch.min(unclipped * adv, coef_2 * adv)
    elif lt == "sapo":
        temps = torch.where(adv > 0, cfg.sapo_temperature_pos, cfg.sapo_temperature_neg)
        per_token = -torch.sigmoid(temps * (coef_1 - 1)) * 4 / temps * adv
    else:  # vespo
        with torch.no_grad():
            lower = math.log(1e-8)
            seq_log_w = seq_sum(torch.clamp(log_ratio, -20.0, 20.0) * mask)
            if cfg.is_correction:
                log_is = torch.clamp(torch.log(f["is_ratio"].float()), lower, 20.0)
                if "valid" in f:  # TRL sums over a row's completion columns: not the padding past them
                    log_is = log_is * f["valid"].float()
                seq_log_w = seq_log_w + seq_sum(log_is)
            log_w = torch.clamp(seq_log_w, lower, 20.0)
            nonneg = adv >= 0
            k = torch.where(nonneg, cfg.vespo_k_pos, cfg.vespo_k_neg)
            lam = torch.where(nonneg, cfg.vespo_lambda_pos, cfg.vespo_lambda_neg).clamp(min=1e-4)
            phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
        per_token = -phi * adv * logp

    if cfg.off_policy_mask_threshold is not None:
        sampling = f.get("rollout_logprobs")
        sampling = old if sampling is None else sampling.float()
        seq_kl = seq_sum(torch.nan_to_num(sampling - logp.detach(), nan=0.0) * mask) / seq_tokens
        per_token = per_token * ((adv >= 0) | (seq_kl <= cfg.off_policy_mask_threshold)).float()
    if cfg.is_correction and lt != "vespo":
        per_token = per_token * f["is_ratio"].float()
    if cfg.beta != 0.0:
        per_token = per_token + cfg.beta * kl

    loss = (per_token * mask * weight).sum()
    if cfg.entropy_coef != 0.0:
        loss = loss - cfg.entropy_coef * (entropy.reshape(-1).float() * mask * f["entropy_weight"].float()).sum()

    if stats is not None:
        with torch.no_grad():
            _add(stats, "tokens", mask.sum())
            if entropy is not None:
                _add(stats, "entropy", (entropy.reshape(-1).float() * mask).sum())
            if cfg.beta != 0.0:
                _add(stats, "kl", (kl * mask).sum())
            if lt in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
                low = (coef_1 < 1 - cfg.epsilon_low) & (adv < 0)
                high = (coef_1 > 1 + cfg.epsilon_high) & (adv > 0)
                _add(stats, "clip_ratio/low_mean", (low * mask).sum())
                _add(stats, "clip_ratio/high_mean", (high * mask).sum())
                _add(stats, "clip_ratio/region_mean", ((low | high) * mask).sum())
            elif lt == "cispo":
                _add(stats, "cispo_clip_ratio", (((coef_1 > cfg.epsilon_high) & (adv > 0)) * mask).sum())
    return loss


def _add(stats: dict, key: str, value: torch.Tensor) -> None:
    stats[key] = stats.get(key, 0.0) + value.detach().float()


def token_weights(loss_type: str, completion_mask: torch.Tensor, *, accumulation_steps: int,
                  max_completion_length: int, num_items_in_batch: float | None = None, num_processes: int = 1,
                  steps_per_generation: int = 1, training: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token weights of one TRL micro-batch ([B, C] completion mask): (policy weight, entropy weight),
    so that sum(weight * mask * per-token loss) is the loss `GRPOTrainer._compute_loss` returns for the
    micro-batch, normalisation for gradient accumulation included (`training`; in evaluation TRL divides
    by neither the accumulation steps nor, for dapo/cispo/vespo, steps_per_generation)."""
    mask = completion_mask.float()
    rows = mask.shape[0]
    accum = accumulation_steps if training else 1
    if loss_type in ("grpo", "sapo"):
        w = 1.0 / (rows * mask.sum(-1, keepdim=True).clamp(min=1.0) * accum)
    elif loss_type == "bnpo":
        w = 1.0 / (mask.sum().clamp(min=1.0) * accum)
    elif loss_type == "dr_grpo":
        w = torch.tensor(1.0 / (rows * max_completion_length * accum))
    elif loss_type in ("dapo", "cispo", "vespo"):
        normalizer = max(float(num_items_in_batch), 1.0) / num_processes
        if training:
            normalizer *= accumulation_steps / steps_per_generation
        w = torch.tensor(1.0 / normalizer)
    elif loss_type == "luspo":
        w = torch.tensor(1.0 / (rows * accum))
    else:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    entropy_w = 1.0 / (mask.sum().clamp(min=1.0) * accum)
    return torch.broadcast_to(w, mask.shape).clone(), torch.broadcast_to(entropy_w, mask.shape).clone()


def importance_sampling_ratio(old: torch.Tensor, sampling: torch.Tensor, mask: torch.Tensor, mode: str,
                              clip_min: float | None, clip_max: float | None) -> torch.Tensor:
    """TRL's importance-sampling correction of a rollout sampled by another engine: exp(old - sampling)
    per token ([B, C]) or per sequence ([B, 1]), truncated (`*_truncate`: clamp to [clip_min, clip_max])
    or masked (`*_mask`: 0 outside it)."""
    diff = torch.nan_to_num((old - sampling) * mask, nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    low = clip_min if clip_min is not None else -math.inf
    high = clip_max if clip_max is not None else math.inf
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)
