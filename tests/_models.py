"""Synthetic Llama-family parameter shapes for layout and sharding tests."""

import math

import torch

from hybridengine.sharding.layout import param_specs


def model_specs(hidden, heads, kv_heads, head_dim, inter, vocab, layers=2, tied=False, qkv_bias=True, qk_norm=False):
    shapes = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes += [(p + "self_attn.q_proj.weight", (heads * head_dim, hidden)),
                   (p + "self_attn.k_proj.weight", (kv_heads * head_dim, hidden)),
                   (p + "self_attn.v_proj.weight", (kv_heads * head_dim, hidden))]
        if qkv_bias:
            shapes += [(p + "self_attn.q_proj.bias", (heads * head_dim,)),
                       (p + "self_attn.k_proj.bias", (kv_heads * head_dim,)),
                       (p + "self_attn.v_proj.bias", (kv_heads * head_dim,))]
        if qk_norm:
            shapes += [(p + "self_attn.q_norm.weight", (head_dim,)), (p + "self_attn.k_norm.weight", (head_dim,))]
        shapes += [(p + "self_attn.o_proj.weight", (hidden, heads * head_dim)),
                   (p + "mlp.gate_proj.weight", (inter, hidden)), (p + "mlp.up_proj.weight", (inter, hidden)),
                   (p + "mlp.down_proj.weight", (hidden, inter)),
                   (p + "input_layernorm.weight", (hidden,)), (p + "post_attention_layernorm.weight", (hidden,))]
    shapes.append(("model.norm.weight", (hidden,)))
    if not tied:
        shapes.append(("lm_head.weight", (vocab, hidden)))
    return param_specs(shapes, head_dim=head_dim)


# Awkward on purpose: odd hidden sizes, vocab not divisible by tg, head_dim 3, 24 heads (divisible by 1..8
# except 5/7), intermediate a multiple of 24 so every tg in {1,2,3,4,6,8} divides it.
MODELS = {
    "odd-hidden": dict(hidden=75, heads=24, kv_heads=24, head_dim=3, inter=48, vocab=131),
    "gqa-untied": dict(hidden=64, heads=24, kv_heads=24, head_dim=8, inter=96, vocab=97, qk_norm=True),
    "tied-no-bias": dict(hidden=33, heads=24, kv_heads=24, head_dim=2, inter=24, vocab=50, tied=True, qkv_bias=False),
}


def reference_tp_slice(full: torch.Tensor, role: str, t: int, tp_size: int) -> torch.Tensor:
    """What TP rank t must hold of a full parameter (vocab: ceil(V/tg) rows, zero padding)."""
    if role == "replicated":
        return full
    if role == "row":
        return full.chunk(tp_size, dim=1)[t]
    if role == "column":
        return full.chunk(tp_size, dim=0)[t]
    rows = math.ceil(full.shape[0] / tp_size)
    out = torch.zeros(rows, *full.shape[1:], dtype=full.dtype)
    part = full[t * rows:(t + 1) * rows]
    out[:len(part)] = part
    return out
