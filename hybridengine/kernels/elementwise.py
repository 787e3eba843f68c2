"""Triton kernels of the model's elementwise steps: residual add + RMSNorm, rotary embedding of q
and k, SiLU(gate) * up, and the backward passes of the training variants.

Each replaces a chain of eager torch kernels (RMSNorm alone is seven: cast, square, mean, add,
rsqrt, multiply, cast, scale) with one pass, and rounds where eager torch rounds, so the outputs
are those of the module code in hybridengine.model.decoder up to the order of one fp32 sum (RMSNorm) and
the fp32 exp (SiLU). The launchers, checks and plain-torch references are in `hybridengine.ops.rms_norm`,
`hybridengine.ops.rope` and `hybridengine.ops.silu_mul`; `rope_angles` and `rope_heads_` also serve the
fused RoPE + KV store of `kernels.kv_cache`.
"""

import triton
import triton.language as tl


@triton.jit
def _round(x, dtype: tl.constexpr):
    """fp32 -> dtype, round to nearest even (torch's rounding). For bf16 the rounding is done on the
    bits, then the cast is exact: the Triton interpreter's bf16 cast truncates, and the tests compare
    bit for bit. NaN payloads may change; NaN stays NaN."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True).to(tl.bfloat16)
    else:
        return x.to(dtype)


@triton.jit
def rms_norm_kernel(
    X, Residual, W, Y, Residual_out, Rstd,
    stride_x, stride_r, stride_y, stride_ro, n_cols, eps,
    HAS_RESIDUAL: tl.constexpr, ROUND_X: tl.constexpr, STORE_RSTD: tl.constexpr, BLOCK: tl.constexpr,
):
    """One program per row: h = x (+ residual, rounded to the dtype and stored as the new residual),
    y = w * (h * rsqrt(mean(h^2) + eps)) with the normalisation in fp32, cast to the dtype before the
    scale by w (HF's order of rounding). ROUND_X (with a residual): x is fp32 and first rounded to the
    residual's dtype, as `x.to(dtype)` would. STORE_RSTD (training) keeps rstd [rows] fp32 for the backward."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    h = tl.load(X + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(Residual + row * stride_r + cols, mask=ok, other=0.0)
        if ROUND_X:
            h = _round(h, r.dtype)
        h = _round(h.to(tl.float32) + r.to(tl.float32), r.dtype)
        tl.store(Residual_out + row * stride_ro + cols, h, mask=ok)
    h32 = h.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(h32 * h32, 0) / n_cols + eps)
    if STORE_RSTD:
        tl.store(Rstd + row, rstd)
    normed = _round(h32 * rstd, h.dtype)
    w = tl.load(W + cols, mask=ok, other=0.0)
    tl.store(Y + row * stride_y + cols, _round(w.to(tl.float32) * normed.to(tl.float32), h.dtype), mask=ok)


@triton.jit
def rope_angles(cos_row, sin_row, d, d_ok, HALF: tl.constexpr):
    """One token's cos and sin halves (cos1, sin1, cos2, sin2) at columns d and HALF + d."""
    cos1 = tl.load(cos_row + d, mask=d_ok, other=0.0)
    cos2 = tl.load(cos_row + HALF + d, mask=d_ok, other=0.0)
    sin1 = tl.load(sin_row + d, mask=d_ok, other=0.0)
    sin2 = tl.load(sin_row + HALF + d, mask=d_ok, other=0.0)
    return cos1, sin1, cos2, sin2


@triton.jit
def rope_heads_(ptr, ok, cos1, sin1, cos2, sin2, HALF: tl.constexpr):
    """Rotate in place the heads at ptr ([BLOCK_H, BLOCK_HALF] pointers to each head's first half; `ok`
    masks heads and columns), HF half-split: x1' = x1 * cos1 - x2 * sin1, x2' = x2 * cos2 + x1 * sin2,
    each product and the sum rounded to the dtype as eager `x * cos + rotate_half(x) * sin` rounds them.
    Returns the rotated halves (x1', x2')."""
    x1 = tl.load(ptr, mask=ok, other=0.0)
    x2 = tl.load(ptr + HALF, mask=ok, other=0.0)
    dt = x1.dtype
    a1 = _round(x1.to(tl.float32) * cos1[None, :].to(tl.float32), dt)
    b1 = _round(-x2.to(tl.float32) * sin1[None, :].to(tl.float32), dt)
    a2 = _round(x2.to(tl.float32) * cos2[None, :].to(tl.float32), dt)
    b2 = _round(x1.to(tl.float32) * sin2[None, :].to(tl.float32), dt)
    y1 = _round(a1.to(tl.float32) + b1.to(tl.float32), dt)
    y2 = _round(a2.to(tl.float32) + b2.to(tl.float32), dt)
    tl.store(ptr, y1, mask=ok)
    tl.store(ptr + HALF, y2, mask=ok)
    return y1, y2


@triton.jit
def rope_kernel(
    Q, K, Cos, Sin,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_ct, stride_st,
    NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """One program per token, in place over all its q and k heads (`rope_heads_`)."""
    token = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)
    d_ok = d < HALF
    cos1, sin1, cos2, sin2 = rope_angles(Cos + token * stride_ct, Sin + token * stride_st, d, d_ok, HALF)
    h = tl.arange(0, BLOCK_H)
    rope_heads_(Q + token * stride_qt + h[:, None] * stride_qh + d[None, :],
                (h[:, None] < NUM_Q_HEADS) & d_ok[None, :], cos1, sin1, cos2, sin2, HALF)
    rope_heads_(K + token * stride_kt + h[:, None] * stride_kh + d[None, :],
                (h[:, None] < NUM_K_HEADS) & d_ok[None, :], cos1, sin1, cos2, sin2, HALF)


@triton.jit
def silu_mul_kernel(Gate, Up, Out, stride_g, stride_u, stride_o, n_cols, BLOCK: tl.constexpr):
    """Grid (rows, column blocks): out = silu(gate) * up, silu rounded to the dtype first (as eager)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n_cols
    g = tl.load(Gate + row * stride_g + cols, mask=ok, other=0.0)
    u = tl.load(Up + row * stride_u + cols, mask=ok, other=0.0)
    g32 = g.to(tl.float32)
    act = _round(g32 / (1.0 + tl.exp(-g32)), g.dtype)
    tl.store(Out + row * stride_o + cols, _round(act.to(tl.float32) * u.to(tl.float32), g.dtype), mask=ok)


# --------------------------------------------------------------------------------------------
# training: the backward passes (the forward kernels above serve both; RMSNorm stores rstd)


@triton.jit
def rms_norm_bwd_kernel(
    DY, X, W, Rstd, DX, DW_partial,
    stride_dy, stride_x, stride_dx, n_rows, n_cols, rows_per_program,
    BLOCK: tl.constexpr,
):
    """Rows [pid * rows_per_program, ...): dx = rstd * (g - xhat * mean(g * xhat)) with g = dy * w and
    xhat = x * rstd, in fp32 (the derivative of the unrounded normalisation); this program's share of
    dw = sum_rows dy * round(xhat) goes to DW_partial[pid] (fp32), summed by the launcher."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], tl.float32)
    start = pid * rows_per_program
    for i in range(rows_per_program):
        row = (start + i).to(tl.int64)
        if row < n_rows:
            x_raw = tl.load(X + row * stride_x + cols, mask=ok, other=0.0)
            x = x_raw.to(tl.float32)
            dy = tl.load(DY + row * stride_dy + cols, mask=ok, other=0.0).to(tl.float32)
            rstd = tl.load(Rstd + row)
            xhat = x * rstd
            g = dy * w
            dx = rstd * (g - xhat * (tl.sum(g * xhat, 0) / n_cols))
            tl.store(DX + row * stride_dx + cols, dx.to(x_raw.dtype), mask=ok)
            dw += dy * _round(xhat, x_raw.dtype).to(tl.float32)
    tl.store(DW_partial + pid.to(tl.int64) * n_cols + cols, dw, mask=ok)


@triton.jit
def silu_mul_bwd_kernel(DY, Gate, Up, DGate, DUp, stride_dy, stride_g, stride_u, stride_dg, stride_du, n_cols,
                        BLOCK: tl.constexpr):
    """d gate = dy * up * s * (1 + g * (1 - s)), d up = dy * silu(g), s = sigmoid(g), in fp32."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n_cols
    g_raw = tl.load(Gate + row * stride_g + cols, mask=ok, other=0.0)
    g = g_raw.to(tl.float32)
    u = tl.load(Up + row * stride_u + cols, mask=ok, other=0.0).to(tl.float32)
    dy = tl.load(DY + row * stride_dy + cols, mask=ok, other=0.0).to(tl.float32)
    s = 1.0 / (1.0 + tl.exp(-g))
    tl.store(DGate + row * stride_dg + cols, (dy * u * s * (1.0 + g * (1.0 - s))).to(g_raw.dtype), mask=ok)
    tl.store(DUp + row * stride_du + cols, (dy * g * s).to(g_raw.dtype), mask=ok)
