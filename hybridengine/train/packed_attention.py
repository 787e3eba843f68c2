"""Causal attention per sequence over packed tokens: the training path's attention."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from hybridengine.model.decoder import Kernels


@functools.cache
def _varlen_api():
    """(torch's varlen_attn, the names of its parameters), or None where this torch lacks it; looked up
    once, not per layer call."""
    import inspect

    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


class PackedAttention:
    """Causal attention per sequence over packed tokens: the attention of the training path
    (`DecoderLayer.forward` on flat tokens), which runs the layers with the kernels it declares.

    CUDA, bf16/fp16: one flash-attention varlen call over all sequences (torch's
    `torch.nn.attention.varlen.varlen_attn`, forward and backward), with the GQA heads expanded where
    that torch's API lacks `enable_gqa`. Elsewhere, or if that call fails once (warned, then not tried
    again), a loop of `scaled_dot_product_attention` per sequence."""

    _varlen_failed: str | None = None

    def __init__(self, cu_seqlens: list[int], *, fused: bool = False):
        self.cu = cu_seqlens
        self._cu_device: torch.Tensor | None = None
        self.fused = fused
        """The layers run the autograd Triton ops of hybridengine.ops (`Kernels.TRAIN`,
        EngineConfig.fused_training) instead of the module code (`Kernels.TORCH`)."""

    @property
    def kernels(self) -> Kernels:
        return Kernels.TRAIN if self.fused else Kernels.TORCH

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               sliding_window: int | None) -> torch.Tensor:
        if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and PackedAttention._varlen_failed is None:
            try:
                out = self._varlen(q, k, v, sliding_window)
                if out is not None:
                    return out
            except Exception as e:  # noqa: BLE001 - an API or kernel this torch build lacks: fall back for good
                from hybridengine.ops._ext import warn_once

                PackedAttention._varlen_failed = f"{type(e).__name__}: {e}"
                warn_once(f"PackedAttention: torch varlen flash attention failed ({PackedAttention._varlen_failed}); "
                          "training attention falls back to one SDPA call per sequence")
        return self._per_sequence(q, k, v, sliding_window)

    def _varlen(self, q, k, v, sliding_window):
        """One varlen flash call, or None where this torch has no API for the case."""
        api = _varlen_api()
        if api is None:
            return None
        varlen_attn, params = api
        lens = [e - s for s, e in zip(self.cu[:-1], self.cu[1:])]
        window = None if sliding_window is None or sliding_window >= max(lens) else sliding_window
        kw = {}
        if "window_size" in params:
            kw["window_size"] = (-1 if window is None else window - 1, 0)  # causal, W keys incl. the query's
        elif "is_causal" in params and window is None:
            kw["is_causal"] = True
        else:
            return None
        if q.shape[1] != k.shape[1]:
            if "enable_gqa" in params:
                kw["enable_gqa"] = True
            else:
                group = q.shape[1] // k.shape[1]
                k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        if self._cu_device is None:
            self._cu_device = torch.tensor(self.cu, dtype=torch.int32, device=q.device)
        cu, longest = self._cu_device, max(lens)
        return varlen_attn(q, k, v, cu, cu, longest, longest, **kw)

    def _per_sequence(self, q, k, v, sliding_window):
        outs = []
        for s, e in zip(self.cu[:-1], self.cu[1:]):
            qs, ks, vs = (t[s:e].transpose(0, 1) for t in (q, k, v))
            T = e - s
            if sliding_window is None or sliding_window >= T:
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
            else:
                i = torch.arange(T, device=q.device)
                d = i[:, None] - i[None, :]
                o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=(d >= 0) & (d < sliding_window),
                                                   enable_gqa=True)
            outs.append(o.transpose(0, 1))
        return torch.cat(outs)
