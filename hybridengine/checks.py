"""Argument checks of the public boundaries, written once.

Every message names the operation, the argument, what was expected and what was given, so that a
caller can fix the call without reading the code. Internal launchers, called every step with
arguments the engine built itself, use short `assert`s instead.
"""

from __future__ import annotations

import math
import numbers

import torch

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def describe(x) -> str:
    """A short description of a value for an error message."""
    if isinstance(x, torch.Tensor):
        return f"{x.dtype} tensor of shape {tuple(x.shape)} on {x.device}"
    return f"{type(x).__name__} {x!r}" if isinstance(x, (int, float, str)) else type(x).__name__


def tensor(op: str, name: str, x, *, dim: int | None = None, shape=None, dtypes=None, device=None,
           floating: bool = False, contiguous_last: bool = False) -> torch.Tensor:
    """`x` is a tensor with the given rank, shape, dtype, device, float-ness and unit last stride."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{op}: {name} must be a torch.Tensor, got {describe(x)}")
    if dim is not None and x.dim() != dim:
        raise ValueError(f"{op}: {name} must be {dim}-D, got shape {tuple(x.shape)}")
    if shape is not None and tuple(x.shape) != tuple(shape):
        raise ValueError(f"{op}: {name} must have shape {tuple(shape)}, got {tuple(x.shape)}")
    if floating and not x.is_floating_point():
        raise ValueError(f"{op}: {name} must be a float tensor, got {x.dtype}")
    if dtypes is not None and x.dtype not in dtypes:
        raise ValueError(f"{op}: {name} must be {' or '.join(str(d) for d in dtypes)}, got {x.dtype}")
    if device is not None and x.device != torch.device(device):
        raise ValueError(f"{op}: {name} is on {x.device}, expected {device}")
    if contiguous_last and x.dim() and x.numel() and x.stride(-1) != 1:
        raise ValueError(f"{op}: {name} must have unit stride in its last dim, got strides {x.stride()}")
    return x


def mask_bool(op: str, mask, shape, device, *, strict: bool = True) -> torch.Tensor:
    """`mask` of `shape` on `device` as bool. Integer and float masks are accepted; with `strict` they
    must hold only 0 and 1 (one host sync)."""
    tensor(op, "mask", mask, shape=shape, device=device)
    if mask.dtype == torch.bool:
        return mask
    if mask.is_complex():
        raise ValueError(f"{op}: mask must be bool, integer or float 0/1, got {mask.dtype}")
    if strict and ((mask != 0) & (mask != 1)).any():
        raise ValueError(f"{op}: mask must hold only 0 and 1")
    return mask != 0


def is_int(x) -> bool:
    """An integer (Python's or numpy's), not a bool."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def number(op: str, name: str, value, *, low: float | None = None, high: float | None = None,
           low_open: bool = False, high_open: bool = False, integer: bool = False) -> float | int:
    """A finite real (or integer) in [low, high] (open ends where asked); returns it as float or int."""
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind) or (not integer and not math.isfinite(value)):
        raise ValueError(f"{op}: {name} must be a finite {'integer' if integer else 'number'}, got {value!r}")
    too_low = low is not None and (value <= low if low_open else value < low)
    too_high = high is not None and (value >= high if high_open else value > high)
    if too_low or too_high:
        lo = "-inf" if low is None else f"{low}"
        hi = "inf" if high is None else f"{high}"
        interval = f"{'(' if low_open or low is None else '['}{lo}, {hi}{')' if high_open or high is None else ']'}"
        raise ValueError(f"{op}: {name} must be in {interval}, got {value!r}")
    return value if integer else float(value)


def one_of(op: str, name: str, value, choices) -> None:
    """`value` is one of `choices`."""
    if value not in choices:
        raise ValueError(f"{op}: {name} must be one of {tuple(choices)}, got {value!r}")
