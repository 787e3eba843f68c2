"""The RL losses and advantage estimators written again from their definitions: the tests' truth.

Nothing here imports `hybridengine`, and nothing is shaped like its code: the policy loss is the
clipped surrogate written case by case on the sign of the advantage (the package takes maxima and
minima of two candidate losses), aggregations and estimators are loops over sequences and steps.
A mistake in the package's loss math, shared by its reference and its fused path, therefore cannot
also be in the truth they are compared with.

The losses run in float64 for float64 inputs; other inputs run in float32 after the one rounding
the package's precision contract names (the logits `hidden @ weight.T + bias` are formed in the
inputs' dtype, one rounding as in a GEMM with bias). The tests use the float64 run as the truth and
the float32 run to measure how far plain float32 arithmetic lands from it on the same inputs (the
tolerance's scale). GRPO and whitening run on Python floats (float64); GAE in the dtype it is given.

Conventions restated from `hybridengine.ops.ppo_loss` (its docstrings, not its code):

- `z = (hidden @ weight.T + bias) / temperature`, `logp = log softmax(z)[target]`, entropy
  `-sum_v p_v log p_v` of `softmax(z)`.
- `r = pi / pi_old = exp(logp - old)`, with the log-ratio clamped to [-20, 20] (a guard against
  exp overflow). Per token, with advantage A, the clipped surrogate loss is
  `-A * min(r, 1 + clip_high)` for A > 0 and `-A * max(r, 1 - clip_low)` for A < 0 (PPO's
  pessimistic bound, DAPO's asymmetric clip: the ratio lives in [1 - clip_low, 1 + clip_high]), 0
  for A = 0. Dual clip (c > 1, A < 0 only): the loss is capped at `-A * c`, i.e. at r = c.
  `pg_clipfrac` counts tokens where the clip bound is the active one; `pg_clipfrac_lower` those
  where the dual cap is.
- KL(pi || ref) estimated from samples of pi (Schulman, "Approximating KL divergence"), with
  `rho = pi_ref / pi = exp(ref - logp)`: k1 = -log rho, k2 = (log rho)^2 / 2,
  k3 = (rho - 1) - log rho (verl's "low_var_kl"; log rho clamped to [-20, 20] and k3 to [-10, 10],
  verl's guards).
- Aggregation of per-token values L under the response mask: "token-mean" = sum L / tokens;
  "seq-mean-token-mean" = mean over sequences with at least one token of each one's token mean;
  "seq-mean-token-sum" = mean over those sequences of each one's token sum. 0 without tokens.
- `loss = agg(pg) - entropy_coef * agg(entropy) + kl_coef * agg(kl)`; `ppo_kl` = token mean of
  `old - logp` (the clamped log-ratio, negated).
- Value loss: `0.5 * agg(max((v - R)^2, (clamp(v, v_old - clip, v_old + clip) - R)^2))`.
- GAE over the steps where the mask is 1 (masked steps do not exist, the last step bootstraps with
  0), GRPO's group-normalised scores (unbiased std, eps added to the std; a lone sample gets 0),
  masked whitening (unbiased variance, eps under the root).
"""

from __future__ import annotations

import math
import statistics

import torch

LOG_RATIO_CLAMP = 20.0
K3_CLAMP = 10.0


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# --------------------------------------------------------------------------------------------
# the LM head


def token_logprobs(hidden, weight, targets, *, bias=None, temperature=1.0):
    """(logp, entropy) [B, T] of `softmax((hidden @ weight.T + bias) / temperature)` at targets.

    Targets outside [0, V) (padding) give logp 0; callers mask them out."""
    x = torch.nn.functional.linear(hidden, weight, bias)  # one rounding to the inputs' dtype, bias included
    dt = compute_dtype(hidden.dtype)
    z = x.to(dt) / temperature
    log_p = torch.log_softmax(z, dim=-1)  # torch's, so the float32 run measures plain torch's float32 error
    entropy = -(torch.exp(log_p) * log_p).sum(-1)
    vocab = weight.shape[0]
    inside = (targets >= 0) & (targets < vocab)
    safe = torch.where(inside, targets, torch.zeros_like(targets)).long()
    logp = torch.where(inside, torch.gather(log_p, -1, safe.unsqueeze(-1)).squeeze(-1), 0.0)
    return logp, entropy


# --------------------------------------------------------------------------------------------
# per-token policy terms (1-D tensors over the masked-in tokens)


def surrogate(logp, old, adv, *, clip_low, clip_high, clip_ratio_c=None):
    """(loss, clip_active, dual_active) per token: the clipped surrogate case by case on sign(A)."""
    log_ratio = torch.clamp(logp - old, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    r = torch.exp(log_ratio)
    upper, lower = 1.0 + clip_high, 1.0 - clip_low
    # A > 0: more probability helps, up to r = 1 + clip_high; past it the objective is flat.
    pos_clipped = (adv > 0) & (r > upper)
    # A < 0: less probability helps, down to r = 1 - clip_low; below it the objective is flat.
    neg_clipped = (adv < 0) & (r < lower)
    loss = torch.where(pos_clipped, -adv * upper, torch.where(neg_clipped, -adv * lower, -adv * r))
    dual = torch.zeros_like(pos_clipped)
    if clip_ratio_c is not None:
        # A < 0 and r > c: the loss -A r would grow without bound; capped at -A c (flat in r).
        dual = (adv < 0) & (r > clip_ratio_c)
        loss = torch.where(dual, -adv * clip_ratio_c, loss)
    return loss, pos_clipped | neg_clipped, dual


def kl_estimate(logp, ref, estimator):
    """Per-token estimate of KL(pi || ref) from a sample of pi; rho = pi_ref / pi."""
    log_rho = ref - logp
    if estimator == "k1":
        return -log_rho
    if estimator == "k2":
        return 0.5 * log_rho * log_rho
    if estimator == "k3":
        log_rho = torch.clamp(log_rho, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        return torch.clamp(torch.exp(log_rho) - 1.0 - log_rho, -K3_CLAMP, K3_CLAMP)
    raise ValueError(f"unknown KL estimator {estimator!r}")


# --------------------------------------------------------------------------------------------
# aggregation


def aggregate(per_token, mask, loss_agg):
    """agg of per-token values [B, T] over mask [B, T], a loop over the sequences; entries where the
    mask is 0 are never read (they may hold NaN)."""
    rows = [per_token[b][mask[b].bool()] for b in range(mask.shape[0])]
    zero = per_token.new_zeros(())
    if loss_agg == "token-mean":
        tokens = sum(len(r) for r in rows)
        return sum((r.sum() for r in rows), zero) / tokens if tokens else zero
    present = [r for r in rows if len(r)]
    if not present:
        return zero
    if loss_agg == "seq-mean-token-mean":
        return sum((r.sum() / len(r) for r in present), zero) / len(present)
    if loss_agg == "seq-mean-token-sum":
        return sum((r.sum() for r in present), zero) / len(present)
    raise ValueError(f"unknown aggregation {loss_agg!r}")


def _place(values, mask):
    """Values of the masked-in tokens (row-major order) back onto [B, T], 0 elsewhere."""
    out = torch.zeros(mask.shape, dtype=values.dtype, device=values.device)
    return out.masked_scatter(mask, values) if values.numel() else out


# --------------------------------------------------------------------------------------------
# losses


def ppo_loss(hidden, weight, targets, old_logprobs, advantages, mask, *, bias=None, temperature=1.0,
             clip_low=0.2, clip_high=0.2, clip_ratio_c=None, ref_logprobs=None, kl_coef=0.0, kl_estimator="k3",
             entropy_coef=0.0, loss_agg="token-mean"):
    """(loss, metrics) of the PPO/GRPO policy loss; differentiable in hidden, weight and bias."""
    mask = mask.bool()
    logp_all, entropy = token_logprobs(hidden, weight, targets, bias=bias, temperature=temperature)
    dt = logp_all.dtype
    logp = logp_all[mask]
    old, adv = old_logprobs.to(dt)[mask], advantages.to(dt)[mask]
    pg, clipped, dual = surrogate(logp, old, adv, clip_low=clip_low, clip_high=clip_high, clip_ratio_c=clip_ratio_c)
    agg = lambda values: aggregate(_place(values, mask), mask, loss_agg)  # noqa: E731
    token_mean = lambda values: aggregate(_place(values, mask), mask, "token-mean")  # noqa: E731
    pg_loss, ent = agg(pg), aggregate(entropy, mask, loss_agg)
    kl_loss = logp_all.new_zeros(())
    if ref_logprobs is not None:
        kl_loss = agg(kl_estimate(logp, ref_logprobs.to(dt)[mask], kl_estimator))
    loss = pg_loss - entropy_coef * ent + kl_coef * kl_loss
    log_ratio = torch.clamp(logp - old, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    metrics = dict(pg_loss=pg_loss, pg_clipfrac=token_mean(clipped.to(dt)), pg_clipfrac_lower=token_mean(dual.to(dt)),
                   ppo_kl=token_mean(-log_ratio), entropy=ent, kl_loss=kl_loss)
    return loss, {k: v.detach() for k, v in metrics.items()}


def value_loss(values, old_values, returns, mask, *, clip=0.2, loss_agg="token-mean"):
    """0.5 * agg of the larger of the plain and the clipped squared error, element by element."""
    dt = compute_dtype(values.dtype)
    v, old, ret = values.to(dt), old_values.to(dt), returns.to(dt)
    err = (v - ret) ** 2
    if clip is not None:
        v_clipped = torch.minimum(torch.maximum(v, old - clip), old + clip)
        err = torch.where((v_clipped - ret) ** 2 > err, (v_clipped - ret) ** 2, err)
    return 0.5 * aggregate(err, mask, loss_agg)


# --------------------------------------------------------------------------------------------
# advantage estimators


def gae(rewards, values, mask, gamma, lam, dtype=torch.float64):
    """Per row: drop the masked steps, run textbook GAE on what is left, put the results back.
    Every operation in `dtype` (0-dim tensors: one rounding per operation, textbook order)."""
    B, T = rewards.shape
    adv = torch.zeros(B, T, dtype=dtype)
    ret = torch.zeros(B, T, dtype=dtype)
    g, gl = torch.tensor(gamma, dtype=dtype), torch.tensor(gamma * lam, dtype=dtype)
    for b in range(B):
        steps = [t for t in range(T) if mask[b, t]]
        last = torch.tensor(0.0, dtype=dtype)
        for k in reversed(range(len(steps))):
            t = steps[k]
            next_value = values[b, steps[k + 1]].to(dtype) if k + 1 < len(steps) else torch.tensor(0.0, dtype=dtype)
            delta = rewards[b, t].to(dtype) + g * next_value - values[b, t].to(dtype)
            last = delta + gl * last
            adv[b, t] = last
            ret[b, t] = last + values[b, t].to(dtype)
    return adv, ret


def grpo(scores, groups, eps, norm_by_std):
    """groups: a label per sample. Unbiased std (statistics.stdev); a lone sample gets 0.
    norm_by_std=False is Dr. GRPO's mean-only centring."""
    scores = [float(s) for s in scores]
    out = [0.0] * len(scores)
    for label in set(groups):
        members = [i for i, g in enumerate(groups) if g == label]
        if len(members) < 2:
            continue
        values = [scores[i] for i in members]
        mean = statistics.fmean(values)
        std = statistics.stdev(values)
        for i in members:
            out[i] = (scores[i] - mean) / (std + eps) if norm_by_std else scores[i] - mean
    return torch.tensor(out, dtype=torch.float64)


def whiten(x, mask, shift_mean, eps):
    """Masked (x - mean) / sqrt(var + eps) over all rows jointly; unbiased var; 0 where mask is 0."""
    xs = [float(v) for v, m in zip(x.flatten(), mask.flatten()) if m]
    out = torch.zeros(x.numel(), dtype=torch.float64)
    if not xs:
        return out.view(x.shape)
    mean = statistics.fmean(xs)
    var = statistics.variance(xs, mean) if len(xs) > 1 else 0.0
    for i, (v, m) in enumerate(zip(x.flatten(), mask.flatten())):
        if m:
            out[i] = (float(v) - mean) / math.sqrt(var + eps) + (0.0 if shift_mean else mean)
    return out.view(x.shape)
