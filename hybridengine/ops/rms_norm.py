"""RMSNorm (HF's rounding), optionally after a residual add: the rollout op and the training op with autograd.

Layers: `rms_norm_ref` (plain torch, the module code of hybridengine.model.decoder written as a function),
`rms_norm_triton` (the launcher of `kernels.elementwise.rms_norm_kernel` over [rows, cols]), the ops
`rms_norm` (rollout: the residual add rides in the norm's kernel, no autograd) and `rms_norm_train`
(training: `_RMSNormTrain`, the forward kernel storing 1 / rms per row and a backward kernel). The ops
take the kernels on CUDA and the reference elsewhere.
"""

from __future__ import annotations

import torch

from hybridengine.checks import FLOAT_DTYPES, number, tensor
from hybridengine.ops import _launch

BWD_ROWS = 32
"""Rows per program of the backward: each program sums its rows' dw in registers, the launcher sums
the [programs, H] partials (a [rows / 32, H] fp32 buffer)."""


def num_warps(cols: int) -> int:
    """Warps of one row's program (forward and backward)."""
    return 4 if cols <= 2048 else 8


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """HF's RMSNorm of x (+ residual): normalise in fp32, round, scale by weight in the dtype.
    With residual: (y, x + residual); an fp32 x with a 16-bit residual is rounded to its dtype first."""
    if residual is not None and x.dtype != residual.dtype:
        x = x.to(residual.dtype)
    h = x if residual is None else x + residual
    h32 = h.float()
    y = weight * (h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)
    return y if residual is None else (y, h)


def _check(op: str, x, weight, eps, residual) -> None:
    if isinstance(x, torch.Tensor) and x.dim() == 0:
        raise ValueError(f"{op}: x must be [..., hidden], got a 0-D tensor")
    tensor(op, "x", x, dtypes=FLOAT_DTYPES, contiguous_last=True)
    if residual is not None:  # x is the residual's dtype, or an fp32 sum that is rounded to it
        tensor(op, "residual", residual, shape=x.shape,
               dtypes=FLOAT_DTYPES if x.dtype == torch.float32 else (x.dtype,), device=x.device, contiguous_last=True)
    dtype = x.dtype if residual is None else residual.dtype
    tensor(op, "weight", weight, shape=(x.shape[-1],), dtypes=(dtype,), device=x.device, contiguous_last=True)
    number(op, "eps", eps, low=0, low_open=True)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                    *, rstd: torch.Tensor | None = None):
    """RMSNorm of x [rows, cols] with the Triton kernel; with residual: (y, x + residual), both new tensors.
    `rstd` (fp32 [rows], training's forward) receives 1 / rms of each row."""
    import triton

    from hybridengine.kernels.elementwise import rms_norm_kernel

    dtype = x.dtype if residual is None else residual.dtype
    assert x.dim() == 2 and x.stride(-1) == 1 and weight.shape == (x.shape[1],) and weight.dtype == dtype
    rows, cols = x.shape
    y = torch.empty_like(x, dtype=dtype)
    h = torch.empty_like(x, dtype=dtype) if residual is not None else y
    if rows:
        rms_norm_kernel[(rows,)](
            x, residual if residual is not None else x, weight, y, h, rstd if rstd is not None else y,
            x.stride(0), (residual if residual is not None else x).stride(0), y.stride(0), h.stride(0), cols, eps,
            HAS_RESIDUAL=residual is not None, ROUND_X=x.dtype != dtype, STORE_RSTD=rstd is not None,
            BLOCK=triton.next_power_of_2(cols), num_warps=num_warps(cols),
        )
    return y if residual is None else (y, h)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """RMSNorm over the last dim of x [..., H] (bf16/fp16/fp32, unit last stride) with weight [H] in x's
    dtype; with residual (x's shape) the sum x + residual is normalised and (y, x + residual) returned.
    x may be fp32 beside a 16-bit residual (then the weight's dtype): it is rounded to that dtype first,
    so a projection's fp32 sum (exact mode's row-parallel layers) is rounded here rather than by a kernel
    of its own, the same bits as `rms_norm(x.to(residual.dtype), ...)`. CUDA: one kernel (rounding as
    eager); elsewhere: `rms_norm_ref`."""
    _check("rms_norm", x, weight, eps, residual)
    if not _launch.use_kernel(x):
        return rms_norm_ref(x, weight, eps, residual)
    shape = x.shape
    flat = x.reshape(-1, shape[-1])
    out = rms_norm_triton(flat, weight, eps, None if residual is None else residual.reshape(-1, shape[-1]))
    if residual is None:
        return out.view(shape)
    return out[0].view(shape), out[1].view(shape)


class _RMSNormTrain(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        rstd = torch.empty(x2.shape[0], dtype=torch.float32, device=x.device)
        y = rms_norm_triton(x2, weight, eps, rstd=rstd)
        ctx.save_for_backward(x2, weight, rstd)
        ctx.shape = shape
        return y.view(shape)

    @staticmethod
    def backward(ctx, dy):
        import triton

        from hybridengine.kernels.elementwise import rms_norm_bwd_kernel

        x2, weight, rstd = ctx.saved_tensors
        rows, cols = x2.shape
        dy2 = dy.reshape(rows, cols)
        if dy2.stride(-1) != 1:
            dy2 = dy2.contiguous()
        dx = torch.empty_like(x2)
        programs = max(1, triton.cdiv(rows, BWD_ROWS))
        partial = torch.empty(programs, cols, dtype=torch.float32, device=x2.device)
        if rows:
            rms_norm_bwd_kernel[(programs,)](dy2, x2, weight, rstd, dx, partial, dy2.stride(0), x2.stride(0),
                                             dx.stride(0), rows, cols, BWD_ROWS,
                                             BLOCK=triton.next_power_of_2(cols), num_warps=num_warps(cols))
        else:
            partial.zero_()
        return dx.view(ctx.shape), partial.sum(0).to(weight.dtype), None


def rms_norm_train(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`rms_norm` without the residual, with autograd (training); the kernels on CUDA, the reference elsewhere."""
    _check("rms_norm_train", x, weight, eps, None)
    if not _launch.use_kernel(x):
        return rms_norm_ref(x, weight, eps)
    return _RMSNormTrain.apply(x, weight, eps)


def implementations(device_type: str) -> dict[str, str]:
    """Which implementation each op of this module runs on this device type (for `hybridengine info`)."""
    kind = "Triton" if device_type == "cuda" else "torch reference"
    return {"rms_norm": kind, "rms_norm_train": kind}
