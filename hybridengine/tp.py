"""Tensor-parallel generation, applied from outside the model (the model knows nothing of it).

The generation view of TP rank t holds, in G, slice t of every weight (layout.py): q/k/v/gate/up
split by output rows (whole heads), o/down by input columns, embedding and LM head by vocabulary
rows (ceil(V / tg) per rank, zero-padded). A `CausalLM` built for the *local* shapes (heads / tg,
intermediate / tg, vocab rows / tg) has exactly those parameter shapes, so its weights are plain
views of G. What TP adds is three collectives over the TP group, attached here with hooks:
all-reduce after the row-parallel o_proj and down_proj, a vocab-parallel embedding lookup
(masked local lookup + all-reduce), and an all-gather of the vocab-sliced logits.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .model import CausalLM, ModelConfig


def local_config(config: ModelConfig, tp_size: int) -> ModelConfig:
    """The per-rank shapes of a TP-sliced model."""
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        if getattr(config, name) % tp_size:
            raise ValueError(f"tp_size={tp_size} must divide {name}={getattr(config, name)}")
    if tp_size > 1 and (config.o_bias or config.mlp_bias):
        raise ValueError("tensor-parallel generation does not support o_proj/down_proj biases (they would be "
                         "added once per TP rank by the all-reduce)")
    return dataclasses.replace(
        config, num_attention_heads=config.num_attention_heads // tp_size,
        num_key_value_heads=config.num_key_value_heads // tp_size,
        intermediate_size=config.intermediate_size // tp_size,
        vocab_size=math.ceil(config.vocab_size / tp_size))


def parallelize(model: CausalLM, *, vocab_size: int, tp_rank: int, tp_size: int, group) -> CausalLM:
    """Attach the TP collectives to a model built with `local_config` over its slice of G."""
    if tp_size == 1:
        return model

    def all_reduce_output(_module, _inputs, output):
        dist.all_reduce(output, group=group)
        return output

    for layer in model.model.layers:
        layer.self_attn.o_proj.register_forward_hook(all_reduce_output)
        layer.mlp.down_proj.register_forward_hook(all_reduce_output)

    rows = model.config.vocab_size  # local rows per rank (padded)
    embed = model.model.embed_tokens
    first = tp_rank * rows

    def vocab_parallel_embedding(input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - first
        inside = (local >= 0) & (local < rows)
        out = F.embedding(local.clamp(0, rows - 1), embed.weight) * inside.unsqueeze(-1).to(embed.weight.dtype)
        dist.all_reduce(out, group=group)
        return out

    embed.forward = vocab_parallel_embedding
    local_logits = model.compute_logits

    def gathered_logits(hidden: torch.Tensor) -> torch.Tensor:
        part = local_logits(hidden).contiguous()
        parts = [torch.empty_like(part) for _ in range(tp_size)]
        dist.all_gather(parts, part, group=group)
        return torch.cat(parts, dim=-1)[..., :vocab_size]  # drop the zero padding rows' logits

    model.compute_logits = gathered_logits
    return model
