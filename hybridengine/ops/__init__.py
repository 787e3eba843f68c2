"""Ops with a plain-torch reference and a C++/CUDA or Triton implementation; picked by device."""

from hybridengine.ops._ext import EXTENSION_ERROR, extension_has
from hybridengine.ops.copy_2d import copy_2d, copy_2d_ref, prepare_runs, runs_from_table, table_from_runs
from hybridengine.ops.segment_copy import prepare_table, segment_copy, segment_copy_ref, split_rows, validate_table

if EXTENSION_ERROR is None:
    import torch

    # Shape-only implementation for torch.compile / fake tensors: the op returns nothing.
    @torch.library.register_fake("hybridengine::segment_copy")
    def _segment_copy_fake(src, dst, table, max_blocks=0):
        return None

    @torch.library.register_fake("hybridengine::copy_2d")
    def _copy_2d_fake(src, dst, runs):
        return None


def implementations(device_type: str) -> dict[str, str]:
    """Which implementation each op runs on this device type (for `hybridengine info`)."""
    native = {"cpu": "C++ CPU op", "cuda": "CUDA kernel"}.get(device_type, "")
    seg = native if extension_has("segment_copy", device_type) else "torch reference (not in the extension)"
    c2d = ({"cpu": "C++ CPU op (memcpy)", "cuda": "cudaMemcpy2DAsync (copy engines)"}.get(device_type, "")
           if extension_has("copy_2d", device_type) else "torch reference (not in the extension)")
    return {"segment_copy": seg, "copy_2d": c2d}


__all__ = ["EXTENSION_ERROR", "copy_2d", "copy_2d_ref", "extension_has", "implementations", "prepare_runs",
           "prepare_table", "runs_from_table", "segment_copy", "segment_copy_ref", "split_rows", "table_from_runs",
           "validate_table"]
