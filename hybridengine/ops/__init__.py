"""Ops with a plain-torch reference and a C++/CUDA or Triton implementation; picked by device."""

from hybridengine.ops._ext import EXTENSION_ERROR, extension_has
from hybridengine.ops.segment_copy import prepare_table, segment_copy, segment_copy_ref, split_rows, validate_table

if EXTENSION_ERROR is None:
    import torch

    # Shape-only implementation for torch.compile / fake tensors: the op returns nothing.
    @torch.library.register_fake("hybridengine::segment_copy")
    def _segment_copy_fake(src, dst, table, max_blocks=0):
        return None


def implementations(device_type: str) -> dict[str, str]:
    """Which implementation each op runs on this device type (for `hybridengine info`)."""
    native = {"cpu": "C++ CPU op", "cuda": "CUDA kernel"}.get(device_type, "")
    seg = native if extension_has("segment_copy", device_type) else "torch reference (not in the extension)"
    return {"segment_copy": seg}


__all__ = ["EXTENSION_ERROR", "extension_has", "implementations", "prepare_table", "segment_copy", "segment_copy_ref",
           "split_rows", "validate_table"]
