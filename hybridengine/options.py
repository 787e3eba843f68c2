"""The allowed values of `EngineConfig`'s string options.

They live apart from the config and from the code that implements each option, so that both import
them from here and neither imports the other: this module imports nothing.
"""

OFFLOAD_MODES = ("none", "rollout", "optimizer")
"""EngineConfig.offload (`train.offload`): 'none' (state on the device), 'rollout' (in host memory during
rollout()), 'optimizer' (in host memory always, streamed through the device for each step)."""
TP_ALL_REDUCE = ("auto", "nccl", "symm_mem")
"""EngineTuning.tp_all_reduce (`model.tensor_parallel.make_all_reduce`): how TP generation all-reduces."""
SAMPLERS = ("auto", "fused", "torch")
"""EngineTuning.sampler: which sampler draws the rollout's tokens."""
