"""HybridEngine: rollout and training on one shared, sharded parameter buffer.

Alone (no process group, or a group of one) the engine owns one unsharded model. Under torchrun
it shards the parameters over the default process group (`ShardedBuffer`). `rollout()` switches
to the generation view, allocates the paged KV cache inside the memory budget, and on exit frees
the cache and switches back; `generate` runs the rollout loop (`rollout.generator`) in between.
The training calls (`log_probs`, `ppo_step`, ...) run the `Trainer` over the training view of the
same buffer. This is the only module that knows both halves.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import os
import time

import torch
import torch.distributed as dist

from hybridengine.config import EngineConfig
from hybridengine.faults import CollectiveError, PhaseGuard
from hybridengine.model.decoder import CausalLM
from hybridengine.model.loading import hf_config_dict, load_model
from hybridengine.model.tensor_parallel import local_config, make_all_reduce, parallelize
from hybridengine.rollout import generator
from hybridengine.rollout.kv_cache import allocate_kv_cache
from hybridengine.rollout.outputs import CompletionOutput, RequestOutput
from hybridengine.rollout.runner import ModelRunner
from hybridengine.rollout.sampler import Sampler
from hybridengine.rollout.sampling_params import SamplingParams
from hybridengine.sharding.switch import ShardedBuffer

ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"

__all__ = ["CollectiveError", "CompletionOutput", "EngineConfig", "HybridEngine", "RequestOutput"]


class HybridEngine:
    """Owns the parameter buffer, the KV cache and the optimizer of one model."""

    def __init__(self, source, config: EngineConfig | None = None, *, role: str = "actor"):
        """source: what `he.load_model` takes (a transformers model or config, a ModelConfig, a local
        checkpoint folder). role: 'actor' (LM head: rollout, log_probs, ppo_step) or 'critic' (a
        scalar value head `score.weight` on the same backbone, freshly initialised: values, value_step)."""
        if role not in ("actor", "critic"):
            raise ValueError(f"role must be 'actor' or 'critic', got {role!r}")
        if config is not None and not isinstance(config, EngineConfig):
            raise ValueError(f"config must be an EngineConfig, got {type(config).__name__}")
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
        if device.type == "cuda" and (config.expandable_segments
                                      or (config.expandable_segments is None and not os.environ.get(ALLOC_CONF))):
            torch.cuda.memory._set_allocator_settings("expandable_segments:True")  # see the config field
        # The engine's own process group: its collectives time out after collective_timeout_s, so that a
        # rank that fails inside a phase and stays alive cannot hold its peers for the default 30 minutes.
        self._timeout = datetime.timedelta(seconds=config.collective_timeout_s)
        self.group = dist.new_group(timeout=self._timeout) if self.world_size > 1 else None
        self._guard = PhaseGuard(self.group, config.collective_timeout_s)
        self.model = self._build(source)
        self.model.eval()
        self._sampler = Sampler(config.seed, self.model.vocab_shard, exact=config.exact_logprobs)  # its RNG keys the fused sampler's unseeded rows
        self._runner: ModelRunner | None = None
        self._training = None
        self.stats: dict[str, float] = {}

    def _build(self, source) -> CausalLM:
        """Load the source into a ShardedBuffer and return the model over its generation view: under TP
        the local shapes with the TP collectives installed; for a critic under TP, a meta skeleton
        (a critic never generates). Alone, the full model is built on the target device; sharded,
        each rank builds it on the CPU and keeps only its shards."""
        cfg, tp = self.config, self.config.tp_generation
        self.hf_config = hf_config_dict(source)
        full = load_model(source, dtype=cfg.dtype, device=self.device if self.world_size == 1 else "cpu", seed=cfg.seed)
        params = {n: p.detach() for n, p in full.named_parameters()}  # load_ reads only the specs' names
        self.model_config = dataclasses.replace(full.config, value_head=True) if self.role == "critic" else full.config
        cfg.check_model(self.model_config)  # max_model_len within the model's positions
        if self.role == "critic":  # the backbone's weights plus a fresh value head
            gen = torch.Generator().manual_seed(cfg.seed + 1)
            params["score.weight"] = (torch.randn(1, full.config.hidden_size, generator=gen)
                                      * full.config.initializer_range).to(cfg.dtype)
        specs = CausalLM(self.model_config, dtype=cfg.dtype, device="meta").flat_buffer.layout.specs
        self.sharded = ShardedBuffer(specs, dtype=cfg.dtype, device=self.device, tp_size=tp, group=self.group,
                                     timeout=self._timeout)
        self.sharded.load_(params)
        buffer = self.sharded.flat_buffer
        self.vocab_size = self.model_config.vocab_size
        self.tp_all_reduce = None
        self._tp: generator.TPGroup | None = None
        del full, params
        if self.role == "critic":
            return CausalLM(self.model_config, buffer=buffer) if tp == 1 else CausalLM(self.model_config, device="meta")
        model = CausalLM(local_config(self.model_config, tp), buffer=buffer)
        if tp == 1:
            return model
        group = self.sharded.tp_group
        self._tp = generator.TPGroup(group, dist.get_global_rank(group, 0))
        self.tp_all_reduce = make_all_reduce(cfg.tp_all_reduce, group, capacity=max(cfg.max_num_seqs, 512)
                                             * self.model_config.hidden_size, dtype=cfg.dtype, device=self.device)
        return parallelize(model, vocab_size=self.vocab_size, tp_rank=self.sharded.tp_rank, tp_size=tp, group=group,
                           all_reduce=self.tp_all_reduce)

    # -- checkpoints and memory -----------------------------------------------------------------------

    def save(self, path) -> None:
        """Sharded state (weights, optimizer, step, RNG, config) to a folder, atomically; every rank calls it."""
        from hybridengine.sharding import checkpoint

        trainer = self._training
        optimizer = trainer.optimizer if trainer is not None and trainer.has_optimizer else None
        engine_config = {k: (checkpoint.dtype_name(v) if isinstance(v, torch.dtype) else v)
                         for k, v in dataclasses.asdict(self.config).items()}
        # save shares any rank's error with every rank and leaves the engine as it was: its errors are
        # every rank's (`consistent`), and the engine stays usable after a failed save.
        with self._guard.phase("save", lambda: checkpoint.checked_path(path, "HybridEngine.save")) as phase:
            phase.consistent(checkpoint.save, path, self.sharded, optimizer, engine_meta=dict(
                role=self.role, model_config=dataclasses.asdict(self.model_config), hf_config=self.hf_config,
                engine_config=engine_config), sampler_rng=self._sampler.rng)

    @classmethod
    def load(cls, path, config: EngineConfig | None = None) -> "HybridEngine":
        """An engine restored from `save`, at this process's world size (and `config`'s TP degree).
        Without `config`, the saved one: on its device type (a saved CUDA device becomes this
        process's GPU)."""
        from hybridengine.sharding import checkpoint

        meta = checkpoint.read_meta(path)
        if config is None:
            saved = dict(meta.engine_config)
            if torch.device(saved.get("device", "cuda")).type == "cuda":
                saved.pop("device", None)  # EngineConfig's default: this process's GPU, not the saver's
            config = EngineConfig(**saved)
        engine = cls(meta.model_config, config, role=meta.role)
        engine.hf_config = meta.hf_config
        with engine._guard.phase("load"):
            checkpoint.restore_(meta, engine.sharded, optimizer=lambda: engine._trainer().optimizer,
                                sampler_rng=engine._sampler.rng)
        return engine

    def export_hf(self, path) -> None:
        """config.json + model.safetensors for transformers' from_pretrained (rank 0 writes)."""
        from hybridengine.sharding import checkpoint

        def check():
            if self.role != "actor":
                raise ValueError("export_hf: only an actor (causal LM) exports to a transformers checkpoint")
            if self.hf_config is None:
                raise ValueError("export_hf: the engine was built from a ModelConfig, not a transformers config, "
                                 "model or checkpoint, so there is no config.json to write")

        with self._guard.phase("export_hf", check):
            checkpoint.export_hf(path, self.sharded, hf_config=self.hf_config, dtype=self.config.dtype)

    def memory_report(self) -> dict[str, float]:
        """GiB on this rank: parameters (G mapped), optimizer state, gradients, KV cache; torch and NVML totals."""
        gib = 2**30
        rep = dict(parameters_mapped=self.sharded.gen.mapped_bytes() / gib,
                   parameters_shard=self.sharded.layout.shard_numel * self.sharded.layout.element_size / gib)
        trainer = self._training
        tensors = trainer.optimizer.state_tensors() if trainer is not None and trainer.has_optimizer else []
        grads = trainer.held_gradients if trainer is not None else []
        rep["optimizer"] = sum(t.numel() * t.element_size() for t in tensors) / gib  # 0 before the first step
        rep["gradients"] = sum(g.numel() * g.element_size() for g in grads) / gib
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

    @property
    def trainer(self):
        """The `Trainer` of this engine: its optimizer and gradient shards (created on first use; not
        inside rollout())."""
        return self._trainer()

    def _trainer(self, cfg=None):
        from hybridengine.train.trainer import Trainer

        if self._runner is not None:
            raise RuntimeError("training calls (log_probs, ppo_step) are not allowed inside rollout()")
        if self._training is None:
            self._training = Trainer(self.sharded, self.model_config, optimizer_config=cfg,
                                     fused=self.config.fused_training and self.device.type == "cuda",
                                     split_master=self.config.split_master, keep_grads=self.config.keep_grads,
                                     exact=self.config.exact_logprobs)
        return self._training

    # Each training call is a collective phase: every rank validates its batch (and config) before any
    # collective and the ranks agree on the outcome, so a bad input raises on every rank at once.

    def log_probs(self, batch, *, temperature: float = 1.0, return_entropy: bool = False):
        """[B, max_len - 1] log-probs of batch's target tokens (fused over the LM head, no grad)."""
        check = functools.partial(self._trainer().check, "log_probs", batch, temperature=temperature)
        with self._guard.phase("log_probs", check):
            return self._trainer().log_probs(batch, temperature=temperature, return_entropy=return_entropy,
                                             checked=True)

    def values(self, batch) -> torch.Tensor:
        """Critic: [B, max_len - 1] values at the positions of batch's target tokens (no grad)."""
        with self._guard.phase("values", lambda: self._trainer().check("values", batch)):
            return self._trainer().values(batch, checked=True)

    def value_step(self, batch, config=None) -> dict:
        """Critic: one optimizer step with `value_loss` (batch.old_values, batch.returns, response_mask)."""
        from hybridengine.train.trainer import ValueConfig

        config = config if config is not None else ValueConfig()
        with self._guard.phase("value_step", lambda: self._trainer(config).check("value_step", batch, config)):
            return self._trainer(config).value_step(batch, config, checked=True)

    def ppo_step(self, batch, config=None) -> dict:
        """One PPO/GRPO optimizer step on this rank's batch: returns loss, metrics, grad_norm, lr, step_s,
        skipped (a NaN/inf gradient norm skips the update: `PPOConfig.nonfinite_grad`)."""
        from hybridengine.train.trainer import PPOConfig

        config = config if config is not None else PPOConfig()
        with self._guard.phase("ppo_step", lambda: self._trainer(config).check("ppo_step", batch, config)):
            return self._trainer(config).ppo_step(batch, config, checked=True)

    # -- rollout ------------------------------------------------------------------------------------

    def prepare_rollout(self) -> None:
        """Start mapping the next rollout's generation pages on a host thread (`ShardedBuffer.
        prepare_generation`): call it right after the last `ppo_step` before `rollout()`, so the page
        mapping overlaps that step's queued GPU work and the switch is only the all-gather. The pages
        hold model/tg of memory from then on. No-op off CUDA / without the VMM buffer."""
        if self.role == "critic":
            raise RuntimeError("prepare_rollout() needs an actor engine; this one is a critic")
        self.sharded.prepare_generation()

    def _check_rollout(self) -> None:
        if self.role == "critic":
            raise RuntimeError("rollout() needs an actor engine; this one is a critic")
        if self._runner is not None:
            raise RuntimeError("rollout() is already active")

    @contextlib.contextmanager
    def rollout(self):
        """Generation view + KV cache for the duration of the block; both released on exit. Entering is a
        collective phase (the switch's all-gathers); leaving is local."""
        self._guard.agree("rollout", self._check_rollout)
        try:
            with self._guard.work("rollout"):
                t0 = time.perf_counter()
                self.sharded.switch_to_generation()
                self.stats["switch_to_generation_s"] = time.perf_counter() - t0
                kv = allocate_kv_cache(self.config, self.model.config, self.device, rank=self.rank)
                t1 = time.perf_counter()
                self._runner = ModelRunner(self.model, kv, max_num_seqs=self.config.max_num_seqs,
                                           max_model_len=self.config.max_model_len,
                                           use_cuda_graphs=self.config.cuda_graphs,
                                           lazy_cuda_graphs=self.config.lazy_cuda_graphs,
                                           exact=self.config.exact_logprobs)
                self.stats.update(kv_cache_GiB=kv.nbytes() / 2**30, kv_blocks=kv.num_blocks,
                                  cuda_graph_capture_s=self._runner.graph_capture_s,
                                  runner_setup_s=time.perf_counter() - t1)
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
            # the cache and the graphs are freed by reference, and a full collection per switch is slow.
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
        if self.sharded.state == "generation":
            self.sharded.switch_to_training()

    def generate(self, prompts: list[list[int]], sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 *, use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate completions for token-id prompts inside `rollout()`: one RequestOutput per prompt, in
        prompt order, its samples in index order. `sampling_params`: one for all prompts or one per
        prompt. Under TP, every rank of a TP group generates its first rank's batch. Stats of the call
        go to `self.stats`."""
        if self._runner is None:
            raise ValueError("generate() must be called inside `with engine.rollout():`")
        prompts = generator.token_id_lists(prompts)  # a tensor of token ids: one prompt per row
        params = SamplingParams() if sampling_params is None else sampling_params
        if isinstance(params, SamplingParams):
            params = [params] * (len(prompts) if isinstance(prompts, (list, tuple)) else 1)
        elif isinstance(params, (list, tuple)):
            params = list(params)
        else:
            raise ValueError(f"sampling_params must be a SamplingParams or a list of them, got {type(params).__name__}")
        check = functools.partial(generator.check_requests, vocab_size=self.vocab_size, config=self.config,
                                  num_blocks=self._runner.kv.num_blocks)
        run = functools.partial(generator.generate, self._runner, self._sampler, config=self.config, tp=self._tp,
                                progress=use_tqdm and self.rank == 0)
        if self._tp is None:  # no collectives: this rank's batch alone
            check(prompts, params)
            outputs, stats = run(prompts, params)
        else:  # a collective phase of the TP group, which generates one batch: its first rank's
            with self._guard.work("generate") as phase:
                shared = [prompts, params]
                dist.broadcast_object_list(shared, src=self._tp.src, group=self._tp.group)
                prompts, params = shared
                phase.consistent(check, prompts, params)  # the same requests on every rank: the same verdict
                outputs, stats = run(prompts, params)
        self.stats.update(stats)
        return outputs
