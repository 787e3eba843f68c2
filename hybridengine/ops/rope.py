"""Rotary embedding of q and k (HF half-split layout) with autograd: the training layers' RoPE.

Layers: `rope_ref` (plain torch, also the rotation `rope_store_kv` applies before its store),
`rope_triton_` (the launcher of `kernels.elementwise.rope_kernel`, in place), `_RopeTrain` (the autograd
Function over it) and `rope_train`, the op, which takes the kernel on CUDA and the reference elsewhere.
The rollout rotates q and k inside the KV store's kernel (`hybridengine.ops.kv_store.rope_store_kv`).
"""

from __future__ import annotations

import torch

from hybridengine.checks import FLOAT_DTYPES, tensor
from hybridengine.ops import _launch


def rope_ref(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """q [N, Hq, D], k [N, Hk, D], cos/sin [N, D]: x * cos + rotate_half(x) * sin (HF half-split), new tensors."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)

    def rotate(x):
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin

    return rotate(q), rotate(k)


def check_rope(op: str, q, k, cos, sin) -> None:
    """q [N, Hq, D] and k [N, Hk, D] of one float dtype, D even; cos, sin [N, D] in q's dtype; all on q's
    device with a unit last stride."""
    tensor(op, "q", q, dim=3, dtypes=FLOAT_DTYPES, contiguous_last=True)
    n, _, d = q.shape
    tensor(op, "k", k, dim=3, dtypes=(q.dtype,), device=q.device, contiguous_last=True)
    if k.shape[0] != n or k.shape[2] != d:
        raise ValueError(f"{op}: k must be [{n}, heads, {d}] as q, got shape {tuple(k.shape)}")
    if d % 2:
        raise ValueError(f"{op}: head_dim must be even, got {d}")
    for name, t in (("cos", cos), ("sin", sin)):
        tensor(op, name, t, shape=(n, d), dtypes=(q.dtype,), device=q.device, contiguous_last=True)


def rope_triton_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """The rotation in place with the Triton kernel (one program per token); returns (q, k)."""
    import triton

    from hybridengine.kernels.elementwise import rope_kernel

    assert q.dim() == 3 and k.dim() == 3 and cos.shape == (q.shape[0], q.shape[2]) and q.stride(-1) == 1
    N, Hq, D = q.shape
    if N:
        rope_kernel[(N,)](
            q, k, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), sin.stride(0),
            NUM_Q_HEADS=Hq, NUM_K_HEADS=k.shape[1], HALF=D // 2,
            BLOCK_H=triton.next_power_of_2(max(Hq, k.shape[1])), BLOCK_HALF=triton.next_power_of_2(D // 2),
            # No FMA contraction: eager rounds each product before the sum; with it, fp32 (and fp16, which
            # LLVM narrows to half mul + add) differ from eager in the last bit on the GPU.
            num_warps=4, enable_fp_fusion=False,
        )
    return q, k


class _RopeTrain(torch.autograd.Function):
    """Out of place; the backward is the rotation by the opposite angle (sin -> -sin)."""

    @staticmethod
    def forward(ctx, q, k, cos, sin):
        ctx.save_for_backward(cos, sin)
        ctx.shapes = (q.shape, k.shape)
        return rope_triton_(q.clone(memory_format=torch.contiguous_format),
                            k.clone(memory_format=torch.contiguous_format), cos, sin)

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors
        grads = [torch.zeros(shape, dtype=cos.dtype, device=cos.device) if g is None
                 else g.clone(memory_format=torch.contiguous_format)
                 for g, shape in zip((dq, dk), ctx.shapes)]
        dq, dk = rope_triton_(grads[0], grads[1], cos, -sin)
        return dq, dk, None, None


def rope_train(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Rotary embedding of q [N, Hq, D] and k [N, Hk, D] by cos, sin [N, D] (HF half-split layout, one dtype,
    unit last strides, D even), with autograd; returns new (q, k). CUDA: the kernel (bit for bit
    `rope_ref`, each product and sum rounded as eager); elsewhere: `rope_ref`."""
    check_rope("rope_train", q, k, cos, sin)
    if not _launch.use_kernel(q):
        return rope_ref(q, k, cos, sin)
    return _RopeTrain.apply(q, k, cos, sin)


def implementations(device_type: str) -> dict[str, str]:
    """Which implementation each op of this module runs on this device type (for `hybridengine info`)."""
    return {"rope_train": "Triton" if device_type == "cuda" else "torch reference"}
