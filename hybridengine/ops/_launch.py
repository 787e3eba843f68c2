"""What several Triton ops share: the device switch, launch-config overrides, and the attention ops'
window sentinel, dot flags and argument rules."""

from __future__ import annotations

import torch

from hybridengine.checks import number

NO_WINDOW = 2**30
"""Window passed to the attention kernels when there is none: larger than any context, small enough
that `position - window` stays inside int32."""


def use_kernel(t: torch.Tensor) -> bool:
    """Whether an op runs its Triton launcher (CUDA tensors) or its plain-torch reference (elsewhere).
    Every op looks this function up at call time, so a test can patch it to run the launchers on CPU
    tensors under TRITON_INTERPRET=1."""
    return t.device.type == "cuda"


def launch_config(defaults: dict, config: dict | None) -> dict:
    """A kernel's launch: `defaults` with a tuning sweep's `config` over them, checked: known keys only,
    and a bool wherever the default is a bool (the constexpr flags)."""
    unknown = set(config or {}) - set(defaults)
    if unknown:
        raise ValueError(f"config keys must be among {sorted(defaults)}, got {sorted(unknown)}")
    cfg = defaults | (config or {})
    for key, value in cfg.items():
        if isinstance(defaults[key], bool) and not isinstance(value, bool):
            raise ValueError(f"config {key} must be a bool, got {value!r}")
    return cfg


def dot_flags(q: torch.Tensor) -> dict:
    """The attention kernels' dot constexprs for q's dtype and device: DOT_16BIT (bf16/fp16: `tl.dot` on
    the 16-bit tiles; fp32: "ieee" fp32 dots) and UPCAST_BF16_DOT (the interpreter's `tl.dot` reads bf16
    operands' bits as integers: it multiplies fp32 copies instead, the same products)."""
    return dict(DOT_16BIT=q.dtype != torch.float32,
                UPCAST_BF16_DOT=q.device.type != "cuda" and q.dtype == torch.bfloat16)


def reference_dtype(dtype: torch.dtype, compute_dtype: torch.dtype | None) -> torch.dtype:
    """The attention references' math dtype: `compute_dtype` when given, else fp64 for fp64 inputs, fp32 otherwise."""
    if compute_dtype is not None:
        return compute_dtype
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_attention(op: str, scale, sliding_window, num_q_heads: int, num_kv_heads: int) -> int:
    """The softmax scale, the window and the GQA head counts of an attention op; returns the group size."""
    number(op, "scale", scale, low=0, low_open=True)
    if sliding_window is not None:
        number(op, "sliding_window", sliding_window, low=1, integer=True)
    if num_kv_heads < 1 or num_q_heads % num_kv_heads:
        raise ValueError(f"{op}: num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    return num_q_heads // num_kv_heads
