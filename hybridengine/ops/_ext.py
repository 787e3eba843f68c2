"""Loads hybridengine._C and answers which device has which op (the `info` command reports it)."""

from __future__ import annotations

import functools
import warnings

import torch

try:
    from hybridengine import _C  # noqa: F401  (registers torch.ops.hybridengine.*)
    EXTENSION_ERROR: str | None = None
except ImportError as e:  # not built (e.g. a source checkout without pip install)
    EXTENSION_ERROR = str(e)

_DISPATCH_KEY = {"cpu": "CPU", "cuda": "CUDA"}


@functools.cache
def extension_has(op: str, device_type: str) -> bool:
    """Whether the extension registered `hybridengine::op` for this device type."""
    if EXTENSION_ERROR is not None or device_type not in _DISPATCH_KEY:
        return False
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"hybridengine::{op}", _DISPATCH_KEY[device_type])


@functools.cache
def warn_once(message: str) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=3)
