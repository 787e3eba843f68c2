"""Programmatic dependent launch (PDL) for the decode step's Triton kernels.

A decode step is ~10 kernels per layer, most of them a few microseconds long (Qwen2.5-1.5B at B = 128:
280 kernels in 2.4 ms). Between two kernels of a stream the GPU drains the first, flushes its writes and
only then starts placing the second's programs. A kernel launched with PDL (`launch_pdl=True`, Hopper and
later) may be placed while its predecessor is still finishing; it then waits in `gdc_wait` until the
predecessor has completed and its writes are visible. Each kernel here that takes `PDL` calls that wait
before its first load, so the results are the same with PDL on or off; only the gap between kernels
shrinks. Kernels launched without PDL (cuBLAS, torch) are ordered as usual, and CUDA-graph capture keeps
the programmatic edges.

On by default where the GPU (compute capability >= 9.0) and Triton (`tl.extra.cuda.gdc_wait`) support
it; `HYBRIDENGINE_PDL=0` (or `pdl.ENABLED = False`) turns it off, e.g. for a same-run comparison.
"""

from __future__ import annotations

import functools
import os

import torch

ENABLED = os.environ.get("HYBRIDENGINE_PDL", "1") != "0"
"""Whether kernels that support PDL launch with it (read at each launch; graphs keep their capture's)."""


@functools.cache
def _supported(device_index: int) -> bool:
    if torch.cuda.get_device_capability(device_index) < (9, 0):
        return False
    try:
        from triton.language.extra import cuda as tl_cuda
    except ImportError:
        return False
    return hasattr(tl_cuda, "gdc_wait")


def launch_args(device: torch.device) -> dict:
    """Keyword arguments for a kernel launch that takes a `PDL` constexpr: {PDL: True, launch_pdl: True}
    where PDL is on and supported on `device`, else {PDL: False} (CPU and the interpreter included)."""
    if ENABLED and device.type == "cuda" and _supported(device.index if device.index is not None
                                                         else torch.cuda.current_device()):
        return dict(PDL=True, launch_pdl=True)
    return dict(PDL=False)
