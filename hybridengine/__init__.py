"""hybridengine: one sharded parameter buffer for RL rollout and training."""

from .buffer import FlatParamBuffer
from .configs import MODEL_CONFIGS, model_config
from .engine import CompletionOutput, EngineConfig, HybridEngine, RequestOutput
from .layout import ParamSpec, ShardedLayout, param_specs, tp_role, unit_of
from .loading import load_model
from .model import CausalLM, ModelConfig, RopeConfig
from .ppo_loss import ppo_loss, token_logprobs, value_loss
from .sampling import SamplingParams
from .training import PPOBatch, PPOConfig, ValueConfig

__version__ = "0.1.0"

__all__ = ["FlatParamBuffer", "MODEL_CONFIGS", "model_config", "ParamSpec", "ShardedLayout",
           "param_specs", "tp_role", "unit_of", "load_model", "HybridEngine", "EngineConfig", "SamplingParams", "RequestOutput",
           "CompletionOutput", "PPOBatch", "PPOConfig", "ValueConfig", "CausalLM", "ModelConfig", "RopeConfig", "ppo_loss", "token_logprobs", "value_loss",
           "__version__"]
