"""The shapes and options of a decoder (`ModelConfig`, `RopeConfig`), from HF configs; the model family
(`hybridengine.model.family`) translates the fields that depend on it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from hybridengine.model.family import family_of, supported_model_types

ROPE_TYPES = ("default", "linear", "llama3")
LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(kw_only=True, slots=True)
class RopeConfig:
    """Rotary position embedding parameters (HF `rope_parameters`, flattened)."""

    rope_type: str = "default"
    """'default', 'linear' (positions / factor) or 'llama3' (frequency-dependent scaling)."""
    theta: float = 10000.0
    factor: float = 1.0
    """linear and llama3: the context extension factor."""
    low_freq_factor: float = 1.0
    """llama3 only."""
    high_freq_factor: float = 4.0
    """llama3 only."""
    original_max_position_embeddings: int = 8192
    """llama3 only: the context length the model was pre-trained with."""

    def __post_init__(self):
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"RopeConfig: rope_type {self.rope_type!r} is not supported; supported: {ROPE_TYPES}")
        if self.theta <= 0 or self.factor <= 0:
            raise ValueError(f"RopeConfig: theta={self.theta} and factor={self.factor} must be > 0")
        if self.rope_type == "llama3" and not (0 < self.low_freq_factor < self.high_freq_factor):
            raise ValueError(f"RopeConfig: llama3 needs 0 < low_freq_factor={self.low_freq_factor} "
                             f"< high_freq_factor={self.high_freq_factor}")

    def inv_freq(self, head_dim: int) -> torch.Tensor:
        """Inverse frequencies [head_dim / 2] in fp32 on CPU, computed like HF (modeling_rope_utils)."""
        inv = 1.0 / (self.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        if self.rope_type == "linear":
            return inv / self.factor
        if self.rope_type == "llama3":
            old_len = self.original_max_position_embeddings
            low_wavelen, high_wavelen = old_len / self.low_freq_factor, old_len / self.high_freq_factor
            wavelen = 2 * math.pi / inv
            # long wavelengths are divided by factor, short ones kept, the band between interpolated
            scaled = torch.where(wavelen > low_wavelen, inv / self.factor, inv)
            smooth = (old_len / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
            smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
            medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
            return torch.where(medium, smoothed, scaled)
        return inv


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """The shapes and options of one decoder."""

    model_type: str
    """The HF model_type: one with a registered model family (`family.supported_model_types()`)."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    """GQA: num_attention_heads must be a multiple of this."""
    head_dim: int
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    """True: the LM head is the embedding matrix; the buffer has no lm_head.weight."""
    value_head: bool = False
    """A critic: a scalar head `score.weight` [1, hidden] (HF token-classification name) replaces the LM head."""
    qkv_bias: bool = False
    """q/k/v projections have biases (Qwen2; Llama/Qwen3 with attention_bias)."""
    o_bias: bool = False
    """o_proj has a bias (Llama/Qwen3 with attention_bias)."""
    mlp_bias: bool = False
    """gate/up/down projections have biases (Llama mlp_bias)."""
    qk_norm: bool = False
    """RMSNorm of q and k before rope: per head (Qwen3), or over the whole projection with qk_norm_full_width."""
    qk_norm_full_width: bool = False
    """The q/k norms are over all heads of the projection (weights [heads * head_dim]: OLMoE), not per head."""
    sliding_window: int | None = None
    """Window of the sliding-window layers: query i sees keys j with i - window < j <= i."""
    layer_types: tuple[str, ...] = ()
    """'full_attention' or 'sliding_attention' per layer; empty: all sliding if sliding_window else all full."""
    rope: RopeConfig = field(default_factory=RopeConfig)
    max_position_embeddings: int = 4096
    initializer_range: float = 0.02
    """Std of the normal init of linear and embedding weights (random init)."""
    num_experts: int = 0
    """Mixture of experts: routed experts per MoE layer (0: a dense model)."""
    num_experts_per_tok: int = 0
    """MoE: the experts each token is routed to (top-k of the router's softmax)."""
    moe_intermediate_size: int = 0
    """MoE: the intermediate size of each routed expert."""
    norm_topk_prob: bool = False
    """MoE: the top-k routing weights are renormalised to sum to 1 (Qwen3-MoE)."""
    shared_expert_intermediate_size: int = 0
    """MoE: the intermediate size of the shared expert every token goes through, scaled by sigmoid of its gate
    (Qwen2-MoE); 0: none."""
    decoder_sparse_step: int = 1
    """MoE: layer i is an MoE layer when (i + 1) % decoder_sparse_step == 0 and i is not in mlp_only_layers."""
    mlp_only_layers: tuple[int, ...] = ()
    """MoE: layers with a dense MLP of intermediate_size."""
    router_aux_loss_coef: float = 0.0
    """MoE: coefficient of the load-balancing loss added in training (transformers' formula); transformers adds
    it only with output_router_logits, so a model translated from a config without it has 0."""
    expert_slices: int = 1
    """MoE, expert-parallel generation: the model holds num_experts / expert_slices of the routed experts (one
    TP rank's whole experts; `tensor_parallel.local_config` sets it to tg and `parallelize` their offset), while
    the router still scores all num_experts. 1: every expert."""

    def __post_init__(self):
        if not isinstance(self.model_type, str) or self.model_type not in supported_model_types():
            raise ValueError(f"ModelConfig: model_type {self.model_type!r} is not supported; "
                             f"supported: {supported_model_types()}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"ModelConfig: {name} must be >= 1, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"ModelConfig: num_attention_heads={self.num_attention_heads} is not a multiple "
                             f"of num_key_value_heads={self.num_key_value_heads}")
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig: head_dim={self.head_dim} must be even for rope")
        if not isinstance(self.rope, RopeConfig):
            raise ValueError(f"ModelConfig: rope must be a RopeConfig, got {type(self.rope).__name__}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"ModelConfig: sliding_window must be None or >= 1, got {self.sliding_window}")
        if not self.layer_types:
            kind = "sliding_attention" if self.sliding_window is not None else "full_attention"
            self.layer_types = (kind,) * self.num_hidden_layers
        self.layer_types = tuple(self.layer_types)
        if len(self.layer_types) != self.num_hidden_layers or not set(self.layer_types) <= set(LAYER_TYPES):
            raise ValueError(f"ModelConfig: layer_types must hold num_hidden_layers={self.num_hidden_layers} "
                             f"entries from {LAYER_TYPES}, got {self.layer_types}")
        if "sliding_attention" in self.layer_types and self.sliding_window is None:
            raise ValueError("ModelConfig: layer_types has sliding_attention layers but sliding_window is None")
        if self.qk_norm_full_width and not self.qk_norm:
            raise ValueError("ModelConfig: qk_norm_full_width=True needs qk_norm=True")
        self.mlp_only_layers = tuple(self.mlp_only_layers)
        if self.num_experts < 0 or self.shared_expert_intermediate_size < 0 or self.router_aux_loss_coef < 0:
            raise ValueError(f"ModelConfig: num_experts={self.num_experts}, shared_expert_intermediate_size="
                             f"{self.shared_expert_intermediate_size} and router_aux_loss_coef="
                             f"{self.router_aux_loss_coef} must be >= 0")
        if self.num_experts:
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                raise ValueError(f"ModelConfig: num_experts_per_tok={self.num_experts_per_tok} must be in "
                                 f"[1, num_experts={self.num_experts}]")
            if self.moe_intermediate_size < 1 or self.decoder_sparse_step < 1:
                raise ValueError(f"ModelConfig: moe_intermediate_size={self.moe_intermediate_size} and "
                                 f"decoder_sparse_step={self.decoder_sparse_step} must be >= 1 with experts")
        if isinstance(self.expert_slices, bool) or not isinstance(self.expert_slices, int) or self.expert_slices < 1:
            raise ValueError(f"ModelConfig: expert_slices must be an int >= 1, got {self.expert_slices!r}")
        if self.expert_slices > 1 and (not self.num_experts or self.num_experts % self.expert_slices):
            raise ValueError(f"ModelConfig: expert_slices={self.expert_slices} must divide num_experts="
                             f"{self.num_experts} (each slice holds whole experts)")

    def is_moe_layer(self, i: int) -> bool:
        """Whether layer i's feed-forward is the mixture of experts (else the dense MLP)."""
        return (self.num_experts > 0 and i not in self.mlp_only_layers
                and (i + 1) % self.decoder_sparse_step == 0)

    @property
    def num_local_experts(self) -> int:
        """The routed experts this model holds (num_experts / expert_slices)."""
        return self.num_experts // self.expert_slices

    def layer_window(self, i: int) -> int | None:
        """The sliding window of layer i, or None for full causal attention."""
        return self.sliding_window if self.layer_types[i] == "sliding_attention" else None

    @classmethod
    def from_hf(cls, hf_config) -> "ModelConfig":
        """Translate a transformers config (the shared fields here, the family's through its
        `config_from_hf`); a feature this model does not implement is a ValueError."""
        model_type = getattr(hf_config, "model_type", None)
        if model_type not in supported_model_types():
            raise ValueError(f"model_type {model_type!r} (architectures {getattr(hf_config, 'architectures', None)}) "
                             f"is not supported; supported: {supported_model_types()}")
        act = getattr(hf_config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"{model_type}: hidden_act {act!r} is not supported; only 'silu' (SwiGLU MLP)")
        heads = hf_config.num_attention_heads
        return cls(
            model_type=model_type,
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_hidden_layers=hf_config.num_hidden_layers,
            num_attention_heads=heads,
            num_key_value_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
            head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads,
            rms_norm_eps=hf_config.rms_norm_eps,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            rope=_rope_from_hf(hf_config),
            max_position_embeddings=getattr(hf_config, "max_position_embeddings", 4096),
            initializer_range=getattr(hf_config, "initializer_range", 0.02),
            **family_of(model_type).config_from_hf(hf_config),
        )


def _rope_from_hf(hf_config) -> RopeConfig:
    # transformers 5 keeps everything in `rope_parameters`; 4.x had `rope_theta` + `rope_scaling`.
    params = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"{hf_config.model_type}: rope type {rope_type!r} is not supported; supported: {ROPE_TYPES}")
    partial = params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ValueError(f"{hf_config.model_type}: partial_rotary_factor={partial} is not supported (only 1.0)")
    kw = dict(rope_type=rope_type, theta=float(theta))
    if rope_type in ("linear", "llama3"):
        kw["factor"] = float(params["factor"])
    if rope_type == "llama3":
        kw.update(low_freq_factor=float(params["low_freq_factor"]), high_freq_factor=float(params["high_freq_factor"]),
                  original_max_position_embeddings=int(params["original_max_position_embeddings"]))
    return RopeConfig(**kw)
