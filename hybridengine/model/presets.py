"""Embedded model configs (no downloads): real shapes for benchmarks, tiny ones for tests and demos.

Each entry is the keyword set of a transformers config class; `model_config(name)` builds the
`PretrainedConfig`. Weights always come from random initialisation or a local folder.
"""

from __future__ import annotations

import copy

MODEL_CONFIGS: dict[str, dict] = {
    # Qwen2.5-1.5B shapes: tied embeddings, q/k/v bias.
    "qwen2.5-1.5b": dict(
        model_type="qwen2", hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
        num_key_value_heads=2, intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True,
        max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
    ),
    # Qwen2-7B shapes: untied LM head.
    "qwen2-7b": dict(
        model_type="qwen2", hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
        num_key_value_heads=4, intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False,
        max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
    ),
    # Qwen2.5-14B shapes (the Instruct model's config.json: 32768 positions, rms_norm_eps 1e-6; the base
    # model's says 131072 and 1e-5): 14.77B parameters, whose AdamW state (12 B a parameter with split
    # masters) does not fit next to the weights on one 141 GB GPU.
    "qwen2.5-14b": dict(
        model_type="qwen2", hidden_size=5120, num_hidden_layers=48, num_attention_heads=40,
        num_key_value_heads=8, intermediate_size=13824, vocab_size=152064, tie_word_embeddings=False,
        max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
    ),
    # A 32B-class config (Qwen2.5-32B shapes) for the scaling runs.
    "qwen2.5-32b": dict(
        model_type="qwen2", hidden_size=5120, num_hidden_layers=64, num_attention_heads=40,
        num_key_value_heads=8, intermediate_size=27648, vocab_size=152064, tie_word_embeddings=False,
        max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
    ),
    # A ~7B mixture of experts: the Qwen3-MoE architecture (the MoE family hybridengine implements) at
    # OLMoE-1B-7B's shapes (64 experts, top-8, 16 layers, its vocabulary): 6.92B parameters, of which a token
    # reads 1.18B (embedding row aside). Weights and AdamW state fit one 141 GB GPU; Qwen3-30B-A3B's would not.
    "qwen3-moe-7b": dict(
        model_type="qwen3_moe", hidden_size=2048, num_hidden_layers=16, num_attention_heads=16,
        num_key_value_heads=16, head_dim=128, intermediate_size=1024, moe_intermediate_size=1024,
        num_experts=64, num_experts_per_tok=8, norm_topk_prob=False, output_router_logits=True,
        router_aux_loss_coef=0.01, vocab_size=50304, tie_word_embeddings=False, max_position_embeddings=4096,
        rope_theta=10000.0, rms_norm_eps=1e-5,
    ),
    # Tiny configs, one per supported family, for CPU tests and the demo. Odd-ish sizes on purpose; 4096
    # positions, so that the default EngineConfig.max_model_len fits them.
    "tiny-llama": dict(
        model_type="llama", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=96, vocab_size=130, tie_word_embeddings=False,
        max_position_embeddings=4096, rope_theta=500000.0, rms_norm_eps=1e-5,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=64),
    ),
    "tiny-qwen2": dict(
        model_type="qwen2", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=96, vocab_size=128, tie_word_embeddings=True,
        max_position_embeddings=4096, rope_theta=1000000.0, rms_norm_eps=1e-6,
    ),
    "tiny-qwen3": dict(
        model_type="qwen3", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=24, intermediate_size=96, vocab_size=131,
        tie_word_embeddings=False, max_position_embeddings=4096, rope_theta=1000000.0,
        rms_norm_eps=1e-6,
    ),
    "tiny-qwen3-moe": dict(
        model_type="qwen3_moe", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=False, output_router_logits=True, router_aux_loss_coef=0.01,
        vocab_size=128, tie_word_embeddings=False, max_position_embeddings=4096, rope_theta=10000.0,
        rms_norm_eps=1e-5,
    ),
    "tiny-mistral": dict(
        model_type="mistral", hidden_size=64, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, intermediate_size=96, vocab_size=128, tie_word_embeddings=False,
        max_position_embeddings=4096, rope_theta=10000.0, rms_norm_eps=1e-5, sliding_window=None,
    ),
}


def model_config(name: str):
    """The transformers `PretrainedConfig` for an embedded config name."""
    if name not in MODEL_CONFIGS:
        raise ValueError(f"model config {name!r} is not embedded; known: {sorted(MODEL_CONFIGS)}")
    from transformers import AutoConfig

    kwargs = copy.deepcopy(MODEL_CONFIGS[name])
    return AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
