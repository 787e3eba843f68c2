"""The dense Llama family: Llama, Qwen2, Qwen3 and Mistral (SwiGLU MLP, GQA attention, RMSNorm).

One parallel plan for all four (they name their parameters alike); each declares its own config
translation (which biases, q/k norms and sliding windows it has).
"""

from __future__ import annotations

from types import MappingProxyType

from hybridengine.model.decoder import MLP
from hybridengine.model.family import ModelFamily, ParallelPlan, register_family

ATTENTION_ROLES = {
    **{f"self_attn.{p}_proj.{k}": "column" for p in "qkv" for k in ("weight", "bias")},
    "self_attn.o_proj.weight": "row",
    "self_attn.o_proj.bias": "replicated",
    "self_attn.q_norm.weight": "replicated",
    "self_attn.k_norm.weight": "replicated",
    "input_layernorm.weight": "replicated",
    "post_attention_layernorm.weight": "replicated",
}
"""The shared decoder's attention and norms (every family built on it)."""
HEAD_GRANULE = frozenset(f"self_attn.{p}_proj.{k}" for p in "qkv" for k in ("weight", "bias"))
EMBED_ROLES = {"model.embed_tokens.weight": "vocab"}
HEAD_ROLES = {"model.norm.weight": "replicated", "lm_head.weight": "vocab", "score.weight": "replicated"}
MLP_ROLES = {
    **{f"mlp.{p}_proj.{k}": "column" for p in ("gate", "up") for k in ("weight", "bias")},
    "mlp.down_proj.weight": "row",
    "mlp.down_proj.bias": "replicated",
}


def decoder_plan(family: str, layer_roles: dict[str, str]) -> ParallelPlan:
    """The plan of a family on the shared decoder: its layers' feed-forward roles next to the attention's."""
    return ParallelPlan(family=family, embed=MappingProxyType(EMBED_ROLES), head=MappingProxyType(HEAD_ROLES),
                        layer=MappingProxyType({**ATTENTION_ROLES, **layer_roles}), head_granule=HEAD_GRANULE)


DENSE_PLAN = decoder_plan("llama", MLP_ROLES)


def dense_mlp(config, layer_idx: int) -> MLP:
    return MLP(config)


def _qwen_windows(hf_config) -> dict:
    """qwen2/qwen3: HF sets sliding_window None unless use_sliding_window; layer_types say which layers."""
    sliding_window = getattr(hf_config, "sliding_window", None)
    if not getattr(hf_config, "use_sliding_window", False):
        sliding_window = None
    layer_types = getattr(hf_config, "layer_types", None) or [
        "sliding_attention" if sliding_window is not None and i >= hf_config.max_window_layers
        else "full_attention" for i in range(hf_config.num_hidden_layers)]
    return dict(sliding_window=sliding_window, layer_types=tuple(layer_types))


def _llama(hf_config) -> dict:
    bias = bool(getattr(hf_config, "attention_bias", False))
    return dict(qkv_bias=bias, o_bias=bias, mlp_bias=bool(getattr(hf_config, "mlp_bias", False)))


def _qwen2(hf_config) -> dict:
    return dict(qkv_bias=True, **_qwen_windows(hf_config))


def _qwen3(hf_config) -> dict:
    bias = bool(getattr(hf_config, "attention_bias", False))
    return dict(qkv_bias=bias, o_bias=bias, qk_norm=True, **_qwen_windows(hf_config))


def _mistral(hf_config) -> dict:
    return dict(sliding_window=getattr(hf_config, "sliding_window", None))


LLAMA = register_family(ModelFamily(model_type="llama", plan=DENSE_PLAN, build_mlp=dense_mlp, config_from_hf=_llama))
QWEN2 = register_family(ModelFamily(model_type="qwen2", plan=DENSE_PLAN, build_mlp=dense_mlp, config_from_hf=_qwen2))
QWEN3 = register_family(ModelFamily(model_type="qwen3", plan=DENSE_PLAN, build_mlp=dense_mlp, config_from_hf=_qwen3))
MISTRAL = register_family(ModelFamily(model_type="mistral", plan=DENSE_PLAN, build_mlp=dense_mlp,
                                      config_from_hf=_mistral))
