"""The model: a single-device Llama-family decoder whose weights are views of one flat buffer.

`config` (shapes and options, from HF configs), `decoder` (the modules and forward paths), `loading`
(safetensors folders, HF models, seeded init), `presets` (embedded configs, no downloads) and
`tensor_parallel` (TP applied from outside). Nothing here imports torch.distributed except
`tensor_parallel`, which the engine applies to a built model.
"""

from hybridengine.model.config import ModelConfig, RopeConfig
from hybridengine.model.decoder import CausalLM
from hybridengine.model.loading import load_model
from hybridengine.model.presets import MODEL_CONFIGS, model_config

__all__ = ["CausalLM", "MODEL_CONFIGS", "ModelConfig", "RopeConfig", "load_model", "model_config"]
