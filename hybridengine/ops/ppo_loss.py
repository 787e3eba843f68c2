"""PPO/GRPO policy loss over the LM head without materialising the logits; token log-probs; value loss.

Three layers, as for every op: the plain-torch references (`ppo_loss_ref`, `token_logprobs_ref`:
full logits in fp32, autograd does the rest), the fused path (cuBLAS chunk GEMMs + the row
kernels of `hybridengine.kernels.ppo_loss`, wrapped in `autograd.Function`s), and the public
`ppo_loss` / `token_logprobs` that validate and pick one: the kernels on CUDA, the reference on
CPU. `value_loss` is elementwise on [B, T] and is plain torch everywhere.

The fused PPO loss computes its gradients in the forward (exact: each token's gradient needs only
its own logits row and the aggregation weights, which come from the mask alone). Per chunk of
`C` tokens (`h` [C, H], `W` [V, H]):

    x = h @ W.T (+ b)                    cuBLAS, 2*C*H*V flops, x in the input dtype [C, V]
    lse, logp, entropy = logit_stats(x)  Triton, one read of x
    g_logp, g_ent = PPO coefficients     torch, O(C): dloss/dlogp and dloss/dentropy per token
    x <- dloss/dx                        Triton, in place, one read + one write of x
    grad_h[chunk] = x @ W                cuBLAS, 2*C*H*V
    grad_W += x.T @ h                    cuBLAS, 2*C*H*V (beta = 1: reads and writes grad_W once)

Total 6*M*H*V flops (the floor for forward + backward) and 6 bytes per logit of elementwise
traffic in bf16. Memory beyond the inputs: one [C, V] logits chunk, grad_W (weight's dtype),
grad_h, and O(M) fp32 vectors; C is sized so that all of it stays within LOSS_MEMORY_BYTES (2 GiB)
where the gradients leave room. The backward only scales the saved gradients by grad_output.
Masked-out tokens are never computed (their loss terms and gradients are zero): with 40% padding
the op costs 60% of the flops. One host sync per call validates targets and mask and counts tokens.

`token_logprobs` runs the first half (2*M*H*V) and, when a gradient is needed, recomputes the
chunks in its backward (another 6*M*H*V).

Precision: the chunk logits are rounded to the input dtype by the GEMM exactly as in naive torch
(`(hidden @ weight.T).float()`), and everything after that is fp32. grad_W is accumulated in the
weight's dtype across chunks (one rounding per chunk; an fp32 accumulator would cost 2 GiB more
at V = 152k, H = 3584).

Exact log-probs (`exact=True`): the rollout's sampler and the trainer report the same bits for the
same hidden states. The chunk logits come from the batch-invariant `linear_exact` (a row's bits do
not depend on the other rows), and each row's log-prob from `chosen_logprobs`' own code: the
`logit_stats` kernel with a per-row inverse temperature on the kernel path, `(x.float() * inv_t)
.log_softmax(-1)` on the torch path; the temperature is applied as `x * inv_t` with `inv_t = 1 / T`
rounded to fp32, as the sampler does. A token's log-prob is then independent of the batch, its
padding and the chunking, so old log-probs taken from the rollout give a ratio of exactly 1 before
the first update. Gradients keep the default path's math (cuBLAS on CUDA).

Rollout correction (`rollout_correction`): where the rollout's log-probs still differ from the
trainer's (`old_logprobs`), each token's policy-gradient term is weighted by a function of
`r = pi_old / pi_rollout = exp(old - rollout)` (no gradient): "tis" (truncated importance
sampling) `w = min(r, cap)`, "mis" (masked importance sampling) `w = 1` inside `[1 / cap, cap]`,
else 0. The KL and entropy terms are not weighted, and the aggregation denominators stay the
response mask's (a masked token still counts as a token). It costs O(M) elementwise work, fused
into the per-chunk coefficients.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hybridengine import checks
from hybridengine.ops import _launch
from hybridengine.ops._ext import warn_once

KL_ESTIMATORS = ("k1", "k2", "k3")
LOSS_AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
ROLLOUT_CORRECTIONS = ("tis", "mis")
METRICS = ("pg_loss", "pg_clipfrac", "pg_clipfrac_lower", "ppo_kl", "entropy", "kl_loss", "rollout_corr_weight",
           "rollout_corr_clipfrac", "rollout_corr_logprob_diff")
KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

LOGITS_CHUNK_BYTES = 2**30
"""Upper bound on the one [C, V] logits chunk: C <= 3530 tokens at V = 152064 bf16. Past ~2k rows a
larger chunk buys little (bench ppo_loss, the chunk sweep)."""
LOSS_MEMORY_BYTES = 2 * 2**30
"""Target for the op's peak extra memory: the gradients it returns (grad_hidden [M, H], grad_weight
[V, H], fp32 grad_bias) plus the logits chunk. The chunk gets what the gradients leave, between
MIN_CHUNK_ROWS rows and LOGITS_CHUNK_BYTES: at H = 3584, V = 152064 bf16 the gradients are 1.07 GiB
at M = 8k (chunk capped at 1 GiB), 1.23 GiB at 32k (chunk ~0.76 GiB) and 1.89 GiB at 128k (chunk
~0.1 GiB = 384 rows). Where the gradients alone exceed the target, the chunk stays at MIN_CHUNK_ROWS."""
MIN_CHUNK_ROWS = 256
"""Below this the grad_weight read-modify-write of each chunk's beta = 1 GEMM (2 x V x H x 2 bytes)
outweighs its 2 x C x H x V flops."""
WORKSPACE_BYTES_PER_ROW = 64
"""The O(M) fp32 vectors (stats, weights, PPO coefficients) reserved out of LOSS_MEMORY_BYTES per row."""
CHUNK_ALIGN = 128
"""Chunk rows are a multiple of this (GEMM tile height) except for the last."""


# --------------------------------------------------------------------------------------------
# configuration and validation


@dataclass(kw_only=True, slots=True, frozen=True)
class LossConfig:
    """The scalar knobs of `ppo_loss`, validated once."""

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
    `1 / cap <= r <= cap` ("mis"), r = exp(old_logprobs - rollout_logprobs); needs rollout_logprobs."""
    rollout_correction_cap: float = 2.0
    """The cap of the rollout correction (finite, > 1)."""

    def __post_init__(self):
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


def _check_temperature(temperature: float) -> None:
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")


def _check_head(op: str, hidden, weight, bias, targets) -> None:
    """hidden [B, T, H] float, weight [V, H] and bias [V] of hidden's dtype, targets [B, T] int; one device."""
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3 or not hidden.is_floating_point():
        raise ValueError(f"{op}: hidden must be a float [B, T, H] tensor, got {checks.describe(hidden)}")
    if hidden.dtype not in (*KERNEL_DTYPES, torch.float64):
        raise ValueError(f"{op}: hidden must be bf16, fp16, fp32 or fp64, got {hidden.dtype}")
    B, T, H = hidden.shape
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[1] != H or weight.shape[0] < 1:
        raise ValueError(f"{op}: weight must be [V, H] with H = {H} (hidden's last dim), got {checks.describe(weight)}")
    if weight.dtype != hidden.dtype:
        raise ValueError(f"{op}: weight dtype {weight.dtype} differs from hidden dtype {hidden.dtype}")
    if weight.device != hidden.device:
        raise ValueError(f"{op}: weight is on {weight.device}, hidden on {hidden.device}")
    V = weight.shape[0]
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or bias.shape != (V,):
            raise ValueError(f"{op}: bias must be [V] = [{V}] or None, got {checks.describe(bias)}")
        if bias.dtype != hidden.dtype or bias.device != hidden.device:
            raise ValueError(f"{op}: bias must be {hidden.dtype} on {hidden.device}, got {bias.dtype} on {bias.device}")
    if not isinstance(targets, torch.Tensor) or targets.shape != (B, T):
        raise ValueError(f"{op}: targets must be [B, T] = [{B}, {T}], got {checks.describe(targets)}")
    if targets.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
        raise ValueError(f"{op}: targets must be an integer tensor, got {targets.dtype}")
    if targets.device != hidden.device:
        raise ValueError(f"{op}: targets are on {targets.device}, hidden on {hidden.device}")


def _check_bt(op: str, name: str, x, shape, device, *, floating: bool = True) -> None:
    """x is a [B, T] tensor of `shape` on `device` (float unless `floating` is False)."""
    if not isinstance(x, torch.Tensor) or tuple(x.shape) != tuple(shape):
        raise ValueError(f"{op}: {name} must be [B, T] = {list(shape)}, got {checks.describe(x)}")
    checks.tensor(op, name, x, floating=floating, device=device)


def _mask_bool(op: str, mask, shape, device, *, strict: bool) -> torch.Tensor:
    """mask [B, T] as bool (strict: 0/1 checked here, one host sync; else by `_check_values`)."""
    _check_bt(op, "mask", mask, shape, device, floating=False)
    return checks.mask_bool(op, mask, shape, device, strict=strict)


def _check_values(op: str, targets: torch.Tensor, vocab: int, mask: torch.Tensor | None,
                  mask_bool: torch.Tensor | None) -> int:
    """Targets in [0, V) where the mask is set, mask entries 0/1; returns the number of masked-in
    tokens. One host sync for all checks."""
    bad_target = (targets < 0) | (targets >= vocab)
    checks = []
    if mask_bool is not None:
        bad_target &= mask_bool
        bad_mask = torch.zeros((), dtype=torch.bool, device=mask.device) if mask.dtype == torch.bool else \
            ((mask != 0) & (mask != 1)).any()
        checks = [bad_mask, mask_bool.sum()]
    flags = torch.stack([bad_target.any().long(), *[c.long() for c in checks]]).tolist()
    if flags[0]:
        where = "where mask is set " if mask_bool is not None else ""
        raise ValueError(f"{op}: targets must lie in [0, {vocab}) {where}(the vocabulary is weight.shape[0])")
    if mask_bool is None:
        return targets.numel()
    if flags[1]:
        raise ValueError(f"{op}: mask must hold only 0 and 1")
    return flags[2]


# --------------------------------------------------------------------------------------------
# the per-token policy math, shared by the reference and the fused path


def _aggregate(values: torch.Tensor, mask: torch.Tensor, loss_agg: str) -> torch.Tensor:
    """agg(L) under a bool mask, 0 when nothing is masked in; masked-out entries never reach the sum."""
    masked = torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device))
    if loss_agg == "token-mean":
        return masked.sum() / mask.sum().clamp_min(1).to(values.dtype)
    tokens = mask.sum(-1)
    num_seqs = (tokens > 0).sum().clamp_min(1).to(values.dtype)
    if loss_agg == "seq-mean-token-mean":
        return (masked.sum(-1) / tokens.clamp_min(1).to(values.dtype)).sum() / num_seqs
    return masked.sum() / num_seqs


def _agg_weights(mask: torch.Tensor, loss_agg: str, dtype: torch.dtype) -> torch.Tensor:
    """w with agg(L) = sum(w * L) for every L: the linear map `_aggregate` applies."""
    m = mask.to(dtype)
    if loss_agg == "token-mean":
        return m / m.sum().clamp_min(1)
    tokens = m.sum(-1, keepdim=True)
    num_seqs = (tokens > 0).sum().clamp_min(1).to(dtype)
    if loss_agg == "seq-mean-token-mean":
        return m / (tokens.clamp_min(1) * num_seqs)
    return m / num_seqs


def _kl(logp: torch.Tensor, ref: torch.Tensor, estimator: str) -> torch.Tensor:
    if estimator == "k1":
        return logp - ref
    if estimator == "k2":
        return 0.5 * (logp - ref) ** 2
    x = torch.clamp(ref - logp, -20, 20)
    return torch.clamp(torch.exp(x) - x - 1, -10, 10)


def _rollout_weight(old: torch.Tensor, rollout: torch.Tensor | None, cfg: LossConfig, dt: torch.dtype
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


def _policy_terms(logp: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                  ref_logprobs: torch.Tensor | None, cfg: LossConfig, rollout_logprobs: torch.Tensor | None = None
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
    w, flagged = _rollout_weight(old_logprobs, rollout_logprobs, cfg, dt)
    if w is not None:
        pg = pg * w
    kl = None if ref_logprobs is None else _kl(logp, ref_logprobs.to(dt), cfg.kl_estimator)
    return dict(pg=pg, kl=kl, d=d, clipped=clipped, dual=dual, rollout_weight=w, rollout_flagged=flagged)


def _policy_loss(logp: torch.Tensor, entropy: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                 mask: torch.Tensor, ref_logprobs: torch.Tensor | None, cfg: LossConfig,
                 rollout_logprobs: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """loss and metrics from per-token logp and entropy [B, T] under a bool mask."""
    dt = logp.dtype
    terms = _policy_terms(logp, old_logprobs, advantages, ref_logprobs, cfg, rollout_logprobs)
    agg = lambda x: _aggregate(x, mask, cfg.loss_agg)  # noqa: E731
    token_mean = lambda x: _aggregate(x, mask, "token-mean")  # noqa: E731
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


def _policy_grad_logp(logp, old, adv, ref, weights, cfg: LossConfig, rollout_weight=None) -> torch.Tensor:
    """dloss/dlogp per token (1-D), written out by hand with torch autograd's conventions for the
    same expressions as `_policy_loss`: clamp passes the gradient on its closed interval, maximum and
    minimum split it in half on ties, where() routes it to the chosen branch. rollout_weight: the
    rollout correction's w per token (`_rollout_weight`), None when off."""
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


# --------------------------------------------------------------------------------------------
# references


def _logprobs_ref(hidden, weight, targets, bias, temperature, exact=False) -> tuple[torch.Tensor, torch.Tensor]:
    """Naive: the full [B, T, V] logits in the input dtype, then fp32 (fp64 for fp64 inputs).
    exact: the logits of `linear_exact` and `chosen_logprobs`' torch code (fp32, `* inv_t`)."""
    if exact:
        B, T, H = hidden.shape
        logits = _linear_exact(hidden.reshape(B * T, H), weight, bias)
        log_probs = _scaled_log_softmax(logits, _inv_temperature_rows(1.0 / temperature, B * T, logits.device))
        logp = log_probs.gather(-1, targets.reshape(B * T, 1).long()).view(B, T)
        return logp, -(log_probs.exp() * log_probs).sum(-1).view(B, T)
    logits = F.linear(hidden, weight, bias)
    z = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    log_probs = torch.log_softmax(z, dim=-1)
    logp = log_probs.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return logp, entropy


def _linear_exact(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    # Imported on first use: it loads Triton kernels, which must come after TRITON_INTERPRET is set.
    from hybridengine.ops.exact_linear import linear_exact

    return linear_exact(x, weight, bias)


def _inv_temperature_rows(inv_temperature, rows: int, device) -> torch.Tensor:
    """inv_temperature (a float, rounded once to fp32, or an fp32 [rows] tensor) as an fp32 [rows] tensor."""
    if isinstance(inv_temperature, torch.Tensor):
        return inv_temperature
    return torch.full((rows,), inv_temperature, dtype=torch.float32, device=device)


def _chunk_inputs(hidden: torch.Tensor, flat: torch.Tensor | None, targets: torch.Tensor, rows: torch.Tensor | None,
                  T: int, start: int, end: int):
    """Chunk [start, end) of the selected token rows: (their indices or None when every row is taken, hidden
    rows [n, H], targets [n]); hidden is [B, T, H] unless `flat` [N, H] is given."""
    index = None if rows is None else rows[start:end]
    if flat is None:
        token = torch.arange(start, end, device=hidden.device) if index is None else index
        h = hidden[token // T, token % T]
    else:
        h = flat[start:end] if index is None else flat.index_select(0, index)
    t = targets[start:end] if index is None else targets.index_select(0, index)
    return index, h, t


def _head_grads_(x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, index: torch.Tensor | None, start: int,
                 end: int, grad_hidden, grad_weight, grad_bias) -> None:
    """One chunk's LM-head gradients from its logit gradients x [rows, V] and hidden rows h: grad_hidden's rows
    (start:end, or `index` where the chunk's rows are scattered), grad_weight and grad_bias accumulated."""
    if grad_hidden is not None:
        if index is None:
            torch.mm(x, weight, out=grad_hidden[start:end])
        else:
            grad_hidden.index_copy_(0, index, x @ weight)
    if grad_weight is not None:
        grad_weight.addmm_(x.t(), h)
    if grad_bias is not None:
        grad_bias += x.sum(0, dtype=torch.float32)


def _scaled_log_softmax(logits: torch.Tensor, inv_t: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits * inv_t) per row in fp32: `chosen_logprobs`' torch path (row-invariant:
    CPU and CUDA softmax reduce each row on its own)."""
    return (logits.float() * inv_t[:, None]).log_softmax(-1)


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
    logp, entropy = _logprobs_ref(hidden, weight, safe_targets, bias, temperature, exact)
    return _policy_loss(logp, entropy, old_logprobs, advantages, mask_bool, ref_logprobs, cfg, rollout_logprobs)


def token_logprobs_ref(hidden, weight, targets, *, bias=None, temperature=1.0, return_entropy=False, exact=False):
    """Plain-torch `token_logprobs`: full logits in fp32."""
    _check_head("token_logprobs_ref", hidden, weight, bias, targets)
    _check_temperature(temperature)
    _check_values("token_logprobs_ref", targets, weight.shape[0], None, None)
    logp, entropy = _logprobs_ref(hidden, weight, targets, bias, temperature, exact)
    return (logp, entropy) if return_entropy else logp


def _check_policy(op, hidden, weight, bias, targets, old_logprobs, advantages, mask, ref_logprobs, temperature,
                  cfg: LossConfig, rollout_logprobs=None) -> tuple[torch.Tensor, int]:
    """All of ppo_loss's checks; returns the bool mask and the number of masked-in tokens."""
    _check_head(op, hidden, weight, bias, targets)
    _check_temperature(temperature)
    shape, device = targets.shape, hidden.device
    _check_bt(op, "old_logprobs", old_logprobs, shape, device)
    _check_bt(op, "advantages", advantages, shape, device)
    if ref_logprobs is not None:
        _check_bt(op, "ref_logprobs", ref_logprobs, shape, device)
    elif cfg.kl_coef != 0:
        raise ValueError(f"{op}: kl_coef = {cfg.kl_coef} needs ref_logprobs")
    if rollout_logprobs is not None:
        _check_bt(op, "rollout_logprobs", rollout_logprobs, shape, device)
    elif cfg.rollout_correction is not None:
        raise ValueError(f"{op}: rollout_correction = {cfg.rollout_correction!r} needs rollout_logprobs")
    mask_bool = _mask_bool(op, mask, shape, device, strict=False)  # 0/1 checked with the targets, one sync
    num_tokens = _check_values(op, targets, weight.shape[0], mask, mask_bool)
    return mask_bool, num_tokens


# --------------------------------------------------------------------------------------------
# the fused path


def _chunk_rows(num_rows: int, vocab: int, element_size: int, grad_bytes: int = 0) -> int:
    """Rows per chunk: the largest multiple of CHUNK_ALIGN whose [C, V] chunk fits both
    LOGITS_CHUNK_BYTES and what `grad_bytes` (the gradients the call returns) leave of
    LOSS_MEMORY_BYTES, at least MIN_CHUNK_ROWS; then evened out over the chunks so the last is not
    a sliver (M = 8192 at V = 152k bf16: 2816 + 2816 + 2560, not 3456 + 3456 + 1280)."""
    row_bytes = vocab * element_size
    left = LOSS_MEMORY_BYTES - grad_bytes - WORKSPACE_BYTES_PER_ROW * num_rows
    budget = min(LOGITS_CHUNK_BYTES, max(left, MIN_CHUNK_ROWS * row_bytes))
    cap = max(CHUNK_ALIGN, budget // row_bytes // CHUNK_ALIGN * CHUNK_ALIGN)
    if num_rows <= cap:
        return max(num_rows, 1)
    per_chunk = -(-num_rows // -(-num_rows // cap))
    return min(cap, -(-per_chunk // CHUNK_ALIGN) * CHUNK_ALIGN)


def _grad_bytes(hidden: torch.Tensor, weight: torch.Tensor, needs: tuple[bool, bool, bool]) -> int:
    """Bytes of the gradients a fused call allocates: grad_hidden [B * T, H], grad_weight, fp32 grad_bias."""
    need_h, need_w, need_b = needs
    return (need_h * hidden.shape[0] * hidden.shape[1] * hidden.shape[2] * hidden.element_size()
            + need_w * weight.numel() * weight.element_size() + need_b * weight.shape[0] * 4)


def _kernels():
    from hybridengine.kernels import ppo_loss as kernels  # Triton imported on first use, after TRITON_INTERPRET is set

    return kernels


def _head_pass(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
               rows: torch.Tensor | None, *, temperature: float, coefs=None, grad_hidden=None, grad_weight=None,
               grad_bias=None, chunk_rows: int | None = None, block_v: int | None = None, grad_bytes: int = 0,
               exact: bool = False, keep: dict | None = None):
    """One pass over the LM head, chunk by chunk, never holding more than one [C, V] logits chunk.

    hidden [B, T, H] (any strides: a [:, -T:] slice of the prompt+response states is read chunk by
    chunk, never copied whole), targets [B * T] int64; `rows` (1-D int64 into the B * T tokens) selects
    the rows to compute, None = all. Returns fp32 (lse, logp, entropy), one entry per selected row.
    With `coefs(start, end, logp, entropy) -> (dL/dlogp, dL/dentropy)` for the chunk's selected rows,
    also turns each chunk into dL/dlogits and accumulates it into grad_hidden [B * T, H] (rows not
    selected are left alone), grad_weight [V, H] and grad_bias (fp32 [V]), whichever are given.
    exact: each chunk's logits from `linear_exact` and its stats from the per-row-temperature kernel,
    the code of `chosen_logprobs` (the gradients are the same either way). `keep` (a dict, without
    `coefs`): receives the last chunk's logits (`logits`, its first row `start`, the chunk `buffer`) for a
    backward that does not recompute them (`_head_grad_pass`).
    """
    kernels = _kernels()
    B, T, H = hidden.shape
    try:
        flat = hidden.view(B * T, H)
    except RuntimeError:  # not viewable as rows: gather each chunk from the 3-D tensor
        flat = None
    num = B * T if rows is None else rows.numel()
    vocab = weight.shape[0]
    device = hidden.device
    stats = tuple(torch.empty(num, dtype=torch.float32, device=device) for _ in range(3))
    if num == 0:
        return stats
    chunk = chunk_rows or _chunk_rows(num, vocab, hidden.element_size(), grad_bytes)
    inv_t = 1.0 / temperature
    if exact:  # linear_exact allocates each chunk's logits itself
        buffer, inv_t_rows = None, _inv_temperature_rows(inv_t, min(chunk, num), device)
    else:
        buffer = torch.empty(min(chunk, num), vocab, dtype=hidden.dtype, device=device)
    for start in range(0, num, chunk):
        end = min(start + chunk, num)
        index, h, t = _chunk_inputs(hidden, flat, targets, rows, T, start, end)
        lse, logp, ent = (s[start:end] for s in stats)
        if exact:
            x = None  # the previous chunk's logits go before the next are allocated
            x = _linear_exact(h, weight, bias)
            kernels.logit_stats(x, t, inv_temperature=inv_t_rows[:end - start], out=(lse, logp, ent), block_v=block_v)
        else:
            x = buffer[:end - start]
            if bias is None:
                torch.mm(h, weight.t(), out=x)
            else:
                torch.addmm(bias, h, weight.t(), out=x)
            kernels.logit_stats(x, t, inv_temperature=inv_t, out=(lse, logp, ent), block_v=block_v)
        if coefs is None:
            if keep is not None and end == num:
                keep.update(logits=x, start=start, buffer=buffer)
            continue
        g_logp, g_ent = coefs(start, end, logp, ent)
        kernels.logit_grad_(x, t, lse, ent, g_logp.contiguous(), g_ent.contiguous(), inv_temperature=inv_t,
                            block_v=block_v)
        _head_grads_(x, h, weight, index, start, end, grad_hidden, grad_weight, grad_bias)
    return stats


def _head_grad_pass(hidden, weight, bias, targets, rows, lse, entropy, g_logp, g_ent, *, temperature, chunk,
                    kept, grad_hidden, grad_weight, grad_bias, block_v=None, exact=False) -> None:
    """The backward of a `_head_pass` run with `keep`: per chunk of the same rows, dL/dlogits from the saved
    fp32 (lse, entropy) and the per-row dL/dlogp, dL/dentropy, into grad_hidden / grad_weight / grad_bias.
    The kept last chunk goes first (no GEMM for it); its storage then holds the recomputed chunks, so the
    pass never holds more than one [C, V] chunk."""
    kernels = _kernels()
    B, T, H = hidden.shape
    try:
        flat = hidden.view(B * T, H)
    except RuntimeError:
        flat = None
    num = B * T if rows is None else rows.numel()
    device = hidden.device
    inv_t = 1.0 / temperature
    starts = list(range(0, num, chunk))
    last = kept.get("start") if kept else None
    if last in starts:  # the kept chunk first, then the others in order
        starts.remove(last)
        starts.insert(0, last)
    buffer = None
    for start in starts:
        end = min(start + chunk, num)
        index, h, t = _chunk_inputs(hidden, flat, targets, rows, T, start, end)
        if start == last:
            x = kept.pop("logits")
            buffer = kept.pop("buffer", None)  # the forward's chunk storage holds the recomputed chunks
        elif exact:
            x = None  # the previous chunk's logits go before the next are allocated
            x = _linear_exact(h, weight, bias)
        else:
            if buffer is None:
                buffer = torch.empty(min(chunk, num), weight.shape[0], dtype=hidden.dtype, device=device)
            x = buffer[:end - start]
            if bias is None:
                torch.mm(h, weight.t(), out=x)
            else:
                torch.addmm(bias, h, weight.t(), out=x)
        kernels.logit_grad_(x, t, lse[start:end], entropy[start:end], g_logp[start:end].contiguous(),
                            g_ent[start:end].contiguous(), inv_temperature=inv_t, block_v=block_v)
        _head_grads_(x, h, weight, index, start, end, grad_hidden, grad_weight, grad_bias)


def _grad_buffers(hidden, weight, bias, needs, rows):
    """Gradient buffers: grad_hidden [B * T, H] (contiguous whatever hidden's strides), grad_weight, fp32 grad_bias."""
    need_h, need_w, need_b = needs
    grad_h = None
    if need_h:  # rows that are not computed keep a zero gradient
        shape = (hidden.shape[0] * hidden.shape[1], hidden.shape[2])
        new = torch.empty if rows is None else torch.zeros
        grad_h = new(shape, dtype=hidden.dtype, device=hidden.device)
    grad_w = torch.zeros_like(weight) if need_w else None
    grad_b = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if need_b else None
    return grad_h, grad_w, grad_b


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

        weights = flat(_agg_weights(mask_bool, cfg.loss_agg, torch.float32))
        old, adv, ref = flat(old_logprobs), flat(advantages), flat(ref_logprobs)
        rollout_w, _ = _rollout_weight(old, flat(rollout_logprobs), cfg, torch.float32)
        g_ent = -cfg.entropy_coef * weights

        def coefs(start, end, logp, ent):
            part = slice(start, end)
            g_logp = _policy_grad_logp(logp, old[part], adv[part], None if ref is None else ref[part],
                                       weights[part], cfg, None if rollout_w is None else rollout_w[part])
            return g_logp, g_ent[part]

        grad_h, grad_w, grad_b = _grad_buffers(hidden, weight, bias, needs, rows)
        _, logp, entropy = _head_pass(hidden, weight, bias, targets.reshape(-1).long(), rows, temperature=temperature,
                                      coefs=coefs if any(needs) else None, grad_hidden=grad_h, grad_weight=grad_w,
                                      grad_bias=grad_b, chunk_rows=chunk_rows, block_v=block_v,
                                      grad_bytes=_grad_bytes(hidden, weight, needs), exact=exact)
        loss, metrics = _policy_loss(_scatter(logp, rows, B, T), _scatter(entropy, rows, B, T), old_logprobs,
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


def _scatter(values: torch.Tensor, rows: torch.Tensor | None, B: int, T: int) -> torch.Tensor:
    """Per-row values back to [B, T]; rows that were not computed are 0 (and masked out)."""
    if rows is None:
        return values.view(B, T)
    return torch.zeros(B * T, dtype=values.dtype, device=values.device).index_copy_(0, rows, values).view(B, T)


def _ppo_loss_fused(hidden, weight, targets, old_logprobs, advantages, mask_bool, num_tokens, *, bias, temperature,
                    ref_logprobs, cfg, rollout_logprobs=None, exact=False, chunk_rows=None, block_v=None):
    """The Triton path (inputs already validated); runs on CPU tensors under TRITON_INTERPRET=1 too."""
    rows = None if num_tokens == mask_bool.numel() else mask_bool.reshape(-1).nonzero().squeeze(1)
    grad_on = torch.is_grad_enabled()
    needs = tuple(grad_on and x is not None and x.requires_grad for x in (hidden, weight, bias))
    loss, *values = _FusedPolicyLoss.apply(hidden, weight, bias, targets, old_logprobs, advantages, mask_bool,
                                           ref_logprobs, rollout_logprobs, rows, cfg, temperature, needs, chunk_rows,
                                           block_v, exact)
    return loss, dict(zip(METRICS, values))


class _FusedTokenLogprobs(torch.autograd.Function):
    """Forward: stats only (2*M*H*V). Backward: recomputes each chunk and applies the row gradients."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, needs, chunk_rows, block_v, exact):
        B, T, H = hidden.shape
        _, logp, entropy = _head_pass(hidden, weight, bias, targets.reshape(-1), None, temperature=temperature,
                                      chunk_rows=chunk_rows, block_v=block_v, exact=exact)
        ctx.save_for_backward(hidden, weight, bias, targets)
        ctx.args = (temperature, needs, chunk_rows, block_v, exact)
        return logp.view(B, T), entropy.view(B, T)

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, bias, targets = ctx.saved_tensors
        temperature, needs, chunk_rows, block_v, exact = ctx.args
        B, T, H = hidden.shape
        zeros = torch.zeros(B * T, dtype=torch.float32, device=hidden.device)
        g_logp = zeros if grad_logp is None else grad_logp.reshape(-1).float()
        g_ent = zeros if grad_entropy is None else grad_entropy.reshape(-1).float()
        grad_h, grad_w, grad_b = _grad_buffers(hidden, weight, bias, needs, None)
        _head_pass(hidden, weight, bias, targets.reshape(-1), None, temperature=temperature,
                   coefs=lambda s, e, *_: (g_logp[s:e], g_ent[s:e]), grad_hidden=grad_h, grad_weight=grad_w,
                   grad_bias=grad_b, chunk_rows=chunk_rows, block_v=block_v,
                   grad_bytes=_grad_bytes(hidden, weight, needs), exact=exact)
        if grad_h is not None:
            grad_h = grad_h.view(B, T, H)
        if grad_b is not None:
            grad_b = grad_b.to(bias.dtype)
        return grad_h, grad_w, grad_b, None, None, None, None, None, None


def _token_logprobs_fused(hidden, weight, targets, *, bias, temperature, exact=False, chunk_rows=None, block_v=None):
    targets = targets.long()
    grad_on = torch.is_grad_enabled()
    needs = tuple(grad_on and x is not None and x.requires_grad for x in (hidden, weight, bias))
    if any(needs):
        return _FusedTokenLogprobs.apply(hidden, weight, bias, targets, temperature, needs, chunk_rows, block_v,
                                         exact)
    B, T, H = hidden.shape
    _, logp, entropy = _head_pass(hidden, weight, bias, targets.reshape(-1), None, temperature=temperature,
                                  chunk_rows=chunk_rows, block_v=block_v, exact=exact)
    return logp.view(B, T), entropy.view(B, T)


class _FusedMaskedLogprobs(torch.autograd.Function):
    """Forward: stats of the masked-in rows (2*M*H*V), keeping the last chunk's logits. Backward: dL/dlogits
    from dL/dlogp and dL/dentropy chunk by chunk, recomputing every chunk but the kept one (4*M*H*V, plus
    2*M*H*V for each recomputed chunk: none when the rows fit in one chunk)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, rows, temperature, needs, chunk_rows, block_v, exact):
        B, T, H = hidden.shape
        targets = targets.reshape(-1).long()
        num = B * T if rows is None else rows.numel()
        chunk = chunk_rows or _chunk_rows(num, weight.shape[0], hidden.element_size(),
                                          _grad_bytes(hidden, weight, needs))
        kept = {} if any(needs) else None
        lse, logp, entropy = _head_pass(hidden, weight, bias, targets, rows, temperature=temperature,
                                        chunk_rows=chunk, block_v=block_v, exact=exact, keep=kept)
        ctx.save_for_backward(hidden, weight, bias, targets, rows, lse, entropy)
        ctx.kept, ctx.args = kept, (temperature, needs, chunk, block_v, exact)
        return _scatter(logp, rows, B, T), _scatter(entropy, rows, B, T)

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, bias, targets, rows, lse, entropy = ctx.saved_tensors
        temperature, needs, chunk, block_v, exact = ctx.args
        if ctx.kept is None:
            raise RuntimeError("masked_logprobs: a second backward through one call (retain_graph=True) is not "
                               "supported: the kept logits chunk is consumed by the first")
        kept, ctx.kept = ctx.kept, None
        B, T, H = hidden.shape

        def per_row(g):  # [B, T] -> fp32 per computed row
            if g is None:
                return torch.zeros_like(lse)
            g = g.reshape(-1).float()
            return g if rows is None else g.index_select(0, rows)

        grad_h, grad_w, grad_b = _grad_buffers(hidden, weight, bias, needs, rows)
        if lse.numel():
            _head_grad_pass(hidden, weight, bias, targets, rows, lse, entropy, per_row(grad_logp),
                            per_row(grad_entropy), temperature=temperature, chunk=chunk, kept=kept,
                            grad_hidden=grad_h, grad_weight=grad_w, grad_bias=grad_b, block_v=block_v, exact=exact)
        if grad_h is not None:
            grad_h = grad_h.view(B, T, H)
        if grad_b is not None:
            grad_b = grad_b.to(bias.dtype)
        return grad_h, grad_w, grad_b, *([None] * 7)


def _masked_logprobs_fused(hidden, weight, targets, mask_bool, num_tokens, *, bias, temperature, exact=False,
                           chunk_rows=None, block_v=None):
    """The Triton path of `masked_logprobs` (inputs already validated)."""
    rows = None if num_tokens == mask_bool.numel() else mask_bool.reshape(-1).nonzero().squeeze(1)
    grad_on = torch.is_grad_enabled()
    needs = tuple(grad_on and x is not None and x.requires_grad for x in (hidden, weight, bias))
    return _FusedMaskedLogprobs.apply(hidden, weight, bias, targets, rows, temperature, needs, chunk_rows, block_v,
                                      exact)


def _masked_logprobs_ref(hidden, weight, targets, mask_bool, bias, temperature, exact=False):
    """Plain torch: `_ppo_loss_ref`'s log-probs (full logits, masked-out targets read as 0), then 0 where
    the mask is 0 (no gradient flows there)."""
    safe_targets = torch.where(mask_bool, targets, torch.zeros_like(targets))
    logp, entropy = _logprobs_ref(hidden, weight, safe_targets, bias, temperature, exact)
    zero = torch.zeros((), dtype=logp.dtype, device=logp.device)
    return torch.where(mask_bool, logp, zero), torch.where(mask_bool, entropy, zero)


def _use_kernels(op: str, hidden: torch.Tensor) -> bool:
    """The Triton path where `_launch.use_kernel` says so (CUDA; tests patch it to run the kernels under the
    interpreter, as `chosen_logprobs` does) for bf16/fp16/fp32; the reference otherwise (warned once)."""
    if not _launch.use_kernel(hidden):
        return False
    if hidden.dtype not in KERNEL_DTYPES:
        warn_once(f"{op}: no fused kernel for {hidden.dtype}; running the torch reference, which "
                  f"materialises the full [B, T, V] logits")
        return False
    try:
        _kernels()
    except Exception as e:  # noqa: BLE001 - any import failure means: no kernels here
        warn_once(f"{op}: the Triton kernels do not import ({type(e).__name__}: {e}); running the torch "
                  f"reference, which materialises the full [B, T, V] logits")
        return False
    return True


# --------------------------------------------------------------------------------------------
# public API


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
    if _use_kernels("ppo_loss", hidden):
        return _ppo_loss_fused(hidden, weight, targets, old_logprobs, advantages, mask_bool, num_tokens, bias=bias,
                               temperature=temperature, ref_logprobs=ref_logprobs, cfg=cfg,
                               rollout_logprobs=rollout_logprobs, exact=exact)
    return _ppo_loss_ref(hidden, weight, targets, old_logprobs, advantages, mask_bool, bias, temperature,
                         ref_logprobs, cfg, rollout_logprobs, exact)


def token_logprobs(hidden, weight, targets, *, bias=None, temperature=1.0, return_entropy=False, exact=False):
    """log_softmax((hidden @ weight.T + bias) / temperature)[targets], fp32 [B, T], without the logits.

    With return_entropy, also the entropy of each token's distribution: (logp, entropy). For
    rollout log-prob recompute and reference-model log-probs; differentiable (the backward
    recomputes the logits chunk by chunk). exact=True: `logp[b, t]` is bitwise
    `chosen_logprobs(linear_exact(hidden[b, t][None], weight, bias), targets[b, t][None], 1 / temperature)`
    whatever the batch, its padding and the chunking (see the module docstring).
    """
    _check_head("token_logprobs", hidden, weight, bias, targets)
    _check_temperature(temperature)
    _check_values("token_logprobs", targets, weight.shape[0], None, None)
    if _use_kernels("token_logprobs", hidden):
        logp, entropy = _token_logprobs_fused(hidden, weight, targets, bias=bias, temperature=temperature, exact=exact)
    else:
        logp, entropy = _logprobs_ref(hidden, weight, targets, bias, temperature, exact)
    return (logp, entropy) if return_entropy else logp


def masked_logprobs(hidden, weight, targets, mask, *, bias=None, temperature=1.0, exact=False
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token (logp, entropy), fp32 [B, T], of the target tokens where mask is 1, for a loss written in
    plain torch on them (`HybridEngine.train_step`); 0 where mask is 0 (never computed, no gradient).

    hidden [B, T, H], weight [V, H], bias [V] or None, targets [B, T] int (any value where mask is 0),
    mask [B, T] 0/1. `logp = log_softmax((hidden @ weight.T + bias) / temperature)[targets]` and the
    entropy of that distribution, exactly as `ppo_loss` computes them (`exact=True`: the bits of
    `token_logprobs(exact=True)` and of the sampler). Differentiable: any dL/dlogp and dL/dentropy flow
    back to hidden, weight and bias through d logp / d logits = onehot - softmax and d entropy / d logits
    = -softmax * (log softmax + entropy), both divided by the temperature.

    On CUDA the fused path runs: the forward computes the stats chunk by chunk (one [C, V] logits chunk at
    a time) and keeps the last chunk; the backward turns each chunk into dL/dlogits and the hidden, weight
    and bias gradients, recomputing every chunk but the kept one. When the masked-in tokens fit in one
    chunk (up to ~3.5k tokens at V = 152k bf16) the op costs what `ppo_loss` does (6*M*H*V flops); past
    that, 2*M*H*V more for the recomputed chunks. Peak memory is `ppo_loss`'s: one chunk plus the
    gradients. Elsewhere the plain-torch reference (full logits) runs.
    """
    op = "masked_logprobs"
    _check_head(op, hidden, weight, bias, targets)
    _check_temperature(temperature)
    mask_bool = _mask_bool(op, mask, targets.shape, hidden.device, strict=False)
    num_tokens = _check_values(op, targets, weight.shape[0], mask, mask_bool)
    if _use_kernels(op, hidden):
        return _masked_logprobs_fused(hidden, weight, targets, mask_bool, num_tokens, bias=bias,
                                      temperature=temperature, exact=exact)
    return _masked_logprobs_ref(hidden, weight, targets, mask_bool, bias, temperature, exact)


def chosen_logprobs(logits: torch.Tensor, tokens: torch.Tensor, inv_temperature: float | torch.Tensor
                    ) -> torch.Tensor:
    """log_softmax(logits * inv_temperature)[tokens] per row, fp32 [R]: the rollout's log-probs.

    logits [R, V] (bf16/fp16/fp32, as `linear_exact` returns them), tokens [R] int64 in [0, V) (not
    checked: that would cost a host sync per decode step), inv_temperature a float > 0 (rounded once
    to fp32) or an fp32 [R] tensor (1 / T per row). Batch-invariant: a row's bits do not depend on the
    other rows or on R. The `logit_stats` kernel (one program per row, BLOCK_V from V alone) where
    `_launch.use_kernel` says so (CUDA), else `(logits.float() * inv_t).log_softmax(-1)` gathered per
    row. `token_logprobs(exact=True)` and `ppo_loss(exact=True)` run the same code on the trainer's
    logits.
    """
    op = "chosen_logprobs"
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"{op}: logits must be a float [R, V] tensor, got {checks.describe(logits)}")
    rows = logits.shape[0]
    if (not isinstance(tokens, torch.Tensor) or tokens.shape != (rows,) or tokens.dtype != torch.int64
            or tokens.device != logits.device):
        raise ValueError(f"{op}: tokens must be an int64 [R] = [{rows}] tensor on {logits.device}, got "
                         f"{checks.describe(tokens)}")
    if isinstance(inv_temperature, torch.Tensor):
        if (inv_temperature.shape != (rows,) or inv_temperature.dtype != torch.float32
                or inv_temperature.device != logits.device):
            raise ValueError(f"{op}: inv_temperature must be a float > 0 or an fp32 [R] = [{rows}] tensor on "
                             f"{logits.device}, got {checks.describe(inv_temperature)}")
        inv_t = inv_temperature.contiguous()
    else:
        if not (isinstance(inv_temperature, (int, float)) and not isinstance(inv_temperature, bool)
                and math.isfinite(inv_temperature) and inv_temperature > 0):
            raise ValueError(f"{op}: inv_temperature must be a finite number > 0 or an fp32 [R] tensor, got "
                             f"{inv_temperature!r}")
        inv_t = _inv_temperature_rows(float(inv_temperature), rows, logits.device)
    if _launch.use_kernel(logits):
        if logits.dtype in KERNEL_DTYPES:
            _, logp, _ = _kernels().logit_stats(logits if logits.stride(-1) == 1 else logits.contiguous(), tokens,
                                                inv_temperature=inv_t)
            return logp
        warn_once(f"{op}: no kernel for {logits.dtype} logits; running the torch formula")
    return _scaled_log_softmax(logits, inv_t).gather(-1, tokens[:, None]).squeeze(-1)


def value_loss(values, old_values, returns, mask, *, clip=0.2, loss_agg="token-mean") -> torch.Tensor:
    """Clipped critic loss `0.5 * agg(max((v - R)**2, (clamp(v, old - clip, old + clip) - R)**2))`.

    values / old_values / returns [B, T] float, mask [B, T] 0/1; `clip=None` drops the clipped
    term. Computed in fp32 (fp64 for fp64 values); 0 for an all-masked batch.
    """
    op = "value_loss"
    if not isinstance(values, torch.Tensor) or values.dim() != 2 or not values.is_floating_point():
        raise ValueError(f"{op}: values must be a float [B, T] tensor, got {checks.describe(values)}")
    shape, device = values.shape, values.device
    _check_bt(op, "old_values", old_values, shape, device)
    _check_bt(op, "returns", returns, shape, device)
    mask_bool = _mask_bool(op, mask, shape, device, strict=True)
    checks.one_of(op, "loss_agg", loss_agg, LOSS_AGGS)
    if clip is not None:
        checks.number(op, "clip", clip, low=0)
    dt = torch.promote_types(values.dtype, torch.float32)
    v, target = values.to(dt), returns.to(dt)
    loss = (v - target) ** 2
    if clip is not None:
        old = old_values.to(dt)
        loss = torch.maximum(loss, (torch.clamp(v, old - clip, old + clip) - target) ** 2)
    return 0.5 * _aggregate(loss, mask_bool, loss_agg)
