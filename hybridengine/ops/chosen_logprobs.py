"""`chosen_logprobs`: log_softmax(logits / T) at the chosen tokens, one row at a time: the rollout's sampler
log-probs in exact mode (`EngineConfig.exact_logprobs`).

Batch-invariant: a row's bits depend on that row alone, and the trainer's exact LM-head pass
(`hybridengine.ops.lm_head`) runs the same code on its logits, so both sides report the same bits. The
`logit_stats` kernel (`hybridengine.kernels.ppo_loss`) on CUDA, `lm_head.scaled_log_softmax` elsewhere.
"""

from __future__ import annotations

import math

import torch

from hybridengine import checks
from hybridengine.ops import _launch
from hybridengine.ops._ext import warn_once
from hybridengine.ops.lm_head import KERNEL_DTYPES, inv_temperature_rows, load_kernels, scaled_log_softmax


def chosen_logprobs(logits: torch.Tensor, tokens: torch.Tensor, inv_temperature: float | torch.Tensor
                    ) -> torch.Tensor:
    """log_softmax(logits * inv_temperature)[tokens] per row, fp32 [R]: the rollout's log-probs.

    logits [R, V] (bf16/fp16/fp32, as `linear_exact` returns them), tokens [R] int64 in [0, V) (not
    checked: that would cost a host sync per decode step), inv_temperature a float > 0 (rounded once
    to fp32) or an fp32 [R] tensor (1 / T per row). Batch-invariant: a row's bits do not depend on the
    other rows or on R. The `logit_stats` kernel (one program per row, BLOCK_V from V alone) where
    `_launch.use_kernel` says so (CUDA), else `(logits.float() * inv_t).log_softmax(-1)` gathered per
    row. `token_logprobs(exact=True)` and `ppo_loss(exact=True)` run the same code on the trainer's
    logits (`lm_head.head_pass` with exact=True).
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
        inv_t = inv_temperature_rows(float(inv_temperature), rows, logits.device)
    if _launch.use_kernel(logits):
        if logits.dtype in KERNEL_DTYPES:
            x = logits if logits.stride(-1) == 1 else logits.contiguous()
            _, logp, _ = load_kernels().logit_stats(x, tokens, inv_temperature=inv_t)
            return logp
        warn_once(f"{op}: no kernel for {logits.dtype} logits; running the torch formula")
    return scaled_log_softmax(logits, inv_t).gather(-1, tokens[:, None]).squeeze(-1)
