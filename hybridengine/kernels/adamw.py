"""Fused AdamW step of one flat unit (`hybridengine.train.optimizer.FlatAdamW`): one pass reads grad,
moments, master weights and the decay mask (or takes one decay flag for the whole range), and writes
moments, master and the rounded weights (a split master: the bf16 weights are its high half, an int16
tensor its low half).

The math and its operation order are `hybridengine.train.optimizer.adamw_step_ref`'s, with the same fp32
host scalars (`adamw_scalars`), IEEE division and square root (`div_rn`, `sqrt_rn`) and no fp
contraction (`enable_fp_fusion=False`), so kernel and reference agree bit for bit on any backend.
The extra ALU work is free: at 31 B per element (bf16 weights) the kernel is bound by HBM.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridengine.train.optimizer import adamw_scalars

BLOCK_SIZE = 2048
"""Elements per program: 8 per thread at 8 warps (two 16-byte loads per fp32 stream); not tuned (the
kernel is bound by HBM)."""
NUM_WARPS = 8
NONE, ALL, MASKED = 0, 1, 2
"""The kernel's DECAY: no element decays, every element does, or the mask's elements do."""


# fp32 -> bf16 round to nearest even, by hand: the interpreter's cast truncates (Triton 3.9). Same
# bits as the GPU's cvt.rn and as torch's `.to(torch.bfloat16)`, NaN included (canonical 0x7FC0).
@triton.jit
def _round_to_bf16(x):
    bits = x.to(tl.uint32, bitcast=True)
    bits = bits + (0x7FFF + ((bits >> 16) & 1))
    bits = tl.where(x != x, 0x7FC00000, bits)
    return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _store_rounded(ptr, offs, x, valid):
    if ptr.dtype.element_ty == tl.bfloat16:
        tl.store(ptr + offs, _round_to_bf16(x), mask=valid)
    else:
        tl.store(ptr + offs, x.to(ptr.dtype.element_ty), mask=valid)


@triton.jit
def _adamw_kernel(grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, master_ptr, mask_ptr, param_ptr, num_elements,
                  grad_scale, decay_factor, lerp_weight, beta2, one_minus_beta2, neg_step_size,
                  bias_correction2_sqrt, eps, DECAY: tl.constexpr, LERP_FROM_START: tl.constexpr,
                  HAS_PARAM: tl.constexpr, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < num_elements
    g = tl.load(grad_ptr + offs, mask=valid, other=0.0) * grad_scale
    m = tl.load(exp_avg_ptr + offs, mask=valid, other=0.0)
    v = tl.load(exp_avg_sq_ptr + offs, mask=valid, other=0.0)
    if SPLIT:  # fp32 master bits = (bf16 param bits << 16) + int16 low half (optim.join_master)
        hi = tl.load(param_ptr + offs, mask=valid, other=0.0).to(tl.uint16, bitcast=True).to(tl.uint32)
        lo = tl.load(master_ptr + offs, mask=valid, other=0).to(tl.int32)
        p = ((hi << 16).to(tl.int32, bitcast=True) + lo).to(tl.float32, bitcast=True)
    else:
        p = tl.load(master_ptr + offs, mask=valid, other=0.0).to(tl.float32)

    if DECAY == 2:  # MASKED (the kernel sees literals, not the module's ints)
        decay = tl.load(mask_ptr + offs, mask=valid, other=0) != 0
        p = tl.where(decay, p * decay_factor, p)
    elif DECAY == 1:  # ALL
        p = p * decay_factor

    if LERP_FROM_START:  # torch's lerp picks the form by the weight: exact at both ends
        m = m + lerp_weight * (g - m)
    else:
        m = g - (g - m) * (1.0 - lerp_weight)
    v = v * beta2 + (one_minus_beta2 * g) * g
    denom = tl.div_rn(tl.sqrt_rn(v), bias_correction2_sqrt) + eps
    p = p + tl.div_rn(neg_step_size * m, denom)

    tl.store(exp_avg_ptr + offs, m, mask=valid)
    tl.store(exp_avg_sq_ptr + offs, v, mask=valid)
    if SPLIT:  # optim.split_master: high half rounded half away from zero, low half the exact rest
        bits = p.to(tl.uint32, bitcast=True)
        hi = (bits + 0x8000) >> 16
        lo = (bits - (hi << 16)).to(tl.int32, bitcast=True)
        nan = p != p  # the canonical NaN, as optim.split_master (rounding its bits could wrap to 0)
        hi = tl.where(nan, 0x7FC0, hi)
        lo = tl.where(nan, 0, lo)
        tl.store(param_ptr + offs, hi.to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=valid)
        tl.store(master_ptr + offs, lo.to(tl.int16), mask=valid)
    else:
        _store_rounded(master_ptr, offs, p, valid)
        if HAS_PARAM:
            _store_rounded(param_ptr, offs, p, valid)


def adamw_step_(master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, grad: torch.Tensor,
                decay_mask: torch.Tensor | bool, param: torch.Tensor | None = None, *, lr: float, beta1: float,
                beta2: float, eps: float, weight_decay: float, step: int, grad_scale: float = 1.0,
                block_size: int | None = None) -> None:
    """`adamw_step_ref` in one Triton launch: same arguments, same results, in place. Internal: the
    caller (`FlatAdamW`) built the tensors and validated the step, so the checks are asserts."""
    n = master.numel()
    masked = isinstance(decay_mask, torch.Tensor)
    units = (exp_avg, exp_avg_sq, grad) + ((decay_mask,) if masked else ()) + (() if param is None else (param,))
    assert all(t.shape == (n,) and t.is_contiguous() and t.device == master.device for t in (master, *units)), \
        "adamw_step_: master, moments, grad, mask and param must be contiguous [n] tensors on one device"
    assert exp_avg.dtype == exp_avg_sq.dtype == grad.dtype == torch.float32, "adamw_step_: fp32 moments and grad"
    assert (decay_mask.dtype in (torch.uint8, torch.bool) if masked else isinstance(decay_mask, bool)), \
        "adamw_step_: a uint8 or bool decay mask, or a bool for the whole range"
    assert param is None or param.dtype in (torch.bfloat16, torch.float16, torch.float32), "adamw_step_: param dtype"
    assert (master.dtype in (torch.bfloat16, torch.float16, torch.float32) if master.dtype != torch.int16
            else param is not None and param.dtype == torch.bfloat16), \
        "adamw_step_: a bf16/fp16/fp32 master, or an int16 low half with its bf16 param"
    if block_size is None:
        block_size = BLOCK_SIZE
    elif block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two >= 16, got {block_size}")
    if n == 0:
        return
    s = adamw_scalars(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, step=step)
    if masked and decay_mask.dtype == torch.bool:
        decay_mask = decay_mask.view(torch.uint8)
    _adamw_kernel[(triton.cdiv(n, block_size),)](
        # without a mask the kernel never reads mask_ptr: any tensor of the launch stands in for it
        grad, exp_avg, exp_avg_sq, master, decay_mask if masked else grad, master if param is None else param, n,
        float(grad_scale), s["decay_factor"], s["lerp_weight"], s["beta2"], s["one_minus_beta2"],
        s["neg_step_size"], s["bias_correction2_sqrt"], s["eps"],
        DECAY=MASKED if masked else ALL if decay_mask else NONE, LERP_FROM_START=s["lerp_weight"] < 0.5,
        HAS_PARAM=param is not None, SPLIT=master.dtype == torch.int16,
        BLOCK=block_size,
        num_warps=NUM_WARPS, enable_fp_fusion=False)
