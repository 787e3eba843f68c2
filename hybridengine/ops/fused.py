"""Fused elementwise steps of the rollout forward: residual add + RMSNorm, rotary embedding, SiLU * up.

Three layers per op, as elsewhere: the plain-torch reference (`*_ref`, the module code of
hybridengine.model.decoder written as functions), the Triton launcher (`*_triton`, kernels in
`hybridengine.kernels.elementwise`), and the public function, which takes the kernel on CUDA and
the reference elsewhere. The model uses them on the generation path only (the paged forward under
the engine's attention metadata, no autograd); training keeps the eager module code, whose
autograd the trainer relies on.

A decode step of Qwen2.5-1.5B at B = 64 spent 1.8 ms of its 4.1 GPU ms in ~30 eager elementwise
kernels per layer (profile_decode on an H200, 2026-11-30); these ops make it 4 per layer.
"""

from __future__ import annotations

import torch

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _check_rows(op: str, name: str, t, n_cols: int | None = None) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() != 2:
        raise ValueError(f"{op}: {name} must be a 2-D [rows, cols] tensor, got "
                         f"{type(t).__name__ if not isinstance(t, torch.Tensor) else tuple(t.shape)}")
    if t.dtype not in _DTYPES:
        raise ValueError(f"{op}: {name} must be bf16, fp16 or fp32, got {t.dtype}")
    if t.stride(-1) != 1:
        raise ValueError(f"{op}: {name} must have unit stride in its last dim, got strides {t.stride()}")
    if n_cols is not None and t.shape[-1] != n_cols:
        raise ValueError(f"{op}: {name} has {t.shape[-1]} columns, expected {n_cols}")


def _use_kernel(t: torch.Tensor) -> bool:
    return t.is_cuda


# --------------------------------------------------------------------------------------------
# residual add + RMSNorm


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """HF's RMSNorm of x (+ residual): normalise in fp32, round, scale by weight in the dtype.
    With residual: (y, x + residual)."""
    h = x if residual is None else x + residual
    h32 = h.float()
    y = weight * (h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)
    return y if residual is None else (y, h)


def _check_norm(op, x, weight, eps, residual):
    _check_rows(op, "x", x)
    if not isinstance(weight, torch.Tensor) or weight.shape != (x.shape[1],) or weight.dtype != x.dtype:
        raise ValueError(f"{op}: weight must be [{x.shape[1]}] {x.dtype}, got "
                         f"{tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__}"
                         f"{' ' + str(weight.dtype) if isinstance(weight, torch.Tensor) else ''}")
    if not weight.is_contiguous():
        raise ValueError(f"{op}: weight must be contiguous")
    if residual is not None:
        _check_rows(op, "residual", residual, x.shape[1])
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(f"{op}: residual must be {tuple(x.shape)} {x.dtype}, got {tuple(residual.shape)} "
                             f"{residual.dtype}")
    if not (isinstance(eps, float) and eps > 0):
        raise ValueError(f"{op}: eps must be a float > 0, got {eps!r}")
    for name, t in (("weight", weight), ("residual", residual)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{op}: {name} is on {t.device}, x on {x.device}")


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                    *, rstd: torch.Tensor | None = None):
    """`rms_norm` with the Triton kernel; x [rows, cols]. With residual: (y, x + residual), both new tensors.
    `rstd` (fp32 [rows], training's forward) receives 1 / rms of each row."""
    import triton

    from hybridengine.kernels.elementwise import rms_norm_kernel

    _check_norm("rms_norm", x, weight, eps, residual)
    rows, cols = x.shape
    y = torch.empty_like(x)
    h = torch.empty_like(x) if residual is not None else y
    if rows:
        rms_norm_kernel[(rows,)](
            x, residual if residual is not None else x, weight, y, h, rstd if rstd is not None else y,
            x.stride(0), (residual if residual is not None else x).stride(0), y.stride(0), h.stride(0), cols, eps,
            HAS_RESIDUAL=residual is not None, STORE_RSTD=rstd is not None, BLOCK=triton.next_power_of_2(cols),
            num_warps=4 if cols <= 2048 else 8,
        )
    return y if residual is None else (y, h)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """RMSNorm over the last dim of x [..., H] (+ residual first; then returns (y, x + residual))."""
    if not _use_kernel(x):
        return rms_norm_ref(x, weight, eps, residual)
    shape = x.shape
    flat = x.reshape(-1, shape[-1])
    out = rms_norm_triton(flat, weight, eps, None if residual is None else residual.reshape(-1, shape[-1]))
    if residual is None:
        return out.view(shape)
    return out[0].view(shape), out[1].view(shape)


# --------------------------------------------------------------------------------------------
# rotary embedding


def rope_ref(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """q [N, Hq, D], k [N, Hk, D], cos/sin [N, D]: x * cos + rotate_half(x) * sin (HF half-split), new tensors."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)

    def rotate(x):
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin

    return rotate(q), rotate(k)


def _check_rope(op, q, k, cos, sin):
    for name, t in (("q", q), ("k", k)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3 or t.dtype not in _DTYPES or t.stride(-1) != 1:
            raise ValueError(f"{op}: {name} must be a 3-D [tokens, heads, head_dim] bf16/fp16/fp32 tensor with unit "
                             f"last stride")
    N, _, D = q.shape
    if k.shape[0] != N or k.shape[2] != D or k.dtype != q.dtype:
        raise ValueError(f"{op}: k must be [{N}, heads, {D}] {q.dtype}, got {tuple(k.shape)} {k.dtype}")
    if D % 2:
        raise ValueError(f"{op}: head_dim must be even, got {D}")
    for name, t in (("cos", cos), ("sin", sin)):
        if not isinstance(t, torch.Tensor) or t.shape != (N, D) or t.dtype != q.dtype or t.stride(-1) != 1:
            raise ValueError(f"{op}: {name} must be [{N}, {D}] {q.dtype} with unit last stride, got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    for name, t in (("k", k), ("cos", cos), ("sin", sin)):
        if t.device != q.device:
            raise ValueError(f"{op}: {name} is on {t.device}, q on {q.device}")


def rope_triton_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """`rope` in place with the Triton kernel; returns (q, k)."""
    import triton

    from hybridengine.kernels.elementwise import rope_kernel

    _check_rope("rope", q, k, cos, sin)
    N, Hq, D = q.shape
    if N:
        rope_kernel[(N,)](
            q, k, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), sin.stride(0),
            NUM_Q_HEADS=Hq, NUM_K_HEADS=k.shape[1], HALF=D // 2,
            BLOCK_H=triton.next_power_of_2(max(Hq, k.shape[1])), BLOCK_HALF=triton.next_power_of_2(D // 2),
            # No FMA contraction: eager rounds each product before the sum. With it, fp32 (and fp16, which
            # LLVM narrows to half mul + add) differed from eager in the last bit on the H200 (2026-11-30).
            num_warps=4, enable_fp_fusion=False,
        )
    return q, k


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """Rotary embedding of q and k: in place on CUDA (the kernel), new tensors elsewhere; returns (q, k)."""
    if not _use_kernel(q):
        return rope_ref(q, k, cos, sin)
    return rope_triton_(q, k, cos, sin)


# --------------------------------------------------------------------------------------------
# SiLU(gate) * up


def silu_mul_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(gate) * up


def silu_mul_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    import triton

    from hybridengine.kernels.elementwise import silu_mul_kernel

    _check_rows("silu_mul", "gate", gate)
    _check_rows("silu_mul", "up", up, gate.shape[1])
    if up.shape != gate.shape or up.dtype != gate.dtype or up.device != gate.device:
        raise ValueError(f"silu_mul: up must be {tuple(gate.shape)} {gate.dtype} on {gate.device}, got "
                         f"{tuple(up.shape)} {up.dtype} on {up.device}")
    rows, cols = gate.shape
    out = torch.empty_like(gate)
    # 1024-column programs: within 0.4 us of the best launch at every decode shape of bench.probe_elementwise
    # (H200, Qwen2.5-1.5B / Qwen2-7B, B = 64-256); 4096-column ones took 4.21 against 2.80 us at 1.5B, B = 128.
    block = min(1024, triton.next_power_of_2(cols))
    if rows:
        silu_mul_kernel[(rows, triton.cdiv(cols, block))](gate, up, out, gate.stride(0), up.stride(0), out.stride(0),
                                                          cols, BLOCK=block, num_warps=4)
    return out


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up over [..., I]."""
    if not _use_kernel(gate):
        return silu_mul_ref(gate, up)
    shape = gate.shape
    return silu_mul_triton(gate.reshape(-1, shape[-1]), up.reshape(-1, shape[-1])).view(shape)


# --------------------------------------------------------------------------------------------
# weights that lie back to back


def stacked_rows(*weights: torch.Tensor) -> torch.Tensor | None:
    """One [sum of rows, cols] view over 2-D weights (or one [sum] view over 1-D biases) stored back
    to back: the flat buffer keeps a layer's q/k/v weights, its q/k/v biases and its gate/up weights
    adjacent (see layout.param_specs), so one GEMM computes them; None where they are not adjacent,
    contiguous, of one dtype and width."""
    first = weights[0]
    for w in weights:
        if (w.dim() != first.dim() or w.dim() not in (1, 2) or not w.is_contiguous() or w.dtype != first.dtype
                or w.device != first.device or w.shape[1:] != first.shape[1:]):
            return None
    for a, b in zip(weights, weights[1:]):
        if (a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
                or a.data_ptr() + a.numel() * a.element_size() != b.data_ptr()):
            return None
    rows = sum(w.shape[0] for w in weights)
    if first.dim() == 1:
        return first.as_strided((rows,), (1,))
    return first.as_strided((rows, first.shape[1]), (first.shape[1], 1))


# --------------------------------------------------------------------------------------------
# training: the same ops with their backward (autograd Functions over the kernels)

RMS_BWD_ROWS = 32
"""Rows per program of the RMSNorm backward: each program sums its rows' dw in registers, the
launcher sums the [programs, H] partials (a [rows / 32, H] fp32 buffer)."""


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
        programs = max(1, triton.cdiv(rows, RMS_BWD_ROWS))
        partial = torch.empty(programs, cols, dtype=torch.float32, device=x2.device)
        if rows:
            rms_norm_bwd_kernel[(programs,)](dy2, x2, weight, rstd, dx, partial, dy2.stride(0), x2.stride(0),
                                             dx.stride(0), rows, cols, RMS_BWD_ROWS,
                                             BLOCK=triton.next_power_of_2(cols), num_warps=4 if cols <= 2048 else 8)
        else:
            partial.zero_()
        return dx.view(ctx.shape), partial.sum(0).to(weight.dtype), None


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
        block = min(4096, triton.next_power_of_2(cols))
        if rows:
            silu_mul_bwd_kernel[(rows, triton.cdiv(cols, block))](
                dy2, g2, u2, dg, du, dy2.stride(0), g2.stride(0), u2.stride(0), dg.stride(0), du.stride(0), cols,
                BLOCK=block, num_warps=4)
        return dg.view(ctx.shape), du.view(ctx.shape)


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


def rms_norm_train(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`rms_norm` with autograd (training); the kernels on CUDA, the reference elsewhere."""
    if not _use_kernel(x):
        return rms_norm_ref(x, weight, eps)
    return _RMSNormTrain.apply(x, weight, eps)


def silu_mul_train(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`silu_mul` with autograd (training)."""
    if not _use_kernel(gate):
        return silu_mul_ref(gate, up)
    return _SiluMulTrain.apply(gate, up)


def rope_train(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """`rope` with autograd (training), out of place."""
    if not _use_kernel(q):
        return rope_ref(q, k, cos, sin)
    return _RopeTrain.apply(q, k, cos, sin)


def implementations(device_type: str) -> dict[str, str]:
    kind = "Triton" if device_type == "cuda" else "torch reference"
    return {"rms_norm (rollout)": kind, "rope (rollout)": kind, "silu_mul (rollout)": kind}
