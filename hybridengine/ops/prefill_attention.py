"""Prefill attention: causal attention over packed variable-length sequences (the rollout's prefill).

Layers: `prefill_attention_ref` (plain torch: one masked softmax attention per sequence),
`prefill_attention_triton` (the launcher of `kernels.prefill_attention`: output, grid and launch config)
and `prefill_attention`, the op, which checks its arguments and runs flash-attn's varlen kernel on CUDA
when it is installed and applies, else the Triton launcher; the reference elsewhere. Keys and values
are dense packed tensors (the prompt's own tokens, stored into the paged cache beside this call).
The values of cu_seqlens are checked by the reference only (reading them would synchronise with the GPU).
"""

from __future__ import annotations

import functools
import math

import torch

from hybridengine.checks import FLOAT_DTYPES, number, tensor
from hybridengine.ops import _launch


def _check(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, sliding_window, max_seqlen_q, max_seqlen_k) -> None:
    op = "prefill_attention"
    tensor(op, "q", q, dim=3, dtypes=FLOAT_DTYPES, contiguous_last=True)
    _, num_q_heads, head_dim = q.shape
    tensor(op, "cu_seqlens_q", cu_seqlens_q, dim=1, dtypes=(torch.int32,), device=q.device)
    if cu_seqlens_q.numel() < 1:
        raise ValueError(f"{op}: cu_seqlens_q must have B + 1 >= 1 entries, got an empty tensor")
    tensor(op, "cu_seqlens_k", cu_seqlens_k, shape=cu_seqlens_q.shape, dtypes=(torch.int32,), device=q.device)
    number(op, "max_seqlen_q", max_seqlen_q, low=0, integer=True)
    number(op, "max_seqlen_k", max_seqlen_k, low=0, integer=True)
    tensor(op, "k", k, dim=3, dtypes=(q.dtype,), device=q.device, contiguous_last=True)
    if k.shape[2] != head_dim:
        raise ValueError(f"{op}: k has head_dim {k.shape[2]}, q has head_dim {head_dim}")
    tensor(op, "v", v, shape=k.shape, dtypes=(q.dtype,), device=q.device, contiguous_last=True)
    _launch.check_attention(op, scale, sliding_window, num_q_heads, k.shape[1])


def prefill_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, *, scale: float,
                          sliding_window: int | None = None, max_seqlen_q: int, max_seqlen_k: int,
                          compute_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Plain-torch reference of `prefill_attention`: one masked softmax attention per sequence in
    `compute_dtype` (default fp32; fp64 for fp64 inputs). Checks the cu_seqlens values."""
    group = q.shape[1] // k.shape[1]
    dtype = _launch.reference_dtype(q.dtype, compute_dtype)
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    if cq[0] != 0 or cq[-1] != q.shape[0]:
        raise ValueError(f"cu_seqlens_q must run from 0 to total_q = {q.shape[0]}, got {cq}")
    if ck[0] != 0 or ck[-1] != k.shape[0]:
        raise ValueError(f"cu_seqlens_k must run from 0 to total_k = {k.shape[0]}, got {ck}")
    out = torch.zeros(q.shape, dtype=dtype, device=q.device)
    window = _launch.NO_WINDOW if sliding_window is None else sliding_window
    for b in range(len(cq) - 1):
        len_q, len_k = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
        if len_q < 0 or len_k < 0:
            raise ValueError(f"cu_seqlens_q and cu_seqlens_k must be non-decreasing, got {cq} and {ck}")
        if len_q > max_seqlen_q or len_k > max_seqlen_k:
            raise ValueError(f"sequence {b} has {len_q} queries and {len_k} keys, over max_seqlen_q = "
                             f"{max_seqlen_q} or max_seqlen_k = {max_seqlen_k}")
        if len_q == 0:
            continue
        keys = k[ck[b]:ck[b + 1]].to(dtype).repeat_interleave(group, dim=1)       # [len_k, Hq, D]
        values = v[ck[b]:ck[b + 1]].to(dtype).repeat_interleave(group, dim=1)
        pos = torch.arange(len_q, device=q.device)[:, None] + (len_k - len_q)
        j = torch.arange(len_k, device=q.device)[None, :]
        visible = (j <= pos) & (j > pos - window)                    # [len_q, len_k]
        scores = torch.einsum("qhd,khd->hqk", q[cq[b]:cq[b + 1]].to(dtype), keys) * scale
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)        # a row that sees no key: zeros
        out[cq[b]:cq[b + 1]] = torch.einsum("hqk,khd->qhd", probs, values)
    return out.to(q.dtype)


def _prefill_config(q: torch.Tensor) -> dict:
    """The kernel's launch: on CUDA the launch sweep's best
    (`python -m hybridengine_bench run --suite prefill_attention`): 64 x 64 tiles, 4 warps, 3 stages;
    under the interpreter, 16 x 16 tiles so that the tests' short sequences still span several tiles."""
    if q.device.type == "cuda":
        return dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3)
    return dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1)


def prefill_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, *, scale: float,
                             sliding_window: int | None = None, max_seqlen_q: int, max_seqlen_k: int,
                             out: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """`prefill_attention` with the Triton kernel (CUDA, or CPU under TRITON_INTERPRET=1). `config` overrides
    the launch of `_prefill_config` (BLOCK_M, BLOCK_N, num_warps, num_stages); see
    hybridengine/kernels/prefill_attention.py."""
    import triton

    from hybridengine.kernels.prefill_attention import prefill_attention_kernel

    assert k.shape == v.shape and k.dtype == v.dtype == q.dtype and q.shape[1] % k.shape[1] == 0
    assert cu_seqlens_q.dtype == cu_seqlens_k.dtype == torch.int32 and q.stride(-1) == k.stride(-1) == 1
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out
    batch, num_q_heads, head_dim = cu_seqlens_q.numel() - 1, q.shape[1], q.shape[2]
    if batch == 0 or q.shape[0] == 0 or max_seqlen_q == 0:
        return out
    cfg = _launch.launch_config(_prefill_config(q), config)
    grid = (triton.cdiv(max_seqlen_q, cfg["BLOCK_M"]), batch, num_q_heads)
    prefill_attention_kernel[grid](
        q, k, v, cu_seqlens_q, cu_seqlens_k, out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        scale * math.log2(math.e), _launch.NO_WINDOW if sliding_window is None else sliding_window,
        GROUP=num_q_heads // k.shape[1], HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        **_launch.dot_flags(q), **cfg,
    )
    return out


@functools.cache
def _flash_attn_varlen():
    """flash-attn's `flash_attn_varlen_func`, or None when flash-attn is not installed (optional)."""
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:  # (also raised for a flash-attn built against another torch)
        return None
    return flash_attn_varlen_func


def _flash_attn_applies(q: torch.Tensor) -> bool:
    return (q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256
            and _flash_attn_varlen() is not None)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, *, scale: float,
                      sliding_window: int | None = None, max_seqlen_q: int, max_seqlen_k: int) -> torch.Tensor:
    """Causal attention over packed variable-length sequences (prefill).

    Args:
        q: [total_q, num_q_heads, head_dim], fp16/bf16/fp32, last dim contiguous; sequence b owns rows
            cu_seqlens_q[b] .. cu_seqlens_q[b+1].
        k, v: [total_k, num_kv_heads, head_dim], q's dtype, last dim contiguous; sequence b owns rows
            cu_seqlens_k[b] .. cu_seqlens_k[b+1]. num_q_heads must be a multiple of num_kv_heads (GQA).
        cu_seqlens_q, cu_seqlens_k: int32 [B + 1], cumulative lengths from 0. len_k >= len_q is the
            normal case: the mask is causal and bottom-right aligned, query i at key position
            len_k - len_q + i sees keys j <= that position (a query that sees no key gets zeros).
        scale: softmax scale.
        sliding_window: query at position i sees keys i - window < j <= i; None: no window.
        max_seqlen_q, max_seqlen_k: host ints >= the longest len_q / len_k (they size the grid; the
            values of cu_seqlens are checked by the reference only).

    Returns [total_q, num_q_heads, head_dim] in q's dtype; fp32 math inside. CUDA: flash-attn's
    `flash_attn_varlen_func` when installed (fp16/bf16, head_dim <= 256), else Triton; elsewhere: the
    reference.
    """
    _check(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, sliding_window, max_seqlen_q, max_seqlen_k)
    if not _launch.use_kernel(q):
        return prefill_attention_ref(q, k, v, cu_seqlens_q, cu_seqlens_k, scale=scale, sliding_window=sliding_window,
                                     max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
    if _flash_attn_applies(q):
        return _flash_attn_varlen()(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=scale, causal=True,
            window_size=(-1, -1) if sliding_window is None else (sliding_window - 1, 0))
    return prefill_attention_triton(q, k, v, cu_seqlens_q, cu_seqlens_k, scale=scale, sliding_window=sliding_window,
                                    max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)


def implementations(device_type: str) -> dict[str, str]:
    """Which implementation each op of this module runs on this device type (for `hybridengine info`)."""
    if device_type != "cuda":
        return {"prefill_attention": "torch reference"}
    return {"prefill_attention": "flash-attn varlen (fp16/bf16, head_dim <= 256) else Triton"
            if _flash_attn_varlen() else "Triton"}
