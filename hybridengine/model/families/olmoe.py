"""The OLMoE family (transformers `olmoe`): every layer a mixture of experts (`moe.SparseMoeBlock`, no shared
expert), a top-k softmax router whose weights are not renormalised by default (`norm_topk_prob`), q/k RMSNorms
over the whole projection width rather than per head (`ModelConfig.qk_norm_full_width`), and transformers'
load-balancing loss (the Qwen MoE formula).

Parameter names, the parallel plan and the per-expert checkpoint names are the Qwen MoE family's: transformers
keeps the router as `mlp.gate.weight` and the stacked experts as `mlp.experts.gate_up_proj` / `down_proj`,
and checkpoints store each expert apart (`mlp.experts.<e>.gate_proj.weight`). Each expert's intermediate size
is the config's `intermediate_size`.
"""

from __future__ import annotations

from hybridengine.model.families.dense import MLP_ROLES, decoder_plan
from hybridengine.model.families.qwen_moe import MOE_ROLES, expert_piece, expert_split, moe_mlp
from hybridengine.model.family import ModelFamily, register_family


def _olmoe(hf_config) -> dict:
    clip = getattr(hf_config, "clip_qkv", None)
    if clip is not None:
        raise ValueError(f"olmoe: clip_qkv={clip} is not supported (only None: q/k/v are not clamped)")
    bias = bool(getattr(hf_config, "attention_bias", False))
    coef = float(hf_config.router_aux_loss_coef) if getattr(hf_config, "output_router_logits", False) else 0.0
    return dict(qkv_bias=bias, o_bias=bias, qk_norm=True, qk_norm_full_width=True,
                num_experts=hf_config.num_experts, num_experts_per_tok=hf_config.num_experts_per_tok,
                moe_intermediate_size=hf_config.intermediate_size,
                norm_topk_prob=bool(getattr(hf_config, "norm_topk_prob", False)), router_aux_loss_coef=coef)


OLMOE_PLAN = decoder_plan("olmoe", {**MLP_ROLES, **MOE_ROLES})

OLMOE = register_family(ModelFamily(model_type="olmoe", plan=OLMOE_PLAN, build_mlp=moe_mlp, config_from_hf=_olmoe,
                                    hf_piece=expert_piece, hf_split=expert_split))
