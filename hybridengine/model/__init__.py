"""The model: a single-device decoder whose weights are views of one flat buffer.

`family` (the seam: what one architecture declares: its feed-forward module, parallel plan, transformers
names and config translation), `families` (the built-in ones: dense Llama/Qwen2/Qwen3/Mistral, Qwen2-MoE and
Qwen3-MoE), `config` (shapes and options, from HF configs), `decoder` (the modules and forward paths), `moe`
(the mixture-of-experts feed-forward), `loading`
(safetensors folders, HF models, seeded init), `presets` (embedded configs, no downloads) and
`tensor_parallel` (TP applied from outside). Nothing here imports torch.distributed except
`tensor_parallel`, which the engine applies to a built model.
"""

from hybridengine.model.config import ModelConfig, RopeConfig
from hybridengine.model.decoder import CausalLM
from hybridengine.model.family import ModelFamily, ParallelPlan, family_of, register_family
from hybridengine.model.loading import load_model
from hybridengine.model.presets import MODEL_CONFIGS, model_config

__all__ = ["CausalLM", "MODEL_CONFIGS", "ModelConfig", "ModelFamily", "ParallelPlan", "RopeConfig", "family_of",
           "load_model", "model_config", "register_family"]
