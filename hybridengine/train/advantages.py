"""Advantage estimators and reward shaping for RL post-training, in plain torch.

- `gae`: generalised advantage estimation over token-level rewards and values (PPO with a critic).
- `grpo_advantages`: group-normalised outcome advantages over the n samples of each prompt (GRPO;
  `norm_by_std=False` gives Dr. GRPO's mean-only centring).
- `whiten`: masked mean/variance normalisation (advantage or reward whitening).
- `broadcast_to_tokens`: one scalar per sample onto each of its response tokens.

Masks are [B, T] bool, or integer/float holding only 0 and 1 (checked; one host sync); 1 marks a
response token. Every result is 0 where the mask is 0. Results are fp32 (fp64 for fp64 inputs).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from hybridengine import checks


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, *, gamma: float = 1.0,
        lam: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns), each [B, T], from token-level rewards, values and mask [B, T].

    `delta_t = r_t + gamma * V_next - V_t`, `A_t = delta_t + gamma * lam * A_next`, where "next"
    is the next step *with mask 1* in the row: masked steps do not exist (their rewards and values
    are ignored, and a gap does not cut the recursion), and the last valid step bootstraps with
    V_next = 0, A_next = 0 (the response ended). `returns = advantages + values`. Both are 0 where
    mask is 0. A loop over T of O(B) torch ops (no host syncs beyond the mask check)."""
    op = "gae"
    _check_float(op, "rewards", rewards, dims=2)
    shape, device = rewards.shape, rewards.device
    _check_float(op, "values", values, shape=shape, device=device)
    valid = checks.mask_bool(op, mask, shape, device)
    _check_unit_interval(op, "gamma", gamma)
    _check_unit_interval(op, "lam", lam)
    dtype = _result_dtype(rewards, values)
    r, v = rewards.to(dtype), values.to(dtype)
    B, T = shape
    advantages = torch.zeros(B, T, dtype=dtype, device=device)
    next_value = torch.zeros(B, dtype=dtype, device=device)
    next_advantage = torch.zeros(B, dtype=dtype, device=device)
    zero = torch.zeros((), dtype=dtype, device=device)
    for t in reversed(range(T)):
        delta = r[:, t] + gamma * next_value - v[:, t]
        a = delta + (gamma * lam) * next_advantage
        valid_t = valid[:, t]
        advantages[:, t] = torch.where(valid_t, a, zero)
        next_value = torch.where(valid_t, v[:, t], next_value)
        next_advantage = torch.where(valid_t, a, next_advantage)
    returns = torch.where(valid, advantages + v, zero)
    return advantages, returns


def grpo_advantages(scores: torch.Tensor, group_size: int | None = None, *,
                    group_ids: torch.Tensor | Sequence | None = None, eps: float = 1e-6,
                    norm_by_std: bool = True) -> torch.Tensor:
    """Group-normalised advantages [num_samples] from one scalar score per sample.

    Groups are `group_size` consecutive samples (the n samples of one prompt, as the rollout
    returns them) or, instead, `group_ids` [num_samples]: an integer tensor or a sequence of
    hashable labels (e.g. prompt uids), any order. Each sample gets `(score - mean) / (std + eps)`
    over its group, or `score - mean` with `norm_by_std=False`.

    std is the unbiased (n - 1) estimate, torch.std's default and what verl uses. A group of one
    sample gives 0 (verl returns the raw score there: no baseline exists, so no signal is the
    safer choice). Groups with equal scores give exactly 0: the mean is taken of the offsets
    from the group's minimum, which are exactly 0 then. Computed in fp64 (the vectors are small),
    returned as fp32 (fp64 for fp64 scores)."""
    op = "grpo_advantages"
    if not isinstance(scores, torch.Tensor) or scores.dim() != 1:
        raise ValueError(f"{op}: scores must be a 1-D tensor [num_samples], got {checks.describe(scores)}")
    if scores.dtype == torch.bool or scores.is_complex():
        raise ValueError(f"{op}: scores must be a float or integer tensor, got {scores.dtype}")
    num_samples, device = scores.numel(), scores.device
    if not (isinstance(eps, (int, float)) and not isinstance(eps, bool) and math.isfinite(eps) and eps >= 0):
        raise ValueError(f"{op}: eps must be a finite number >= 0, got {eps!r}")
    if (group_size is None) == (group_ids is None):
        raise ValueError(f"{op}: pass exactly one of group_size and group_ids")
    if group_size is not None:
        if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 1:
            raise ValueError(f"{op}: group_size must be an int >= 1, got {group_size!r}")
        if num_samples % group_size:
            raise ValueError(f"{op}: group_size = {group_size} does not divide the {num_samples} samples")
        inverse = torch.arange(num_samples, device=device) // group_size
        num_groups = num_samples // group_size
    else:
        inverse, num_groups = _group_index(op, group_ids, num_samples, device)
    out_dtype = _result_dtype(scores)
    x = scores.to(torch.float64)
    zeros = torch.zeros(num_groups, dtype=torch.float64, device=device)
    counts = zeros.index_add(0, inverse, torch.ones_like(x))
    shift = zeros.scatter_reduce(0, inverse, x, "amin", include_self=False)
    d = x - shift[inverse]
    centred = d - (zeros.index_add(0, inverse, d) / counts.clamp_min(1))[inverse]
    if norm_by_std:
        var = zeros.index_add(0, inverse, centred * centred) / (counts - 1).clamp_min(1)
        centred = centred / (var.sqrt() + eps)[inverse]
    return torch.where(counts[inverse] > 1, centred, 0.0).to(out_dtype)


def whiten(x: torch.Tensor, mask: torch.Tensor, *, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """`(x - mean) / sqrt(var + eps)` over the elements where mask is 1 (jointly, all rows), 0 elsewhere.

    mean and var are masked; var is unbiased (n - 1), as in verl's and TRL's `masked_whiten`. With
    `shift_mean=False` the mean is added back (scale only). One valid element: var = 0, so the
    result is 0 (the mean with shift_mean=False); no valid element: all zeros."""
    op = "whiten"
    _check_float(op, "x", x)
    valid = checks.mask_bool(op, mask, x.shape, x.device)
    if not (isinstance(eps, (int, float)) and not isinstance(eps, bool) and math.isfinite(eps) and eps > 0):
        raise ValueError(f"{op}: eps must be a finite number > 0, got {eps!r}")
    dtype = _result_dtype(x)
    xf = x.to(dtype)
    zero = torch.zeros((), dtype=dtype, device=x.device)
    n = valid.sum().to(dtype)
    mean = torch.where(valid, xf, zero).sum() / n.clamp_min(1)
    centred = torch.where(valid, xf - mean, zero)
    var = (centred * centred).sum() / (n - 1).clamp_min(1)
    out = centred * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(valid, out, zero)


def broadcast_to_tokens(per_sample: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, T]: per_sample[b] on every token of row b where mask is 1, 0 elsewhere (e.g. a GRPO
    advantage onto the response tokens). Keeps per_sample's float dtype."""
    op = "broadcast_to_tokens"
    _check_float(op, "per_sample", per_sample, dims=1)
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        raise ValueError(f"{op}: mask must be a [B, T] tensor, got {checks.describe(mask)}")
    valid = checks.mask_bool(op, mask, (per_sample.shape[0], mask.shape[1]), per_sample.device)
    return torch.where(valid, per_sample[:, None], torch.zeros((), dtype=per_sample.dtype, device=mask.device))


# --------------------------------------------------------------------------------------------
# validation helpers


def _result_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """fp64 if any input is fp64, else fp32 (bf16/fp16 inputs are upcast: these are sums over many terms)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _check_float(op: str, name: str, x, *, dims: int | None = None, shape=None, device=None) -> None:
    """A float tensor (of `dims` dims, named [B, T] or [B]; of `shape`; on `device`)."""
    checks.tensor(op, name, x, floating=True, shape=shape, device=device)
    if dims is not None and x.dim() != dims:
        expected = "[B, T]" if dims == 2 else "[B]"
        raise ValueError(f"{op}: {name} must be {expected}, got shape {tuple(x.shape)}")


def _check_unit_interval(op: str, name: str, value) -> None:
    if not (isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= 1):
        raise ValueError(f"{op}: {name} must be a number in [0, 1], got {value!r}")


def _group_index(op: str, group_ids, num_samples: int, device) -> tuple[torch.Tensor, int]:
    """(inverse [num_samples] int64 on device, number of groups) from ids: an int tensor or labels."""
    if isinstance(group_ids, torch.Tensor):
        if group_ids.shape != (num_samples,) or group_ids.is_floating_point() or group_ids.is_complex() \
                or group_ids.dtype == torch.bool:
            raise ValueError(f"{op}: group_ids must be an integer tensor [{num_samples}] (scores' length) or a "
                             f"sequence of labels, got {checks.describe(group_ids)}")
        labels, inverse = torch.unique(group_ids.to(device), return_inverse=True)
        return inverse, labels.numel()
    if isinstance(group_ids, (str, bytes)) or not hasattr(group_ids, "__len__"):  # lists, tuples, numpy arrays
        raise ValueError(f"{op}: group_ids must be an integer tensor or a sequence of labels, got "
                         f"{type(group_ids).__name__}")
    if len(group_ids) != num_samples:
        raise ValueError(f"{op}: group_ids has {len(group_ids)} entries, scores {num_samples}")
    first_seen: dict = {}
    try:
        index = [first_seen.setdefault(label, len(first_seen)) for label in group_ids]
    except TypeError as e:  # unhashable labels
        raise ValueError(f"{op}: group_ids labels must be hashable ({e})") from None
    return torch.tensor(index, dtype=torch.int64, device=device), len(first_seen)
