"""The Qwen mixture-of-experts family: Qwen3-MoE (q/k norms, top-k renormalised) and Qwen2-MoE (q/k/v biases,
a shared expert behind a sigmoid gate), on the shared decoder with `moe.SparseMoeBlock` as the feed-forward of
the MoE layers (a dense MLP in `mlp_only_layers`).

Parallel plan: the stacked experts are ``expert`` (cut on whole experts: expert parallelism), the router and
the shared expert's gate ``replicated``, the shared expert column/row like a dense MLP. Checkpoints store each
expert's gate/up/down weights apart (`mlp.experts.<e>.gate_proj.weight`); `hf_piece` places them in the
stacked parameters, and `hf_split` writes them so (`export_hf`). transformers' own state_dict (5.x) has the stacked
names, which load as they are (`state_dict()` yields them).
"""

from __future__ import annotations

import re

from hybridengine.model.decoder import MLP
from hybridengine.model.families.dense import MLP_ROLES, _qwen_windows, decoder_plan
from hybridengine.model.family import ModelFamily, register_family
from hybridengine.model.moe import SparseMoeBlock

MOE_ROLES = {
    "mlp.gate.weight": "replicated",
    "mlp.experts.gate_up_proj": "expert",
    "mlp.experts.down_proj": "expert",
    "mlp.shared_expert.gate_proj.weight": "column",
    "mlp.shared_expert.up_proj.weight": "column",
    "mlp.shared_expert.down_proj.weight": "row",
    "mlp.shared_expert_gate.weight": "replicated",
}

_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
_STACKED = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def moe_mlp(config, layer_idx: int):
    return SparseMoeBlock(config) if config.is_moe_layer(layer_idx) else MLP(config)


def expert_piece(name: str, config) -> tuple[str, tuple] | None:
    """`model.layers.<i>.mlp.experts.<e>.<gate|up|down>_proj.weight` -> its part of the stacked parameter."""
    m = _EXPERT.match(name)
    if m is None:
        return None
    prefix, e, proj = m.group(1), int(m.group(2)), m.group(3)
    if e >= config.num_experts:
        raise ValueError(f"tensor {name!r}: expert {e} of a model with num_experts={config.num_experts}")
    inter = config.moe_intermediate_size
    if proj == "down":
        return f"{prefix}.down_proj", (e,)
    rows = slice(0, inter) if proj == "gate" else slice(inter, 2 * inter)
    return f"{prefix}.gate_up_proj", (e, rows)


def expert_split(name: str, tensor) -> list[tuple[str, object]] | None:
    """A stacked expert parameter -> its per-expert checkpoint tensors (views): `experts.<e>.gate_proj.weight`
    and `up_proj.weight` (rows 0..I-1 and I..2I-1 of gate_up_proj[e]), `experts.<e>.down_proj.weight`."""
    m = _STACKED.match(name)
    if m is None:
        return None
    prefix, num_experts = m.group(1), tensor.shape[0]
    if m.group(2) == "down_proj":
        return [(f"{prefix}.{e}.down_proj.weight", tensor[e]) for e in range(num_experts)]
    inter = tensor.shape[1] // 2
    return [(f"{prefix}.{e}.{proj}_proj.weight", tensor[e, rows]) for e in range(num_experts)
            for proj, rows in (("gate", slice(0, inter)), ("up", slice(inter, 2 * inter)))]


def _moe_fields(hf_config) -> dict:
    coef = float(hf_config.router_aux_loss_coef) if getattr(hf_config, "output_router_logits", False) else 0.0
    return dict(num_experts=hf_config.num_experts, num_experts_per_tok=hf_config.num_experts_per_tok,
                moe_intermediate_size=hf_config.moe_intermediate_size,
                norm_topk_prob=bool(getattr(hf_config, "norm_topk_prob", False)),
                decoder_sparse_step=getattr(hf_config, "decoder_sparse_step", 1) or 1,
                mlp_only_layers=tuple(getattr(hf_config, "mlp_only_layers", None) or ()),
                router_aux_loss_coef=coef)


def _qwen3_moe(hf_config) -> dict:
    bias = bool(getattr(hf_config, "attention_bias", False))
    # every layer slides when use_sliding_window (transformers sets sliding_window None otherwise)
    window = getattr(hf_config, "sliding_window", None) if getattr(hf_config, "use_sliding_window", False) else None
    return dict(qkv_bias=bias, o_bias=bias, qk_norm=True, sliding_window=window, **_moe_fields(hf_config))


def _qwen2_moe(hf_config) -> dict:
    windows = _qwen_windows(hf_config) if getattr(hf_config, "use_sliding_window", False) else {}
    return dict(qkv_bias=bool(getattr(hf_config, "qkv_bias", True)),
                shared_expert_intermediate_size=hf_config.shared_expert_intermediate_size,
                **windows, **_moe_fields(hf_config))


MOE_PLAN = decoder_plan("qwen_moe", {**MLP_ROLES, **MOE_ROLES})

QWEN3_MOE = register_family(ModelFamily(model_type="qwen3_moe", plan=MOE_PLAN, build_mlp=moe_mlp,
                                        config_from_hf=_qwen3_moe, hf_piece=expert_piece, hf_split=expert_split))
QWEN2_MOE = register_family(ModelFamily(model_type="qwen2_moe", plan=MOE_PLAN, build_mlp=moe_mlp,
                                        config_from_hf=_qwen2_moe, hf_piece=expert_piece, hf_split=expert_split))
