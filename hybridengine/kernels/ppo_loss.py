"""Row kernels of the fused PPO loss: softmax statistics of a chunk of logits, and the logits'
gradient written in place.

The LM-head matmuls stay in cuBLAS (`hybridengine.ops.lm_head` drives the chunk loop); these two
kernels do the part of a log-softmax that torch would spread over ~10 full-size elementwise
passes. Both stream each row in `BLOCK_V` slices and compute in fp32 after the load (bf16
arithmetic in the Triton interpreter is silently wrong, and fp32 is what the math needs anyway).

For a row of logits `x` with `z = x * inv_t` (`inv_t = 1 / T`), `lse = logsumexp(z)`, `log p = z - lse`:

- `logit_stats`: `lse`, `logp = z[target] - lse`, `entropy = -sum p log p`, in one read of the
  row (online max/sum-exp; the entropy sum is kept relative to the running max, so
  `entropy = log s - a / s` never subtracts two large numbers). `z = x * inv_t` with one inverse
  temperature for all rows or one per row (a pointer: the sampler's batch mixes temperatures).
  One program per row and a `BLOCK_V` chosen from the vocabulary size alone, so a row's results
  are the same bits whatever the other rows and their number: the sampler and the trainer call it
  on the same logits rows and get the same log-probs (`hybridengine.ops.chosen_logprobs`).
- `logit_grad_`: given per-row coefficients `g_logp = dL/dlogp` and `g_ent = dL/dentropy`,
  overwrites the row with `dL/dx = (g_logp * (onehot - p) - g_ent * p * (log p + entropy)) / T`
  (one read, one write).

Bytes per logit: 2 reads + 1 write in the logits' dtype (6 B in bf16), against ~70 B for the
eager torch chain (upcast, log_softmax, exp, mul, sum, and their backward).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_NEG_BIG = tl.constexpr(-1.0e30)
"""Initial running max: finite, so the first rescale is exp(-huge) = 0 and never 0 * inf. (A
constexpr: compiled kernels may read no other globals; the interpreter does not check that.)"""

MAX_BLOCK_V = 4096
"""Vocabulary slice per loop step: 16 fp32 values per thread at 8 warps (not tuned)."""
NUM_WARPS = 8


# fp32 -> bf16, round to nearest even, by hand: the interpreter's cast truncates (Triton 3.9),
# which doubled the kernel's error in CPU tests. Same bits as the GPU's cvt.rn; free in a
# memory-bound loop.
@triton.jit
def _round_to_bf16(x):
    bits = x.to(tl.uint32, bitcast=True)
    bits = bits + (0x7FFF + ((bits >> 16) & 1))
    return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _logit_stats_kernel(logits_ptr, stride_row, targets_ptr, lse_ptr, logp_ptr, entropy_ptr, num_cols,
                        inv_temperature, BLOCK_V: tl.constexpr, PER_ROW_TEMPERATURE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    if PER_ROW_TEMPERATURE:  # inv_temperature is an fp32 [rows] pointer
        inv_temperature = tl.load(inv_temperature + row)
    cols = tl.arange(0, BLOCK_V)
    m = tl.full((), _NEG_BIG, tl.float32)  # running max of z
    s = tl.zeros((), tl.float32)  # sum exp(z - m)
    a = tl.zeros((), tl.float32)  # sum exp(z - m) * (z - m)
    for start in range(0, num_cols, BLOCK_V):
        offs = start + cols
        z = tl.load(base + offs, mask=offs < num_cols, other=-float("inf")).to(tl.float32) * inv_temperature
        m_new = tl.maximum(m, tl.max(z, 0))
        e = tl.exp(z - m_new)
        # e == 0 for padding (and -inf logits): keep 0 * inf out of the sum.
        ez = e * tl.where(e > 0, z - m_new, 0.0)
        scale = tl.exp(m - m_new)
        a = scale * (a + s * (m - m_new)) + tl.sum(ez, 0)
        s = s * scale + tl.sum(e, 0)
        m = m_new
    log_s = tl.log(s)
    lse = m + log_s
    target = tl.load(targets_ptr + row)
    ok = (target >= 0) & (target < num_cols)  # the op validates; this only keeps the load in bounds
    z_target = tl.load(base + target, mask=ok, other=0.0).to(tl.float32) * inv_temperature
    tl.store(lse_ptr + row, lse)
    tl.store(logp_ptr + row, z_target - lse)
    tl.store(entropy_ptr + row, log_s - a / s)


@triton.jit
def _logit_grad_kernel(logits_ptr, stride_row, targets_ptr, lse_ptr, entropy_ptr, grad_logp_ptr,
                       grad_entropy_ptr, num_cols, inv_temperature, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    cols = tl.arange(0, BLOCK_V)
    lse = tl.load(lse_ptr + row)
    entropy = tl.load(entropy_ptr + row)
    g_logp = tl.load(grad_logp_ptr + row)
    g_ent = tl.load(grad_entropy_ptr + row)
    target = tl.load(targets_ptr + row)
    for start in range(0, num_cols, BLOCK_V):
        offs = start + cols
        valid = offs < num_cols
        z = tl.load(base + offs, mask=valid, other=0.0).to(tl.float32) * inv_temperature
        log_p = z - lse
        p = tl.exp(log_p)
        dz = -p * (g_logp + g_ent * (tl.where(p > 0, log_p, 0.0) + entropy))
        dz = tl.where(offs == target, dz + g_logp, dz)
        dx = dz * inv_temperature
        if logits_ptr.dtype.element_ty == tl.bfloat16:
            tl.store(base + offs, _round_to_bf16(dx), mask=valid)
        else:
            tl.store(base + offs, dx.to(logits_ptr.dtype.element_ty), mask=valid)


def _check_rows(logits: torch.Tensor, targets: torch.Tensor, name: str) -> None:
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"{name}: logits must be a 2-D tensor with unit column stride, got shape "
                         f"{tuple(logits.shape)} strides {logits.stride()}")
    if logits.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"{name}: logits must be bf16, fp16 or fp32, got {logits.dtype}")
    if targets.shape != (logits.shape[0],) or targets.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name}: targets must be int32/int64 [{logits.shape[0]}], got {targets.dtype} "
                         f"{tuple(targets.shape)}")
    if targets.device != logits.device:
        raise ValueError(f"{name}: targets are on {targets.device}, logits on {logits.device}")


def _check_vector(v: torch.Tensor, rows: int, device: torch.device, name: str, what: str) -> None:
    if v.shape != (rows,) or v.dtype != torch.float32 or v.stride(0) != 1 or v.device != device:
        raise ValueError(f"{name}: {what} must be a contiguous fp32 [{rows}] tensor on {device}, got "
                         f"{v.dtype} {tuple(v.shape)} on {v.device}")


def _block_v(num_cols: int, block_v: int | None) -> int:
    if block_v is None:
        return min(MAX_BLOCK_V, triton.next_power_of_2(max(num_cols, 16)))
    if block_v < 16 or block_v & (block_v - 1):
        raise ValueError(f"block_v must be a power of two >= 16, got {block_v}")
    return block_v


def logit_stats(logits: torch.Tensor, targets: torch.Tensor, *, inv_temperature: float | torch.Tensor = 1.0,
                out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                block_v: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(lse, logp, entropy) of every row of `logits * inv_temperature`, fp32 [N] each; `out` to write
    into. inv_temperature: a float for all rows, or a contiguous fp32 [N] tensor, one per row."""
    _check_rows(logits, targets, "logit_stats")
    rows, cols = logits.shape
    if out is None:
        out = tuple(torch.empty(rows, dtype=torch.float32, device=logits.device) for _ in range(3))
    for what, v in zip(("lse", "logp", "entropy"), out):
        _check_vector(v, rows, logits.device, "logit_stats", what)
    per_row = isinstance(inv_temperature, torch.Tensor)
    if per_row:
        _check_vector(inv_temperature, rows, logits.device, "logit_stats", "inv_temperature")
    else:
        inv_temperature = float(inv_temperature)
    if rows:
        _logit_stats_kernel[(rows,)](logits, logits.stride(0), targets, *out, cols, inv_temperature,
                                     BLOCK_V=_block_v(cols, block_v), PER_ROW_TEMPERATURE=per_row,
                                     num_warps=NUM_WARPS)
    return out


def logit_grad_(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, entropy: torch.Tensor,
                grad_logp: torch.Tensor, grad_entropy: torch.Tensor, *, inv_temperature: float = 1.0,
                block_v: int | None = None) -> torch.Tensor:
    """Overwrite `logits` with dL/dlogits for per-row dL/dlogp and dL/dentropy; returns `logits`."""
    _check_rows(logits, targets, "logit_grad_")
    rows, cols = logits.shape
    for what, v in (("lse", lse), ("entropy", entropy), ("grad_logp", grad_logp), ("grad_entropy", grad_entropy)):
        _check_vector(v, rows, logits.device, "logit_grad_", what)
    if rows:
        _logit_grad_kernel[(rows,)](logits, logits.stride(0), targets, lse, entropy, grad_logp, grad_entropy, cols,
                                    float(inv_temperature), BLOCK_V=_block_v(cols, block_v), num_warps=NUM_WARPS)
    return logits
