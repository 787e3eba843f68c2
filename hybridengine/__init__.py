"""hybridengine: one sharded parameter buffer for RL rollout and training.

Rooms: `model` (the decoder, loading, TP), `rollout` (scheduler, KV cache, runner, sampler), `train`
(batches, trainer, optimizer, advantages), `sharding` (layout, flat buffer, generation memory, the
switch, checkpoints) and `ops` (one op per file, with its plain-torch reference). `engine` is the
only module that knows both halves.
"""

from hybridengine.config import EngineConfig, EngineTuning
from hybridengine.engine import HybridEngine
from hybridengine.faults import CollectiveError
from hybridengine.model import MODEL_CONFIGS, CausalLM, ModelConfig, RopeConfig, load_model, model_config
from hybridengine.ops.masked_logprobs import masked_logprobs
from hybridengine.ops.ppo_loss import ppo_loss
from hybridengine.ops.token_logprobs import token_logprobs
from hybridengine.ops.value_loss import value_loss
from hybridengine.rollout.outputs import CompletionOutput, RequestOutput
from hybridengine.rollout.sampling_params import SamplingParams
from hybridengine.sharding.buffer import FlatParamBuffer
from hybridengine.sharding.layout import ParamSpec, ShardedLayout, param_specs, tp_role, unit_of
from hybridengine.train import losses
from hybridengine.train.trainer import PPOBatch, PPOConfig, TrainConfig, ValueConfig

__version__ = "0.1.0"

__all__ = ["CausalLM", "CollectiveError", "CompletionOutput", "EngineConfig", "EngineTuning", "FlatParamBuffer",
           "HybridEngine", "MODEL_CONFIGS", "ModelConfig", "PPOBatch", "PPOConfig", "ParamSpec", "RequestOutput",
           "RopeConfig", "SamplingParams", "ShardedLayout", "TrainConfig", "ValueConfig", "__version__", "load_model",
           "losses", "masked_logprobs", "model_config", "param_specs", "ppo_loss", "tp_role", "token_logprobs",
           "unit_of", "value_loss"]
