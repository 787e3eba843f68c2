"""The engine's configuration: how it holds the model, runs rollout and trains."""

from __future__ import annotations

import os
import dataclasses
from dataclasses import dataclass, field, fields

import torch

from hybridengine import checks
from hybridengine.options import OFFLOAD_MODES, SAMPLERS, TP_ALL_REDUCE


@dataclass(kw_only=True, slots=True)
class EngineTuning:
    """Implementation switches of the engine: which kernels, schedules and allocator settings it uses where
    more than one gives the same results. Each default is the measured choice (docs/benchmarks.md); they
    exist to compare paths and to work around a machine. `EngineConfig.tuning` holds one; validated on
    construction (the checks that need the rest of the config run in `EngineConfig`)."""

    tp_all_reduce: str = "auto"
    """How TP generation (tp_generation > 1) all-reduces: 'symm_mem' (torch symmetric memory over
    NVLink, `SymmAllReduce`; messages up to max(max_num_seqs, 512) x hidden, larger ones NCCL),
    'nccl' (dist.all_reduce), or 'auto' (symm_mem on CUDA when it sets up, with a warning when it does
    not; the process group's all_reduce elsewhere)."""
    lazy_cuda_graphs: bool = True
    """Capture each decode batch bucket's CUDA graph at its first decode step (True) instead of all
    buckets at rollout entry (False): a rollout whose batch never shrinks captures one graph, so the
    rollout's set-up is nearly free and generation runs as fast."""
    async_scheduling: bool = True
    """Schedule and launch each decode step before the previous step's tokens reach the host: the
    step's input ids are copied from the previous step's sampled tokens on the device, and the host
    reads step t's tokens and does its bookkeeping while step t + 1 runs, so the GPU does not idle
    between steps (vLLM's async scheduling). A sequence that emits a stop token runs one void step
    more (its row is dropped). Steps before a prefill or a preemption run synchronously. Outputs are
    the same either way."""
    fused_training: bool = True
    """CUDA: run training's RMSNorm, RoPE and SiLU * up (forward and backward) as the Triton kernels of
    `hybridengine.ops` (rms_norm, rope, silu_mul) instead of eager torch: fewer kernels and fewer saved
    tensors, so a faster step and a lower peak. Ignored on CPU (eager torch there)."""
    split_master: bool | None = None
    """bf16: keep AdamW's fp32 master weights as the bf16 weights (their high half, rounded to nearest,
    ties away from zero) plus an int16 low half: the same fp32 master, exactly, in 2 bytes per parameter
    instead of 4, at the same speed. None (default): on for bf16, off otherwise (resolved at
    construction)."""
    expandable_segments: bool | None = None
    """On CUDA, switch torch's caching allocator to expandable segments when the engine is built. Each
    GRPO step brings other shapes (prompt and response lengths, micro-batch sizes); with fixed-size
    segments the reserve follows each step's shapes, with expandable ones it stays within a few hundred
    MiB (the soak bench, docs/benchmarks.md). None: on, unless PYTORCH_CUDA_ALLOC_CONF is set (the
    caller's choice stands); False: leave the allocator alone. It is a process-wide setting."""
    sampler: str = "auto"
    """'fused': a step whose requests all sample without top-k/top-p draws its tokens and log-probs in
    one Triton pass over the logits (`hybridengine.ops.sample_fused`, Philox noise in the kernel);
    'torch': always `rollout.sampler.sample` (torch's generators); 'auto': fused on CUDA, torch
    elsewhere. A step with any truncating request takes `sample` for those rows. The samplers draw
    different random streams: a seeded request is reproducible within one sampler (independent of
    batch composition and preemption in both), not across them. Greedy rows give the same tokens in
    both."""

    expert_parallel_training: bool = False
    """Mixture of experts at tp_generation > 1: training runs each routed expert on the rank that owns it (the
    EP group is the TP group; tokens go to the owners and back by all-to-all, `train.expert_parallel`) instead
    of every rank running every expert on its own tokens; a layer's gather brings only the rank's own experts
    and their gradients are reduced among their owners (`sharding.expert_comm`). The same loss and gradients
    up to the rounding of the experts' GEMMs over other row groupings (exact mode: the same bits;
    docs/moe.md)."""

    def __post_init__(self):
        op = "EngineTuning"
        if self.tp_all_reduce not in TP_ALL_REDUCE:
            raise ValueError(f"{op}.tp_all_reduce must be one of {TP_ALL_REDUCE}, got {self.tp_all_reduce!r}")
        if self.sampler not in SAMPLERS:
            raise ValueError(f"{op}.sampler must be 'auto', 'fused' or 'torch', got {self.sampler!r}")
        for name in ("lazy_cuda_graphs", "async_scheduling", "fused_training", "expert_parallel_training"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{op}.{name} must be a bool, got {checks.describe(getattr(self, name))}")
        if self.expandable_segments is not None and not isinstance(self.expandable_segments, bool):
            raise ValueError(f"{op}.expandable_segments must be None, True or False, got "
                             f"{checks.describe(self.expandable_segments)}")
        if self.split_master is not None and not isinstance(self.split_master, bool):
            raise ValueError(f"{op}.split_master must be None or a bool, got {checks.describe(self.split_master)}")


TUNING_FIELDS = tuple(f.name for f in fields(EngineTuning))
"""The fields that moved from EngineConfig into EngineTuning (`EngineConfig.from_dict` reads old checkpoints)."""


@dataclass(kw_only=True, slots=True)
class EngineConfig:
    """How the engine holds the model, runs rollout and trains: what a user sets. The implementation
    switches are in `tuning` (`EngineTuning`). Validated on construction."""

    dtype: torch.dtype = torch.bfloat16
    """Parameter, activation and KV cache dtype."""
    device: str = "cuda" if torch.cuda.is_available() else "cpu"
    """Under torchrun on GPUs, each rank uses cuda:LOCAL_RANK."""
    tp_generation: int = 1
    """Tensor-parallel degree of generation; divides the world size."""
    block_size: int = 16
    """Tokens per KV cache block (a power of 2)."""
    max_model_len: int = 4096
    """Longest prompt + completion; at most the model's max_position_embeddings (`check_model`)."""
    gpu_memory_utilization: float = 0.9
    """Fraction of the GPU's memory the engine may use; the KV cache gets what parameters leave, up to
    what it can ever hold in use: max_num_seqs sequences of max_model_len (more would only be freed
    again at the rollout's exit)."""
    num_kv_blocks: int | None = None
    """An explicit KV cache size in blocks (overrides gpu_memory_utilization; on CPU it must fit in the
    available memory). The default on CPU is enough for max_num_seqs sequences of max_model_len, within
    `rollout.kv_cache.CPU_KV_CACHE_BYTES` and half the available memory."""
    max_num_seqs: int = 256
    """Most sequences decoded in one step."""
    max_num_batched_tokens: int = 16384
    """Most prompt tokens in one prefill step (a longer prompt runs alone)."""
    cuda_graphs: bool = True
    """Replay each decode batch bucket's step as a CUDA graph (CUDA only)."""
    enable_prefix_caching: bool = True
    """Full KV blocks are reused by later requests with the same token prefix within one rollout(): a
    prompt that starts with a cached prefix (another prompt, or the previous turn of a conversation with
    its completion) computes only the tokens after it. Never across a weight change: the cache lives for
    one rollout. The tokens after a cached prefix see the same keys, computed in another step: log-probs
    agree with those without it up to the rounding of a differently batched prefill, bitwise under
    exact_logprobs."""
    keep_grads: bool = False
    """Keep the fp32 gradient shards (4 bytes a parameter on each rank's shard) after `ppo_step` /
    `value_step`, for inspection; by default each step allocates them as its reduce-scatters arrive and
    frees them after the optimizer update (FSDP's `zero_grad(set_to_none=True)`), so the forward's
    activations (checkpointing off) never stack on them. A step that fails frees them either way."""
    seed: int = 0
    """Seed of random initialisation (when the source is a config) and of unseeded sampling; in [0, 2**63)."""
    collective_timeout_s: float = 300.0
    """How long a rank waits for its peers inside a collective phase before raising (a finite number > 0)."""
    exact_logprobs: bool = False
    """Exact on-policy mode: for every token `generate` returns, its log-prob equals bitwise what
    `log_probs` (and the first forward of `ppo_step`) computes at that position, whatever the batch, `n`,
    max_num_seqs, preemption, CUDA graphs, packing, micro-batch size, world size, and tp_generation in
    {1, 2}. Every projection runs `ops.linear_exact` (a GEMM whose per-element bits do not depend on the
    batch), attention the exact ops (`ops.exact_attention`: fixed KV tiles in a fixed order, the same in
    training, prefill and decode), the row-parallel projections sum two fp32 halves (the TP all-reduce's
    tree at tg = 2), an MoE layer's routed experts sum two fp32 partials over the halves of the experts (the
    expert-parallel all-reduce's tree at tg = 2), and the LM head's log-probs are one row-wise reduction shared by
    the sampler and the trainer (`ops.ppo_loss.chosen_logprobs`). Greedy generation is then batch-invariant. Needs
    fused_training on CUDA (the rollout's elementwise kernels) and tp_generation <= 2."""
    return_routed_experts: bool = False
    """Mixture-of-experts models: every finished sample's `CompletionOutput.routed_experts` holds the experts
    each MoE layer chose for each token the rollout ran (the routing-replay record; rollout/routing.py). Under
    exact_logprobs they are the trainer's choices for the same tokens, bit for bit. Costs one int16 table of
    top-k ids per layer beside the KV cache, and one read per finished sample."""
    offload: str = "none"
    """Where AdamW's state (fp32 moments, fp32 masters or the split masters' low halves: 10-12 bytes a
    parameter of the local shard) lives (`hybridengine.train.offload`). 'none': on the device. 'rollout':
    entering `rollout()` moves it to pinned host memory before the KV cache is sized (the cache gets that
    memory), and the first training call after the rollout starts bringing it back on a side stream (the
    optimizer step joins it). 'optimizer': in pinned host memory always, streamed through the device in
    chunks for each optimizer step, so a model whose weights, gradients and activations fit but whose
    optimizer state does not can train. Results are bit for bit those of 'none'. Each rank offloads its
    own shard."""
    offload_host_limit_gib: float | None = None
    """With offload: the most host memory (GiB) this rank's offloaded state may take; None: what the
    system has available. A state that needs more raises before anything moves."""
    tuning: EngineTuning = field(default_factory=EngineTuning)
    """Implementation switches (`EngineTuning`): each has the default its benchmarks chose; set them to
    compare paths, not to configure the engine."""

    def __post_init__(self):
        op = "EngineConfig"
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise ValueError(f"EngineConfig.dtype must be a floating torch.dtype, got {checks.describe(self.dtype)}")
        if isinstance(self.device, torch.device):
            self.device = str(self.device)
        try:
            device_type = torch.device(self.device).type
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"EngineConfig.device must name a torch device, got {checks.describe(self.device)}") from e
        for name in ("tp_generation", "block_size", "max_model_len", "max_num_seqs", "max_num_batched_tokens"):
            checks.number(op, name, getattr(self, name), integer=True)
        checks.number(op, "seed", self.seed, low=0, high=2**63, high_open=True, integer=True)
        checks.number(op, "collective_timeout_s", self.collective_timeout_s, low=0, low_open=True)
        if self.tp_generation < 1:
            raise ValueError(f"EngineConfig.tp_generation must be >= 1, got {self.tp_generation}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"EngineConfig.block_size must be a power of 2, got {self.block_size}")
        if self.max_model_len < 2:
            raise ValueError(f"EngineConfig.max_model_len must be >= 2, got {self.max_model_len}")
        checks.number(op, "gpu_memory_utilization", self.gpu_memory_utilization)
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"EngineConfig.gpu_memory_utilization must be in (0, 1], "
                             f"got {self.gpu_memory_utilization}")
        if self.num_kv_blocks is not None:
            checks.number(op, "num_kv_blocks", self.num_kv_blocks, integer=True)
            if self.num_kv_blocks < 1:
                raise ValueError(f"EngineConfig.num_kv_blocks must be None or >= 1, got {self.num_kv_blocks}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("EngineConfig.max_num_seqs and max_num_batched_tokens must be >= 1")
        for name in ("cuda_graphs", "enable_prefix_caching", "keep_grads", "exact_logprobs",
                     "return_routed_experts"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"EngineConfig.{name} must be a bool, got {checks.describe(getattr(self, name))}")
        if self.exact_logprobs and self.tp_generation > 2:
            raise ValueError(f"EngineConfig.exact_logprobs=True needs tp_generation 1 or 2 (the row-parallel sums "
                             f"add two fp32 halves), got tp_generation={self.tp_generation}")
        if self.offload not in OFFLOAD_MODES:
            raise ValueError(f"EngineConfig.offload must be one of {OFFLOAD_MODES}, got {self.offload!r}")
        if self.offload_host_limit_gib is not None:
            checks.number(op, "offload_host_limit_gib", self.offload_host_limit_gib, low=0, low_open=True)
        self._check_tuning(device_type)

    def _check_tuning(self, device_type: str) -> None:
        """`tuning` against the rest of the config; its own copy, with split_master resolved for this dtype (a
        tuning object passed to several configs stays as the caller made it)."""
        if not isinstance(self.tuning, EngineTuning):
            raise ValueError(f"EngineConfig.tuning must be an EngineTuning, got {checks.describe(self.tuning)}")
        tuning = self.tuning = dataclasses.replace(self.tuning)
        if tuning.sampler == "fused" and device_type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"EngineTuning.sampler='fused' on device {self.device!r} needs CUDA or TRITON_INTERPRET=1 "
                             "(the fused sampler is a Triton kernel)")
        if self.exact_logprobs and device_type == "cuda" and not tuning.fused_training:
            raise ValueError("EngineConfig.exact_logprobs=True on CUDA needs EngineTuning.fused_training=True: "
                             "training must run the rollout's norm, RoPE and SiLU kernels to compute the same bits")
        if tuning.split_master is None:
            tuning.split_master = self.dtype == torch.bfloat16
        if tuning.split_master and self.dtype != torch.bfloat16:
            raise ValueError(f"EngineTuning.split_master=True needs dtype=torch.bfloat16 (the master's high half), "
                             f"got {self.dtype}")

    @classmethod
    def from_dict(cls, saved: dict) -> "EngineConfig":
        """The config of `dataclasses.asdict` (a checkpoint's meta): `tuning` as a dict, or, in a checkpoint
        written before EngineTuning, its fields among the others."""
        saved = dict(saved)
        tuning = dict(saved.pop("tuning", None) or {})
        tuning.update({name: saved.pop(name) for name in TUNING_FIELDS if name in saved})
        return cls(**saved, tuning=EngineTuning(**tuning))

    def check_model(self, model) -> None:
        """The model (a `ModelConfig`) can run this config: max_model_len within its positions. Raises
        ValueError; the engine calls it when it knows the model, before allocating anything for it."""
        limit = model.max_position_embeddings
        if self.max_model_len > limit:
            raise ValueError(f"EngineConfig.max_model_len={self.max_model_len} exceeds the model's "
                             f"max_position_embeddings={limit}; lower max_model_len to at most {limit}")
