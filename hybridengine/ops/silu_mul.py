"""SiLU(gate) * up (the MLP's activation): the rollout op and the training op with autograd.

Layers: `silu_mul_ref` (plain torch), `silu_mul_triton` (the launcher of `kernels.elementwise.silu_mul_kernel`
over [rows, cols]), the ops `silu_mul` (rollout, no autograd) and `silu_mul_train` (training: `_SiluMulTrain`,
the forward kernel and a backward kernel). The ops take the kernels on CUDA and elsewhere `silu_mul_torch`
(the reference's math, each element on the same vector path).
"""

from __future__ import annotations

import torch

from hybridengine.checks import FLOAT_DTYPES, tensor
from hybridengine.ops import _launch

MAX_BLOCK = 1024
"""Columns per program of the forward kernel: a row of the intermediate size is split over several
programs, which keeps every SM busy at decode batch sizes (`hybridengine_bench.probes.probe_elementwise`
times the choice)."""
MAX_BLOCK_BWD = 4096
"""Columns per program of the backward kernel."""


def silu_mul_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(gate) * up


LANE_PAD = 64
"""The torch path's flat length is padded to a multiple of this (elements): more than twice the widest CPU
vector of floats, so no element falls in the scalar tail of torch's vectorized loops."""


def silu_mul_torch(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up off the kernels (differentiable): silu over gate's elements as one contiguous, zero-padded
    run, so that every element goes through the same vectorized exp. torch's CPU loops take two vectors at a
    time and leave the rest of each contiguous run to a scalar loop whose exp rounds some values the other
    way; which elements those are would otherwise depend on the row length (a tensor-parallel half has its
    own) and the layout, not on the value."""
    n = gate.numel()
    flat = torch.nn.functional.pad(gate.reshape(-1), (0, -n % LANE_PAD))
    return torch.nn.functional.silu(flat)[:n].view(gate.shape) * up


def _check(op: str, gate, up) -> None:
    if isinstance(gate, torch.Tensor) and gate.dim() == 0:
        raise ValueError(f"{op}: gate must be [..., intermediate], got a 0-D tensor")
    tensor(op, "gate", gate, dtypes=FLOAT_DTYPES, contiguous_last=True)
    tensor(op, "up", up, shape=gate.shape, dtypes=(gate.dtype,), device=gate.device, contiguous_last=True)


def silu_mul_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up over [rows, cols] with the Triton kernel (silu rounded to the dtype first, as eager)."""
    import triton

    from hybridengine.kernels.elementwise import silu_mul_kernel

    assert gate.dim() == 2 and up.shape == gate.shape and gate.stride(-1) == 1 and up.stride(-1) == 1
    rows, cols = gate.shape
    out = torch.empty_like(gate)
    block = min(MAX_BLOCK, triton.next_power_of_2(cols))
    if rows:
        silu_mul_kernel[(rows, triton.cdiv(cols, block))](gate, up, out, gate.stride(0), up.stride(0), out.stride(0),
                                                          cols, BLOCK=block, num_warps=4)
    return out


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up over [..., I] (one shape and float dtype, unit last strides: views of one [.., 2I]
    GEMM output are fine). CUDA: the kernel; elsewhere: `silu_mul_torch`."""
    _check("silu_mul", gate, up)
    if not _launch.use_kernel(gate):
        return silu_mul_torch(gate, up)
    shape = gate.shape
    return silu_mul_triton(gate.reshape(-1, shape[-1]), up.reshape(-1, shape[-1])).view(shape)


class _SiluMulTrain(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        shape = gate.shape
        g2, u2 = gate.reshape(-1, shape[-1]), up.reshape(-1, shape[-1])
        ctx.save_for_backward(g2, u2)
        ctx.shape = shape
        return silu_mul_triton(g2, u2).view(shape)

    @staticmethod
    def backward(ctx, dy):
        import triton

        from hybridengine.kernels.elementwise import silu_mul_bwd_kernel

        g2, u2 = ctx.saved_tensors
        rows, cols = g2.shape
        dy2 = dy.reshape(rows, cols)
        if dy2.stride(-1) != 1:
            dy2 = dy2.contiguous()
        dg, du = torch.empty_like(g2), torch.empty_like(u2)
        block = min(MAX_BLOCK_BWD, triton.next_power_of_2(cols))
        if rows:
            silu_mul_bwd_kernel[(rows, triton.cdiv(cols, block))](
                dy2, g2, u2, dg, du, dy2.stride(0), g2.stride(0), u2.stride(0), dg.stride(0), du.stride(0), cols,
                BLOCK=block, num_warps=4)
        return dg.view(ctx.shape), du.view(ctx.shape)


def silu_mul_train(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`silu_mul` with autograd (training)."""
    _check("silu_mul_train", gate, up)
    if not _launch.use_kernel(gate):
        return silu_mul_torch(gate, up)
    return _SiluMulTrain.apply(gate, up)


def implementations(device_type: str) -> dict[str, str]:
    """Which implementation each op of this module runs on this device type (for `hybridengine info`)."""
    kind = "Triton" if device_type == "cuda" else "torch (padded to whole vectors)"
    return {"silu_mul": kind, "silu_mul_train": kind}
