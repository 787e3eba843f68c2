"""`ReleasedParams`: a layer's parameters over a gathered buffer that autograd does not keep alive."""

from __future__ import annotations

import torch


class ReleasedParams:
    """One layer's parameter leaves over a transient gathered buffer, run with autograd, without
    autograd keeping that buffer alive (ZeRO-3 with activations kept, as FSDP does it).

    Saved-tensor hooks replace what autograd saves of a parameter (the leaf or a view of it, say
    its transpose) by (leaf, shape, stride, offset within the leaf); `release` points the leaves at
    empty tensors so the gathered buffer can be freed; `attach(natural)` points them at a fresh gather
    before the layer's backward, and unpacking rebuilds each saved view over it.
    """

    def __init__(self, params: dict[str, torch.Tensor], natural: torch.Tensor, layout, prefix: str):
        self.params, self.layout, self.prefix = params, layout, prefix
        self.storage = natural.untyped_storage().data_ptr()
        self.spans = [(p.storage_offset(), p.storage_offset() + p.numel(), p) for p in params.values()]

    def pack(self, t: torch.Tensor):
        if t.untyped_storage().data_ptr() == self.storage:
            offset = t.storage_offset()
            for lo, hi, p in self.spans:
                if lo <= offset < hi:
                    return (p, tuple(t.shape), t.stride(), offset - lo)
        return t

    @staticmethod
    def unpack(packed):
        if isinstance(packed, tuple):
            p, shape, stride, rel = packed
            return p.detach().as_strided(shape, stride, p.storage_offset() + rel)
        return packed

    def release(self) -> None:
        for p in self.params.values():
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        self.spans = None

    def attach(self, natural: torch.Tensor) -> None:
        for name, p in self.params.items():
            p.data = self.layout.natural_view(natural, self.prefix + name)
