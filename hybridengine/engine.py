"""HybridEngine: rollout and (later) training on one shared, sharded parameter buffer.

Alone (no process group, or a group of one) the engine owns one unsharded model. Under torchrun
it shards the parameters over the default process group (`ShardedBuffer`); `rollout()` switches
to the generation view, allocates the paged KV cache inside the memory budget, and on exit frees
the cache and switches back.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import random
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from hybridengine.sharding.buffer import FlatParamBuffer
from hybridengine.model.loading import load_model
from hybridengine.model.decoder import CausalLM
from hybridengine.rollout.runner import KVCache, ModelRunner
from hybridengine.rollout.sampler import SamplingParams, _to_device, sample, sample_fused
from hybridengine.model.tensor_parallel import TP_ALL_REDUCE, local_config, make_all_reduce, parallelize
from hybridengine.rollout.scheduler import PLACEHOLDER, BlockManager, Scheduler, Sequence, Status


def _hf_config_dict(source) -> dict | None:
    """The transformers config of the source as a dict (for export_hf), or None for a ModelConfig."""
    from transformers import AutoConfig, PretrainedConfig, PreTrainedModel

    if isinstance(source, PreTrainedModel):
        return source.config.to_dict()
    if isinstance(source, PretrainedConfig):
        return source.to_dict()
    if isinstance(source, (str, bytes)) or hasattr(source, "__fspath__"):
        try:
            return AutoConfig.from_pretrained(source, local_files_only=True).to_dict()
        except (OSError, ValueError):
            return None  # load_model raises the real error
    return None


@dataclass(kw_only=True, slots=True)
class EngineConfig:
    """How the engine holds the model and runs rollout."""

    dtype: torch.dtype = torch.bfloat16
    device: str = "cuda" if torch.cuda.is_available() else "cpu"
    """Under torchrun on GPUs, each rank uses cuda:LOCAL_RANK."""
    tp_generation: int = 1
    """Tensor-parallel degree of generation; divides the world size."""
    tp_all_reduce: str = "auto"
    """How TP generation (tp_generation > 1) all-reduces: 'symm_mem' (torch symmetric memory over
    NVLink, `tp.SymmAllReduce`; messages up to max(max_num_seqs, 512) x hidden, larger ones NCCL),
    'nccl' (dist.all_reduce), or 'auto' (symm_mem on CUDA when it sets up, with a warning when it does
    not; the process group's all_reduce elsewhere)."""
    block_size: int = 16
    max_model_len: int = 4096
    """Longest prompt + completion."""
    gpu_memory_utilization: float = 0.9
    """Fraction of the GPU's memory the engine may use; the KV cache gets what parameters leave, up to
    what it can ever hold in use: max_num_seqs sequences of max_model_len (more would only be freed
    again at the rollout's exit)."""
    num_kv_blocks: int | None = None
    """An explicit KV cache size in blocks (overrides gpu_memory_utilization; the default on CPU is
    enough for max_num_seqs sequences of max_model_len)."""
    max_num_seqs: int = 256
    """Most sequences decoded in one step."""
    max_num_batched_tokens: int = 16384
    """Most prompt tokens in one prefill step (a longer prompt runs alone)."""
    cuda_graphs: bool = True
    lazy_cuda_graphs: bool = True
    """Capture each decode batch bucket's CUDA graph at its first decode step (True) instead of all
    buckets at rollout entry (False): a rollout whose batch never shrinks captures one graph. In `python
    -m bench run --suite ppo_e2e --gpus 2` (2 x H200, run 20261130T164536Z-71bb, both settings in the
    run) rollout setup went from 0.77 to 0.003 s per rollout for 7B (0.47 to 0.001 s for 1.5B) with
    generation as fast (1.87 vs 1.91 s): the GRPO step 9.15 -> 8.30 s (7B), 3.16 -> 2.72 s (1.5B)."""
    async_scheduling: bool = True
    """Schedule and launch each decode step before the previous step's tokens reach the host: the
    step's input ids are copied from the previous step's sampled tokens on the device, and the host
    reads step t's tokens and does its bookkeeping while step t + 1 runs, so the GPU does not idle
    between steps (vLLM's async scheduling). A sequence that emits a stop token runs one void step
    more (its row is dropped). Steps before a prefill or a preemption run synchronously. Outputs are
    the same either way."""
    fused_training: bool = True
    """CUDA: run training's RMSNorm, RoPE and SiLU * up (forward and backward) as the Triton kernels of
    `hybridengine.ops.fused` instead of eager torch (fewer kernels, fewer saved tensors). In `python -m bench
    run --suite train_step --gpus 2` (2 x H200, run 20261130T142923Z-af59, both settings in the run) it
    made the step 4-10% faster (1.5B and 7B, checkpointing on and off) and the 7B peak with
    checkpointing off 8% lower. Ignored on CPU (eager torch there)."""
    split_master: bool | None = None
    """bf16: keep AdamW's fp32 master weights as the bf16 weights (their high half, rounded to nearest,
    ties away from zero) plus an int16 low half: the same fp32 master, exactly, in 2 bytes per parameter
    instead of 4. None (default): on for bf16, off otherwise (resolved at construction). In `python -m
    bench run --suite train_peers --gpus 2 --model qwen2-7b` (2 x H200, run 20261130T163518Z-cfff) it took
    the 7B step's torch peak from 72.9 to 65.7 GiB (checkpointing off; on: 70.5 -> 63.3) at the same
    speed (0.414 vs 0.416 s), which is what brings the step under FSDP2's peak."""
    keep_grads: bool = False
    """Keep the fp32 gradient shards (4 bytes a parameter on each rank's shard) after `ppo_step` /
    `value_step`, for inspection; by default each step allocates them as its reduce-scatters arrive and
    frees them after the optimizer update (FSDP's `zero_grad(set_to_none=True)`), so the forward's
    activations (checkpointing off) never stack on them."""
    seed: int = 0
    """Seed of random initialisation (when the source is a config) and of unseeded sampling."""
    sampler: str = "auto"
    """'fused': a step whose requests all sample without top-k/top-p draws its tokens and log-probs in
    one Triton pass over the logits (`sampling.sample_fused`, Philox noise in the kernel); 'torch':
    always `sampling.sample` (torch's generators); 'auto': fused on CUDA, torch elsewhere. A step with
    any truncating request takes `sample`. The samplers draw different random streams: a seeded
    request is reproducible within one sampler (independent of batch composition and preemption in
    both), not across them. Greedy rows give the same tokens in both."""

    def __post_init__(self):
        if self.tp_generation < 1:
            raise ValueError(f"EngineConfig.tp_generation must be >= 1, got {self.tp_generation}")
        if self.sampler not in ("auto", "fused", "torch"):
            raise ValueError(f"EngineConfig.sampler must be 'auto', 'fused' or 'torch', got {self.sampler!r}")
        if self.sampler == "fused" and not self.device.startswith("cuda") and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"EngineConfig.sampler='fused' on device {self.device!r} needs CUDA or TRITON_INTERPRET=1 "
                             "(the fused sampler is a Triton kernel)")
        if self.tp_all_reduce not in TP_ALL_REDUCE:
            raise ValueError(f"EngineConfig.tp_all_reduce must be one of {TP_ALL_REDUCE}, got {self.tp_all_reduce!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"EngineConfig.block_size must be a power of 2, got {self.block_size}")
        if self.max_model_len < 2:
            raise ValueError(f"EngineConfig.max_model_len must be >= 2, got {self.max_model_len}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"EngineConfig.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"EngineConfig.num_kv_blocks must be None or >= 1, got {self.num_kv_blocks}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("EngineConfig.max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.split_master is None:
            self.split_master = self.dtype == torch.bfloat16
        if self.split_master and self.dtype != torch.bfloat16:
            raise ValueError(f"EngineConfig.split_master=True needs dtype=torch.bfloat16 (the master's high half), "
                             f"got {self.dtype}")


@dataclass(slots=True)
class CompletionOutput:
    """One sample of one prompt."""

    index: int
    token_ids: list[int]
    logprobs: list[float]
    """log_softmax(logits / temperature) at each chosen token (temperature 0: T = 1); see sampling.py."""
    finish_reason: str
    """'stop' (a stop token was emitted) or 'length' (max_tokens)."""


@dataclass(slots=True)
class RequestOutput:
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)


class HybridEngine:
    """Owns the parameter buffer, the KV cache and (later) the optimizer of one model."""

    def __init__(self, source, config: EngineConfig | None = None, *, role: str = "actor"):
        """role: 'actor' (LM head: rollout, log_probs, ppo_step) or 'critic' (a scalar value head
        `score.weight` on the same backbone, freshly initialised: values, value_step)."""
        if role not in ("actor", "critic"):
            raise ValueError(f"role must be 'actor' or 'critic', got {role!r}")
        self.role = role
        self.config = config = config if config is not None else EngineConfig()
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        if self.world_size % config.tp_generation:
            raise ValueError(f"EngineConfig.tp_generation={config.tp_generation} must divide the world size "
                             f"{self.world_size}")
        device = torch.device(config.device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.model = self._build_sharded(source)
        self.model.eval()
        self._sample_rng = random.Random(config.seed)  # keys of the fused sampler's unseeded rows
        self._runner: ModelRunner | None = None
        self._training = None
        self._scheduler: Scheduler | None = None
        self.stats: dict[str, float] = {}

    def _build_sharded(self, source) -> CausalLM:
        from hybridengine.sharding.sharded import ShardedBuffer

        cfg = self.config
        # Alone, the full model is built on the target device; sharded, each rank builds it on the CPU
        # and keeps only its shards.
        self.hf_config = _hf_config_dict(source)
        full = load_model(source, dtype=cfg.dtype, device=self.device if self.world_size == 1 else "cpu", seed=cfg.seed)
        params = {n: p.detach() for n, p in full.named_parameters()}  # load_ reads only the specs' names
        self.model_config = dataclasses.replace(full.config, value_head=True) if self.role == "critic" else full.config
        if self.role == "critic":  # the backbone's weights plus a fresh value head
            gen = torch.Generator().manual_seed(cfg.seed + 1)
            params["score.weight"] = (torch.randn(1, full.config.hidden_size, generator=gen)
                                      * full.config.initializer_range).to(cfg.dtype)
        specs = CausalLM(self.model_config, dtype=cfg.dtype, device="meta").flat_buffer.layout.specs
        self.sharded = ShardedBuffer(specs, dtype=cfg.dtype, device=self.device, tp_size=cfg.tp_generation)
        self.sharded.load_(params)
        buffer = FlatParamBuffer(self.sharded.layout, dtype=cfg.dtype, rank=self.rank, data=self.sharded.gen.data)
        tp = cfg.tp_generation
        self.vocab_size = self.model_config.vocab_size
        self.tp_all_reduce = None
        del full, params
        if self.role == "critic":
            return CausalLM(self.model_config, buffer=buffer) if tp == 1 else CausalLM(self.model_config, device="meta")
        model = CausalLM(local_config(self.model_config, tp), buffer=buffer)
        self.tp_all_reduce = None if tp == 1 else make_all_reduce(
            cfg.tp_all_reduce, self.sharded.tp_group, capacity=max(cfg.max_num_seqs, 512) * self.model_config.hidden_size,
            dtype=cfg.dtype, device=self.device)
        return parallelize(model, vocab_size=self.vocab_size, tp_rank=self.sharded.tp_rank, tp_size=tp,
                           group=self.sharded.tp_group, all_reduce=self.tp_all_reduce)

    def _tp_group(self):
        if self.config.tp_generation == 1:
            return None
        self._tp_src = dist.get_global_rank(self.sharded.tp_group, 0)
        return self.sharded.tp_group

    # -- checkpoints and memory -----------------------------------------------------------------------

    def save(self, path) -> None:
        """Sharded state (weights, optimizer, step, RNG, config) to a folder, atomically; every rank calls it."""
        from hybridengine.sharding.checkpoint import save

        save(self, path)

    @classmethod
    def load(cls, path, config: EngineConfig | None = None) -> "HybridEngine":
        """An engine restored from `save`, at this process's world size (and `config`'s TP degree)."""
        from hybridengine.sharding.checkpoint import load

        return load(path, config=config)

    def export_hf(self, path) -> None:
        """config.json + model.safetensors for transformers' from_pretrained (rank 0 writes)."""
        from hybridengine.sharding.checkpoint import export_hf

        export_hf(self, path)

    def memory_report(self) -> dict[str, float]:
        """GiB on this rank: parameters (G mapped), optimizer state, gradients, KV cache; torch and NVML totals."""
        gib = 2**30
        rep = dict(parameters_mapped=self.sharded.gen.mapped_bytes() / gib,
                   parameters_shard=self.sharded.layout.shard_numel * self.sharded.layout.element_size / gib)
        opt = self._training._optimizer if self._training is not None else None
        grads = self._training._grads if self._training is not None else None
        tensors = [] if opt is None else opt.exp_avg + opt.exp_avg_sq + (opt.master or []) + (opt.master_lo or [])
        rep["optimizer"] = sum(t.numel() * t.element_size() for t in tensors) / gib  # 0 before the first step
        rep["gradients"] = sum(g.numel() * g.element_size() for g in grads or [] if g is not None) / gib
        rep["kv_cache"] = self._runner.kv.nbytes() / gib if self._runner is not None else 0.0
        if self.device.type == "cuda":
            rep["torch_allocated"] = torch.cuda.memory_allocated(self.device) / gib
            rep["torch_peak"] = torch.cuda.max_memory_allocated(self.device) / gib
            try:
                import pynvml

                pynvml.nvmlInit()
                handle = pynvml.nvmlDeviceGetHandleByIndex(self.device.index or 0)
                rep["nvml_device_used"] = pynvml.nvmlDeviceGetMemoryInfo(handle).used / gib
            except Exception:  # noqa: BLE001 - NVML is optional; the torch numbers stand
                pass
        return rep

    # -- training -------------------------------------------------------------------------------------

    def _trainer(self, cfg=None):
        from hybridengine.train.trainer import Trainer

        if self._runner is not None:
            raise RuntimeError("training calls (log_probs, ppo_step) are not allowed inside rollout()")
        if self._training is None:
            self._training = Trainer(self.sharded, self.model_config, optimizer_config=cfg,
                                     fused=self.config.fused_training and self.device.type == "cuda",
                                     split_master=self.config.split_master, keep_grads=self.config.keep_grads)
        return self._training

    def log_probs(self, batch, *, temperature: float = 1.0, return_entropy: bool = False):
        """[B, max_len - 1] log-probs of batch's target tokens (fused over the LM head, no grad)."""
        return self._trainer().log_probs(batch, temperature=temperature, return_entropy=return_entropy)

    def values(self, batch) -> torch.Tensor:
        """Critic: [B, max_len - 1] values at the positions of batch's target tokens (no grad)."""
        return self._trainer().values(batch)

    def value_step(self, batch, config=None) -> dict:
        """Critic: one optimizer step with `he.value_loss` (batch.old_values, batch.returns, response_mask)."""
        from hybridengine.train.trainer import ValueConfig

        config = config if config is not None else ValueConfig()
        return self._trainer(config).value_step(batch, config)

    def ppo_step(self, batch, config=None) -> dict:
        """One PPO/GRPO optimizer step on this rank's batch: returns loss, metrics, grad_norm, lr, step_s."""
        from hybridengine.train.trainer import PPOConfig

        config = config if config is not None else PPOConfig()
        return self._trainer(config).ppo_step(batch, config)

    # -- rollout ------------------------------------------------------------------------------------

    def prepare_rollout(self) -> None:
        """Start mapping the next rollout's generation pages on a host thread (`ShardedBuffer.
        prepare_generation`): call it right after the last `ppo_step` before `rollout()`, so the page
        mapping overlaps that step's queued GPU work and the switch is only the all-gather. The pages
        hold model/tg of memory from then on. No-op off CUDA / without the VMM buffer."""
        if self.role == "critic":
            raise RuntimeError("prepare_rollout() needs an actor engine; this one is a critic")
        self.sharded.prepare_generation()

    @contextlib.contextmanager
    def rollout(self):
        """Generation view + KV cache for the duration of the block; both released on exit."""
        if self.role == "critic":
            raise RuntimeError("rollout() needs an actor engine; this one is a critic")
        if self._runner is not None:
            raise RuntimeError("rollout() is already active")
        t0 = time.perf_counter()
        self.sharded.switch_to_generation()
        try:
            self.stats["switch_to_generation_s"] = time.perf_counter() - t0
            kv = self._allocate_kv()
            t1 = time.perf_counter()
            self._runner = ModelRunner(self.model, kv, max_num_seqs=self.config.max_num_seqs,
                                       max_model_len=self.config.max_model_len, use_cuda_graphs=self.config.cuda_graphs,
                                       lazy_cuda_graphs=self.config.lazy_cuda_graphs)
            self.stats.update(kv_cache_GiB=kv.nbytes() / 2**30, kv_blocks=kv.num_blocks,
                              cuda_graph_capture_s=self._runner.graph_capture_s, runner_setup_s=time.perf_counter() - t1)
            yield self
        finally:
            # Drop this frame's references too: empty_cache below must see the cache freed.
            runner, self._runner, kv = self._runner, None, None
            try:
                if runner is not None:
                    runner.close()
            finally:
                del runner
                self._leave_rollout()

    def _leave_rollout(self) -> None:
        """The end of every rollout, also after an error: free the cache, back to the training view."""
        if self.device.type == "cuda":
            # The KV cache and the CUDA graphs' pool go back to the driver once nothing is in flight
            # (the next switch maps generation pages outside torch's allocator). No gc.collect here:
            # it cost 0.22 s per switch in the ppo_e2e bench (1.5B, 2026-11-30).
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
        if self.sharded.state == "generation":
            self.sharded.switch_to_training()

    def _allocate_kv(self) -> KVCache:
        c, m = self.config, self.model.config
        shape = dict(num_layers=m.num_hidden_layers, block_size=c.block_size, num_kv_heads=m.num_key_value_heads,
                     head_dim=m.head_dim)
        per_block = KVCache.bytes_per_block(dtype=c.dtype, **shape)
        # What running sequences can ever hold (forks share blocks; a preempted one frees its own).
        most = c.max_num_seqs * math.ceil(c.max_model_len / c.block_size)
        if c.num_kv_blocks is not None:
            num_blocks = c.num_kv_blocks
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            # Blocks torch's allocator holds but no tensor uses are free for the cache too (the driver
            # counts them as used: after a previous engine or rollout they can be most of the GPU).
            free += torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
            # Leave room for activations of the largest prefill step and the logits of a decode step.
            reserve = 2 * c.max_num_batched_tokens * max(m.hidden_size, m.intermediate_size) * 4 \
                + c.max_num_seqs * m.vocab_size * 4 * 2
            budget = int(total * c.gpu_memory_utilization) - (total - free) - reserve
            if budget // per_block < math.ceil(c.max_model_len / c.block_size):
                raise RuntimeError(f"rank {self.rank}: the KV cache budget ({budget / 2**30:.2f} GiB at "
                                   f"gpu_memory_utilization={c.gpu_memory_utilization}) does not hold one sequence of "
                                   f"max_model_len={c.max_model_len}; raise gpu_memory_utilization or lower max_model_len")
            num_blocks = min(budget // per_block, most)
        else:
            num_blocks = most
        return KVCache(num_blocks=num_blocks, dtype=c.dtype, device=self.device, **shape)

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor]:
        """One step's tokens and log-probs. Each row's sampler follows from its own request: with the
        fused sampler on (EngineConfig.sampler), rows without top-k/top-p take `sample_fused` and the
        others `sample` (a mixed step runs both on their rows), so a seeded sample's tokens do not
        depend on what else is in the batch. Fused keys: a greedy row -1; a seeded sample its own key
        and its draw count (independent of the batch and of preemption); an unseeded row a key drawn
        for this step from the engine's RNG (EngineConfig.seed)."""
        params = [s.params for s in seqs]
        mode = self.config.sampler
        truncates = [p.top_k > 0 or p.top_p < 1 for p in params]
        fused = mode == "fused" or (mode == "auto" and logits.is_cuda)
        shard = getattr(self.model, "vocab_shard", None)
        if shard is not None:  # TP: logits are this rank's vocabulary slice
            if fused and not any(truncates) and shard.rows % 4 == 0:  # every rank's first column a multiple of 4
                return self._sample_fused(logits, seqs, shard)
            logits = shard.gather(logits)
        if not fused or all(truncates):
            return sample(logits, params, [s.generator for s in seqs])
        if not any(truncates):
            return self._sample_fused(logits, seqs)
        tokens = torch.empty(len(seqs), dtype=torch.int64, device=logits.device)
        logprobs = torch.empty(len(seqs), dtype=torch.float32, device=logits.device)
        for truncating in (False, True):  # the fused rows, then the truncating ones
            rows = [i for i, t in enumerate(truncates) if t == truncating]
            index = _to_device(rows, torch.int64, logits.device)  # pinned, non-blocking: no wait for the GPU
            part = logits.index_select(0, index)
            tok, lp = (sample(part, [params[i] for i in rows], [seqs[i].generator for i in rows]) if truncating
                       else self._sample_fused(part, [seqs[i] for i in rows]))
            tokens.index_copy_(0, index, tok)
            logprobs.index_copy_(0, index, lp.float())
        return tokens, logprobs

    def _sample_fused(self, logits: torch.Tensor, seqs: list[Sequence], shard=None) -> tuple[torch.Tensor, torch.Tensor]:
        step_key = self._sample_rng.getrandbits(62)
        keys, draws, inv_temp = [], [], []
        for i, seq in enumerate(seqs):
            p = seq.params
            if p.temperature == 0:
                keys.append(-1)
                draws.append(0)
                inv_temp.append(1.0)
                continue
            keys.append(_race_key(p.seed, seq.sample) if p.seed is not None
                        else (step_key + i * 0x9E3779B97F4A7C15) & (2**62 - 1))
            draws.append(seq.draws)
            inv_temp.append(1.0 / p.temperature)
            seq.draws += 1
        ints = _to_device([keys, draws], torch.int64, logits.device)
        vocab = {} if shard is None else dict(col_offset=shard.first, n_valid=shard.valid, group=shard.group)
        return sample_fused(logits, _to_device(inv_temp, torch.float32, logits.device), ints[0], ints[1], **vocab)

    def _validate(self, prompts, params: list[SamplingParams]) -> None:
        if self._runner is None:
            raise ValueError("generate() must be called inside `with engine.rollout():`")
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError("prompts must be a non-empty list of token-id lists")
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params: {len(params)} given for {len(prompts)} prompts")
        vocab, max_len = self.vocab_size, self.config.max_model_len
        blocks = self._runner.kv.num_blocks
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            if not isinstance(p, SamplingParams):
                raise ValueError(f"sampling_params[{i}] must be a SamplingParams, got {type(p).__name__}")
            if not isinstance(prompt, (list, tuple)) or len(prompt) == 0:
                raise ValueError(f"prompts[{i}] is empty; every prompt needs at least one token")
            if not all(isinstance(t, int) and 0 <= t < vocab for t in prompt):
                bad = next(t for t in prompt if not (isinstance(t, int) and 0 <= t < vocab))
                raise ValueError(f"prompts[{i}] has token id {bad!r} outside the vocabulary [0, {vocab})")
            if p.n > self.config.max_num_seqs:
                raise ValueError(f"sampling_params[{i}]: n={p.n} samples exceed EngineConfig.max_num_seqs="
                                 f"{self.config.max_num_seqs} (a prompt's samples decode in one batch)")
            if len(prompt) + p.max_tokens > max_len:
                raise ValueError(f"prompts[{i}]: prompt length {len(prompt)} + max_tokens {p.max_tokens} exceeds "
                                 f"max_model_len={max_len}")
            need = math.ceil((len(prompt) + p.max_tokens) / self.config.block_size)
            if need > blocks:
                raise ValueError(f"prompts[{i}]: needs {need} KV blocks at its longest, the cache has {blocks}")

    def generate(self, prompts: list[list[int]], sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 *, use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate completions for token-id prompts; outputs in prompt order, samples in index order."""
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        tp_group = self._tp_group()
        if tp_group is not None:  # a TP group generates one batch: its first rank's
            shared = [prompts, params]
            dist.broadcast_object_list(shared, src=self._tp_src, group=tp_group)
            prompts, params = shared
        self._validate(prompts, params)
        c = self.config
        blocks = BlockManager(self._runner.kv.num_blocks, c.block_size)
        sched = Scheduler(blocks, max_num_seqs=c.max_num_seqs, max_num_batched_tokens=c.max_num_batched_tokens)
        outputs = [RequestOutput(list(p)) for p in prompts]
        finished: list[Sequence] = []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            sched.add(Sequence(request=i, token_ids=list(prompt), num_prompt_tokens=len(prompt), params=p, fork=p.n))
        total = sum(p.n * p.max_tokens for p in params)
        bar = None
        if use_tqdm and self.rank == 0:
            from tqdm import tqdm

            bar = tqdm(total=total, desc="generate", unit="tok")
        t0, steps, decode_s, ahead = time.perf_counter(), 0, 0.0, 0
        tp_src = self._tp_src if tp_group is not None else 0
        # Async decode: a decode step is launched before the previous one's tokens reach the host (its
        # input ids are copied on the device); the host reads step t's tokens while step t + 1 runs.
        inflight: _Sampled | None = None
        while not sched.done:
            if inflight is not None and not sched.decodes_next():
                _resolve(sched, inflight, finished)  # a prefill or a preemption comes next: sync first
                inflight = None
                continue
            ts, captured = time.perf_counter(), self._runner.graph_capture_s
            batch = sched.schedule()
            prev = None if inflight is None else (inflight.next_ids, _rows(batch.seqs, inflight.seqs, self.device))
            logits = self._runner.step(batch, prev)
            seqs = batch.seqs
            if batch.is_prefill:
                logits, seqs = _fork_prefilled(sched, batch, logits, self.device)
            tokens, logprobs = self._sample(logits, seqs)
            step = _launch(seqs, tokens, logprobs, tp_group, tp_src)
            if inflight is not None:
                _resolve(sched, inflight, finished)
                ahead += 1
            _reserve(sched, step)
            if batch.is_prefill or not self.config.async_scheduling:
                _resolve(sched, step, finished)
                inflight = None
            else:
                inflight = step
            if not batch.is_prefill:  # the whole iteration, host bookkeeping included (a lazy graph capture not)
                decode_s += time.perf_counter() - ts - (self._runner.graph_capture_s - captured)
            steps += 1
            if bar is not None:
                bar.update(len(seqs))
        if inflight is not None:
            _resolve(sched, inflight, finished)
        if bar is not None:
            bar.close()
        for seq in sorted(finished, key=lambda s: (s.request, s.sample)):
            outputs[seq.request].outputs.append(
                CompletionOutput(seq.sample, seq.completion_ids, seq.logprobs, seq.finish_reason))
        self.stats.update(generate_s=time.perf_counter() - t0, steps=steps, decode_s=decode_s,
                          preemptions=sched.num_preemptions, cuda_graph_capture_s=self._runner.graph_capture_s,
                          async_steps=ahead)
        return outputs


def _race_key(seed: int, sample: int) -> int:
    """A seeded sample's 62-bit Philox key (a splitmix64 finaliser of (seed, sample index))."""
    x = (seed * 0x9E3779B97F4A7C15 + sample * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & (2**64 - 1)
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
    return (x ^ (x >> 31)) >> 2


def _fork_prefilled(sched: Scheduler, batch, logits: torch.Tensor, device: torch.device):
    """After a prefill: each prompt awaiting its fork becomes its samples, which all draw from its row;
    fresh seeded samples get their generator. Returns (logits row per sequence, sequences)."""
    rows, seqs = [], []
    for r, seq in enumerate(batch.seqs):
        children = sched.fork(seq) if seq.fork > 1 else [seq]
        rows += [r] * len(children)
        seqs += children
    for seq in seqs:
        if seq.generator is None and seq.params.seed is not None:
            seq.generator = torch.Generator(device).manual_seed(seq.params.seed * 100003 + seq.sample)
    if rows != list(range(len(batch.seqs))):
        logits = logits[torch.tensor(rows).to(logits.device, non_blocking=True)]
    return logits, seqs


def _rows(seqs: list[Sequence], prev: list[Sequence], device: torch.device) -> torch.Tensor | None:
    """Row of each of seqs in the previous step's batch (None: row i is row i). A decode scheduled
    ahead runs the previous step's sequences minus those that finished, in the same order."""
    if len(seqs) <= len(prev) and all(a is b for a, b in zip(seqs, prev)):
        return None
    where = {id(seq): i for i, seq in enumerate(prev)}
    rows = [where.get(id(seq), -1) for seq in seqs]
    if min(rows) < 0:
        raise RuntimeError("async decode: a sequence of the step has no token in the previous step")
    if device.type != "cuda":
        return torch.tensor(rows, dtype=torch.int64)
    return torch.tensor(rows, dtype=torch.int64, pin_memory=True).to(device, non_blocking=True)


@dataclass(slots=True)
class _Sampled:
    """A step's sampled tokens and log-probs on their way to the host."""

    seqs: list[Sequence]
    next_ids: torch.Tensor
    """int64 [B] on the device: the next decode step's input ids (under TP, rank tp_src's)."""
    host: torch.Tensor
    """float64 [2, B]: tokens and log-probs (float64 holds both exactly: ids < 2^53, fp32 log-probs)."""
    ready: torch.cuda.Event | None
    void: list[bool]
    """Rows whose sequence had finished (a stop token read after this step was launched): ignored."""

    def wait(self) -> tuple[list[int], list[float]]:
        """The tokens and log-probs as Python lists, once the copy has landed."""
        if self.ready is not None:
            self.ready.synchronize()
        return self.host[0].long().tolist(), self.host[1].tolist()


def _launch(seqs: list[Sequence], tokens: torch.Tensor, logprobs: torch.Tensor, tp_group, tp_src: int) -> _Sampled:
    """Start the device-to-host copy (pinned, non-blocking on CUDA); under TP every rank continues
    with rank tp_src's tokens (one broadcast)."""
    packed = torch.stack((tokens.to(torch.float64), logprobs.to(torch.float64)))
    next_ids = tokens
    if tp_group is not None:
        dist.broadcast(packed, src=tp_src, group=tp_group)
        next_ids = packed[0].long()
    ready = None
    if packed.is_cuda:
        host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True).copy_(packed, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
    else:
        host = packed
    return _Sampled(seqs, next_ids, host, ready, [False] * len(seqs))


def _reserve(sched: Scheduler, step: _Sampled) -> None:
    """Give every sequence of a launched step its next token as PLACEHOLDER, so that the next step can
    be scheduled before the token is known; a sequence that reaches max_tokens with it finishes now
    (its blocks are freed: later steps that reuse them run after this one on the stream)."""
    for i, seq in enumerate(step.seqs):
        if seq.status is Status.FINISHED:  # stopped in the previous step: this row is void
            step.void[i] = True
            continue
        seq.token_ids.append(PLACEHOLDER)
        if seq.num_tokens - seq.num_prompt_tokens >= seq.params.max_tokens:
            sched.finish(seq, "length")


def _resolve(sched: Scheduler, step: _Sampled, finished: list[Sequence]) -> None:
    """Wait for a step's tokens, then `_append` them."""
    _append(sched, step, *step.wait(), finished)


def _append(sched: Scheduler, step: _Sampled, tokens: list[int], logprobs: list[float],
            finished: list[Sequence]) -> None:
    """Put each token in place of its sequence's PLACEHOLDER, with its log-prob; finish the sequences
    that emitted a stop token (or reached max_tokens in `_reserve`)."""
    for seq, tok, lp, void in zip(step.seqs, tokens, logprobs, step.void):
        if void:
            continue
        seq.token_ids[-1] = tok
        seq.logprobs.append(lp)
        stop = tok in seq.params.stop_token_ids
        if seq.status is Status.FINISHED:  # reached max_tokens with this token
            seq.finish_reason = "stop" if stop else "length"
            finished.append(seq)
        elif stop:
            sched.finish(seq, "stop")
            finished.append(seq)
