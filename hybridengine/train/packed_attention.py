"""Causal attention per sequence over packed tokens: the training path's attention."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from hybridengine.model.decoder import Kernels
from hybridengine.ops.exact_attention import exact_attention


@functools.cache
def _varlen_api():
    """(torch's varlen_attn, the names of its parameters), or None where this torch lacks it: the flash
    peer of hybridengine_bench.prefill_attention (training takes `exact_attention`, see PackedAttention)."""
    import inspect

    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


class PackedAttention:
    """Causal attention per sequence over packed tokens: the attention of the training path
    (`DecoderLayer.forward` on flat tokens), which runs the layers with the kernels it declares.

    CUDA, and exact mode anywhere: `ops.exact_attention`, one varlen call over all sequences whose
    backward is deterministic (no atomics), so training repeats bit for bit (flash-attention's varlen
    backward accumulates dQ with atomics: two runs of one step differ); its rows have the bits of the
    rollout's exact prefill and decode for the same tokens. CPU otherwise: one
    `scaled_dot_product_attention` per sequence (the module code's attention)."""

    def __init__(self, cu_seqlens: list[int], *, fused: bool = False, exact: bool = False,
                 scale: float | None = None):
        self.cu = cu_seqlens
        self._cu_device: torch.Tensor | None = None
        self.fused = fused
        """The layers run the autograd Triton ops of hybridengine.ops (`Kernels.TRAIN`,
        EngineTuning.fused_training) instead of the module code (`Kernels.TORCH`)."""
        self.exact = exact
        """Exact mode (EngineConfig.exact_logprobs): `linear_exact` projections and `exact_attention` also on CPU."""
        self.scale = scale
        """The softmax scale (the rollout's: head_dim ** -0.5); None: 1/sqrt(head_dim)."""
        self.routing: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        """MoE layers' (router logits [N, E], chosen experts [N, k]) by layer, from the last forward of each
        (the trainer's load-balancing loss)."""

    @property
    def kernels(self) -> Kernels:
        return Kernels.TRAIN if self.fused else Kernels.TORCH

    def record_routing(self, layer: int, router_logits: torch.Tensor, experts: torch.Tensor) -> None:
        self.routing[layer] = (router_logits, experts)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               sliding_window: int | None) -> torch.Tensor:
        if not (self.exact or q.is_cuda):
            return self._per_sequence(q, k, v, sliding_window)
        if self._cu_device is None:
            self._cu_device = torch.tensor(self.cu, dtype=torch.int32, device=q.device)
        scale = q.shape[-1] ** -0.5 if self.scale is None else self.scale
        longest = max(e - s for s, e in zip(self.cu[:-1], self.cu[1:]))
        return exact_attention(q, k, v, self._cu_device, scale=scale, max_seqlen=longest,
                               sliding_window=sliding_window)

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
