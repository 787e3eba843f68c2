"""`value_loss`: the clipped critic loss on per-token values; elementwise on [B, T], plain torch on every
device."""

from __future__ import annotations

import torch

from hybridengine import checks
from hybridengine.ops.policy_loss import LOSS_AGGS, aggregate, bool_mask, check_bt


def value_loss(values, old_values, returns, mask, *, clip=0.2, loss_agg="token-mean") -> torch.Tensor:
    """Clipped critic loss `0.5 * agg(max((v - R)**2, (clamp(v, old - clip, old + clip) - R)**2))`.

    values / old_values / returns [B, T] float, mask [B, T] 0/1; `clip=None` drops the clipped
    term. Computed in fp32 (fp64 for fp64 values); 0 for an all-masked batch.
    """
    op = "value_loss"
    if not isinstance(values, torch.Tensor) or values.dim() != 2 or not values.is_floating_point():
        raise ValueError(f"{op}: values must be a float [B, T] tensor, got {checks.describe(values)}")
    shape, device = values.shape, values.device
    check_bt(op, "old_values", old_values, shape, device)
    check_bt(op, "returns", returns, shape, device)
    mask_bool = bool_mask(op, mask, shape, device, strict=True)
    checks.one_of(op, "loss_agg", loss_agg, LOSS_AGGS)
    if clip is not None:
        checks.number(op, "clip", clip, low=0)
    dt = torch.promote_types(values.dtype, torch.float32)
    v, target = values.to(dt), returns.to(dt)
    loss = (v - target) ** 2
    if clip is not None:
        old = old_values.to(dt)
        loss = torch.maximum(loss, (torch.clamp(v, old - clip, old + clip) - target) ** 2)
    return 0.5 * aggregate(loss, mask_bool, loss_agg)
