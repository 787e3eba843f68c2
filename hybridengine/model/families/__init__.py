"""The built-in model families (`hybridengine.model.family`): the dense Llama family (Llama, Qwen2, Qwen3,
Mistral) and the mixture-of-experts families: Qwen MoE (Qwen2-MoE, Qwen3-MoE) and OLMoE. Importing this package
registers them."""

from hybridengine.model.families.dense import LLAMA, MISTRAL, QWEN2, QWEN3
from hybridengine.model.families.olmoe import OLMOE
from hybridengine.model.families.qwen_moe import QWEN2_MOE, QWEN3_MOE

__all__ = ["LLAMA", "MISTRAL", "OLMOE", "QWEN2", "QWEN2_MOE", "QWEN3", "QWEN3_MOE"]
