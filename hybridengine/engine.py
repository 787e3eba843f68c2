"""HybridEngine: rollout and training on one shared, sharded parameter buffer.

Alone (no process group, or a group of one) the engine owns one unsharded model. Under torchrun
it shards the parameters over the default process group (`ShardedBuffer`). `rollout()` switches
to the generation view, allocates the paged KV cache inside the memory budget (with the optimizer
state's offload: `OffloadPolicy`), and on exit frees the cache and switches back. In between,
requests run through the `RolloutLoop` (rollout/loop.py: vLLM's request API, `generate_async`,
`generate`, and under TP generation the driver/follower protocol). The training calls (`log_probs`,
`ppo_step`, ...) run the `Trainer` over the training view of the same buffer. This is the only module
that knows both halves.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import gc
import os
import time

import torch
import torch.distributed as dist

from hybridengine.config import EngineConfig
from hybridengine.faults import CollectiveError, PhaseGuard
from hybridengine.model.decoder import CausalLM
from hybridengine.model.loading import hf_config_dict, load_model
from hybridengine.model.tensor_parallel import local_config, make_all_reduce, parallelize
from hybridengine.rollout.kv_cache import allocate_kv_cache, cuda_budget
from hybridengine.rollout.outputs import CompletionOutput, RequestOutput
from hybridengine.rollout.loop import RolloutLoop
from hybridengine.rollout.requests import RolloutSession
from hybridengine.rollout.runner import ModelRunner
from hybridengine.rollout.sampler import Sampler
from hybridengine.rollout.sampling_params import SamplingParams
from hybridengine.rollout.tp_group import TPGroup
from hybridengine.sharding.switch import ShardedBuffer
from hybridengine.train import expert_parallel
from hybridengine.train.offload_policy import OffloadPolicy

ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"


def _empty_device_cache(device: torch.device) -> None:
    """Give the caching allocator's idle blocks back to the driver (CUDA; nothing to do elsewhere)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


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
        expandable = config.tuning.expandable_segments
        if device.type == "cuda" and (expandable or (expandable is None and not os.environ.get(ALLOC_CONF))):
            torch.cuda.memory._set_allocator_settings("expandable_segments:True")  # see the config field
        # The engine's own process group: its collectives time out after collective_timeout_s, so that a
        # rank that fails inside a phase and stays alive cannot hold its peers for the default 30 minutes.
        self._timeout = datetime.timedelta(seconds=config.collective_timeout_s)
        self.group = dist.new_group(timeout=self._timeout) if self.world_size > 1 else None
        self._guard = PhaseGuard(self.group, config.collective_timeout_s)
        self.model = self._build(source)
        self.model.eval()
        if config.return_routed_experts and not self.model.config.num_experts:
            raise ValueError(f"EngineConfig.return_routed_experts=True needs a mixture-of-experts model, got "
                             f"model_type {self.model.config.model_type!r} with num_experts=0")
        # Its RNG keys the fused sampler's unseeded rows.
        self._sampler = Sampler(config.seed, self.model.vocab_shard, exact=config.exact_logprobs)
        self._runner: ModelRunner | None = None
        self._kv = None  # the open rollout's KVCache (released at its exit)
        self._training = None
        self.stats: dict[str, float] = {"prefix_cache_hit_tokens": 0}
        self._loop = RolloutLoop(config, self._guard, self._tp, vocab_size=self.vocab_size, rank=self.rank,
                                 stats=self.stats)  # the requests of the rollouts, and the TP protocol
        # EngineConfig.offload: when the optimizer state leaves the device for a rollout and comes back
        self._offload = OffloadPolicy(config, device, trainer=lambda: self._training, stats=self.stats,
                                      tp_generation=self._tp is not None,
                                      kv_budget=functools.partial(cuda_budget, config, self.model.config, device))

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
        self._tp: TPGroup | None = None
        del full, params
        if self.role == "critic":
            return CausalLM(self.model_config, buffer=buffer) if tp == 1 else CausalLM(self.model_config, device="meta")
        model = CausalLM(local_config(self.model_config, tp), buffer=buffer)
        if tp == 1:
            return model
        group = self.sharded.tp_group
        self._tp = TPGroup.of(group, self.sharded.group, self._timeout)
        self.tp_all_reduce = make_all_reduce(cfg.tuning.tp_all_reduce, group, capacity=max(cfg.max_num_seqs, 512)
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
                engine_config=engine_config, policy_version=self.policy_version), sampler_rng=self._sampler.rng)

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
            config = EngineConfig.from_dict(saved)
        engine = cls(meta.model_config, config, role=meta.role)
        engine.hf_config = meta.hf_config
        with engine._guard.phase("load"):
            checkpoint.restore_(meta, engine.sharded, optimizer=lambda: engine._trainer().optimizer,
                                sampler_rng=engine._sampler.rng)
            if meta.policy_version > meta.step:  # updates of optimizers dropped by reset_optimizer before the save
                engine._trainer().num_retired_steps = meta.policy_version - meta.step
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

    # -- weights in and out, in transformers naming (docs/weights.md) ---------------------------------

    def state_dict(self, *, rank0_only: bool = False, device: torch.device | str | None = None):
        """An iterator of (name, tensor): every weight in transformers naming and order, each its own
        full tensor (`device`, default the engine's), all-gathered one unit (layer, embedding, head) at a
        time. With tied embeddings `lm_head.weight` follows `model.embed_tokens.weight` as the same
        tensor (as transformers' state_dict has both). Every rank iterates it to the end, in step (the
        gathers are collective); every rank gets every tensor, or with `rank0_only` rank 0 alone (the
        others gather and yield nothing). Not inside rollout(). The call agrees on its arguments on
        every rank; the gathers run as the iterator advances."""
        def check():
            if self._runner is not None:
                raise RuntimeError("state_dict() is not allowed inside rollout(): it gathers the training view")
            if not isinstance(rank0_only, bool):
                raise ValueError(f"state_dict: rank0_only must be a bool, got {rank0_only!r}")
            if device is not None and not isinstance(device, (str, torch.device)):
                raise ValueError(f"state_dict: device must be None, a str or a torch.device, got {device!r}")
            if device is not None:
                try:
                    torch.device(device)
                except RuntimeError as e:
                    raise ValueError(f"state_dict: device {device!r} is not a device: {e}") from None

        self._guard.agree("state_dict", check)
        return self._state_dict(rank0_only, device)

    def _state_dict(self, rank0_only: bool, device):
        from hybridengine.sharding import weights

        order = {name: i for i, (name, _) in enumerate(self.model.named_parameters())}
        keep = not rank0_only or self.rank == 0
        tied = self.role == "actor" and self.model_config.tie_word_embeddings
        tied_head, embed = weights.tied_names(self.model_config.model_type)
        for u, names in enumerate(weights.unit_names(self.sharded.layout, order)):
            with self._guard.work("state_dict"):
                items = weights.unit_tensors(self.sharded, u, names, device=device, keep=keep)
            for name, tensor in items:
                yield name, tensor
                if tied and name == embed:
                    yield tied_head, tensor

    def load_weights(self, weights, *, strict: bool = True) -> list[str]:
        """Write named tensors (transformers naming, full shapes; a mapping or an iterable of pairs, which
        is materialised: every tensor is held until the call returns) into the shared buffer: this rank's
        training shards and, inside rollout(), its generation view too. Every rank calls it with the same
        tensors. Everything is checked before anything is written: a name that is not a parameter
        (`strict=False`: skipped), a shape other than the parameter's, a non-floating dtype or a name given
        twice raises ValueError on every rank, the engine unchanged. A subset is fine: the others keep
        their values. The optimizer's master weights of the written parameters become the new values
        (its moments and step count stay); inside rollout() the prefix cache is reset. Returns the names
        of the parameters written, in the buffer's order (a tied `lm_head.weight` writes the embedding)."""
        from hybridengine.sharding import weights as hf_weights

        writes: list = []

        def check():
            if not isinstance(strict, bool):
                raise ValueError(f"load_weights: strict must be a bool, got {strict!r}")
            writes[:] = hf_weights.check_weights(
                weights, self.sharded.layout, tied=self.role == "actor" and self.model_config.tie_word_embeddings,
                model_type=self.model_config.model_type, dtype=self.config.dtype, strict=strict,
                config=self.model_config)

        with self._guard.phase("load_weights", check) as phase:
            phase.consistent(hf_weights.check_same_writes, writes, self.group)
            masks = hf_weights.write_weights_(self.sharded, writes, generation=self.sharded.state == "generation")
            trainer = self._training
            if trainer is not None and trainer.has_optimizer:
                hf_weights.refresh_masters_(trainer.optimizer, masks)
            if self._session is not None:  # cached KV was computed with the old weights
                self._session.sched.blocks.reset_prefix_cache()
        return [name for name, _ in writes]

    def memory_report(self) -> dict[str, float]:
        """GiB on this rank: parameters (G mapped), optimizer state, gradients, KV cache; torch and NVML totals;
        host memory: `host_optimizer` (optimizer state in host memory now), `host_pinned_total` (the host
        allocation the offload holds, pinned on CUDA; EngineConfig.offload). Inside rollout(): `kv_cache` (the
        cache's memory now) and `kv_cache_capacity` (what it can grow to: with offload 'rollout' the cache
        grows into the optimizer state's memory when it is full; `OffloadPolicy.grow`)."""
        gib = 2**30
        rep = dict(parameters_mapped=self.sharded.gen.mapped_bytes() / gib,
                   parameters_shard=self.sharded.layout.shard_numel * self.sharded.layout.element_size / gib)
        rep.update(self._offload.report())  # optimizer (on the device), host_optimizer, host_pinned_total
        trainer = self._training
        grads = trainer.held_gradients if trainer is not None else []
        rep["gradients"] = sum(g.numel() * g.element_size() for g in grads) / gib
        kv = self._runner.kv if self._runner is not None else None
        rep["kv_cache"] = kv.nbytes() / gib if kv is not None else 0.0  # the memory it holds now
        rep["kv_cache_capacity"] = kv.capacity_bytes() / gib if kv is not None else 0.0  # what it can grow to
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
            limit = self.config.offload_host_limit_gib
            self._training = Trainer(self.sharded, self.model_config, optimizer_config=cfg,
                                     fused=self.config.tuning.fused_training and self.device.type == "cuda",
                                     split_master=self.config.tuning.split_master, keep_grads=self.config.keep_grads,
                                     exact=self.config.exact_logprobs, offload=self.config.offload,
                                     offload_host_limit_bytes=None if limit is None else int(limit * 2**30))
            if self.config.tuning.expert_parallel_training:  # the experts run on their owners (EP group = TP group)
                expert_parallel.enable(self._training, self.sharded)
        self._offload.bring_back(stepping=cfg is not None)
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

    def train_step(self, batch, loss_fn, config=None) -> dict:
        """One optimizer step with a custom token-level loss: `loss_fn(logp, entropy, fields) -> scalar` (or
        `(scalar, metrics)`) in plain torch on the per-token log-probs and entropies of each micro-batch,
        which the fused LM-head pass computes without the [tokens, vocab] logits and differentiates
        through (`hybridengine.train.losses` describes `fields` and ships PPO clip, GSPO, CISPO, SFT and
        DPO). config: a `TrainConfig` (or `PPOConfig`): micro-batching, `loss_scale` (how micro-batch
        losses are weighted across micro-batches and ranks), clipping, AdamW, temperature. Returns the
        stats of `ppo_step` (loss, the loss's metrics, grad_norm, lr, step, skipped, ...). A loss that
        fails or returns a non-scalar or non-finite value raises `LossFnError` on every rank before any
        update; the engine stays usable."""
        from hybridengine.train.losses import LossFnError
        from hybridengine.train.trainer import TrainConfig

        config = config if config is not None else TrainConfig()
        with self._guard.phase("train_step", lambda: self._trainer(config).check("train_step", batch, config,
                                                                                 loss_fn=loss_fn)) as phase:
            try:
                return self._trainer(config).train_step(batch, loss_fn, config, checked=True)
            except LossFnError:
                phase.consistent_error = True  # agreed in the step: every rank raises it, nothing is out of step
                raise

    # -- rollout ------------------------------------------------------------------------------------

    def prepare_rollout(self) -> None:
        """Start mapping the next rollout's generation pages on a host thread (`ShardedBuffer.
        prepare_generation`): call it right after the last `ppo_step` before `rollout()`, so the page
        mapping overlaps that step's queued GPU work and the switch is only the all-gather. The pages
        hold model/tg of memory from then on. With `offload="rollout"` and a KV cache that cannot grow
        (`OffloadPolicy.cache_grows`: off CUDA, without VMM, under TP generation) the optimizer state's copy
        to host memory starts here too (`OffloadPolicy.start`); a growing cache starts it at rollout() entry,
        after the switch. No-op off CUDA / without the VMM buffer (the offload aside)."""
        if self.role == "critic":
            raise RuntimeError("prepare_rollout() needs an actor engine; this one is a critic")
        self.sharded.prepare_generation()
        self._offload.start(early=True)

    def _check_rollout(self) -> None:
        if self.role == "critic":
            raise RuntimeError("rollout() needs an actor engine; this one is a critic")
        if self._runner is not None:
            raise RuntimeError("rollout() is already active")
        # Before any collective: a host that cannot hold the optimizer state (or a failed copy) raises on
        # every rank with the state still on the device. The copies run on a side stream during the switch
        # and rollout() joins them before it sizes the KV cache; a cache that grows starts them later
        # (rollout() entry) and takes their memory when they are done.
        self._offload.start()

    @property
    def policy_version(self) -> int:
        """Optimizer updates the weights have had (a skipped step is none; `reset_optimizer` restarts the
        optimizer's step count, not this; restored by `load`): each generated token records the version
        that sampled it (`CompletionOutput.policy_versions`)."""
        trainer = self._training
        return trainer.policy_version if trainer is not None else 0

    @contextlib.contextmanager
    def rollout(self, keep_unfinished: bool = False):
        """Generation view + KV cache for the duration of the block; both released on exit. Entering is a
        collective phase (the switch's all-gathers). Requests kept by the last rollout re-enter first.

        On a normal exit, unfinished requests are aborted, or with `keep_unfinished` kept (tokens,
        log-probs and policy versions so far; their KV is recomputed under the next rollout's weights);
        under TP the driver's choice holds for its group. On an exit by an exception every request is
        aborted and no rank waits for another.

        While the block runs, the objects that existed at its entry are frozen out of Python's garbage
        collector (`gc.freeze`), and exit thaws the whole permanent generation (`gc.unfreeze`): each step()
        makes O(requests) output objects, and the full collections they trigger would otherwise walk the
        whole trainer's heap (the model, the optimizer, the data) on the decode path. Python cannot thaw a
        part of the frozen set, so objects frozen before entry (by the caller, or by a library at import)
        are thawed too; a caller who wants them frozen past the block calls `gc.freeze()` after it. The
        collector is the process's: another engine's rollout that ends inside this one thaws the heap early
        (this costs time, not correctness)."""
        self._guard.agree("rollout", self._check_rollout)
        ok = False
        gc.freeze()
        try:
            with self._guard.work("rollout"):
                t0 = time.perf_counter()
                self.sharded.switch_to_generation()
                self.stats["switch_to_generation_s"] = time.perf_counter() - t0
                # offload 'rollout': the cache waits for the optimizer state's copy out, or grows into it
                kv, grow = self._offload.kv_cache(functools.partial(
                    allocate_kv_cache, self.config, self.model.config, self.device, rank=self.rank))
                self._kv = kv
                t1 = time.perf_counter()
                self._runner = ModelRunner(self.model, kv, max_num_seqs=self.config.max_num_seqs,
                                           max_model_len=self.config.max_model_len,
                                           use_cuda_graphs=self.config.cuda_graphs,
                                           lazy_cuda_graphs=self.config.tuning.lazy_cuda_graphs,
                                           exact=self.config.exact_logprobs,
                                           routed_experts=self.config.return_routed_experts)
                self.stats.update(kv_cache_GiB=kv.capacity_bytes() / 2**30, kv_blocks=kv.capacity,
                                  kv_blocks_at_entry=kv.num_blocks,
                                  cuda_graph_capture_s=self._runner.graph_capture_s,
                                  runner_setup_s=time.perf_counter() - t1)
            self._loop.open(self._runner, self._sampler, policy_version=self.policy_version, grow=grow)
            yield self
            ok = True
        finally:
            # Drop this frame's references too: empty_cache below must see the cache freed.
            runner, self._runner, kv = self._runner, None, None
            try:
                self._loop.close(keep_unfinished, ok)
            finally:
                try:
                    if runner is not None:
                        runner.close()
                finally:
                    del runner  # the runner holds the cache
                    gc.unfreeze()
                    self._leave_rollout()

    def _leave_rollout(self) -> None:
        """The end of every rollout, also after an error: free the cache, back to the training view."""
        # The KV cache and the CUDA graphs' pool go back to the driver once nothing is in flight (the
        # next switch maps generation pages outside torch's allocator). No gc.collect here: the cache
        # and the graphs are freed by reference, and a full collection per switch is slow.
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        kv, self._kv = self._kv, None
        if kv is not None:
            kv.release()  # a VMM cache's memory, now that nothing in flight touches it
        del kv  # the last reference: the allocator must see the cache's blocks free when it empties
        _empty_device_cache(self.device)
        self._offload.cancel()  # a copy out whose memory the cache never took: the state stays on the device
        if self.sharded.state == "generation":
            self.sharded.switch_to_training()

    # -- requests (the rollout loop's; under TP the driver's: rollout/loop.py) ---------------------------

    @property
    def _session(self) -> RolloutSession | None:
        """The open rollout's requests (None outside rollout())."""
        return self._loop.session

    def add_request(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams) -> None:
        """Add a request to the open rollout; `step()` runs it with the others (continuous batching).
        request_id: a str, unique among the live requests. Raises ValueError, changing nothing, for a
        bad or duplicate id, prompt or sampling_params."""
        self._loop.add_request(request_id, prompt_token_ids, sampling_params)

    def step(self) -> list[RequestOutput]:
        """One model step of every live request (a new request's prefill, or a decode); returns the
        outputs of the requests added with add_request that progressed since the last step() (as their
        `SamplingParams.output_kind` says: cumulative tokens, the new ones, or only the final output;
        `finished` once every sample has finished, reported once). With async scheduling a step's tokens
        are read during the next one, so a step may report nothing."""
        return self._loop.step()

    def abort(self, request_id: str) -> None:
        """Drop a live request and free its blocks now; its generate_async task gets its output so far
        (finish_reason 'abort' for the unfinished samples). An id that finished (or was aborted) in this
        rollout is a no-op, so stragglers can be aborted without racing their finish; an unknown id
        raises ValueError."""
        self._loop.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        """Inside rollout(): a request is live, or step() has progress of one left to report (so a loop
        of step() while this holds sees every request finish); on a TP follower: the driver has not left
        its rollout() block. Outside: requests are kept for the next rollout."""
        return self._loop.has_unfinished_requests()

    async def generate_async(self, prompt_token_ids: list[int],
                             sampling_params: SamplingParams | None = None) -> RequestOutput:
        """One request, awaited: many asyncio tasks call it at once and one stepping task (started on
        demand, ended when no task waits) batches their requests, which run between its steps. Returns
        the finished RequestOutput (request_id 'async-<n>'). Cancelling the task aborts the request; a
        request kept across rollouts resumes in the next one."""
        return await self._loop.generate_async(prompt_token_ids, sampling_params)

    def generate(self, prompts: list[list[int]], sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 *, use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate completions for token-id prompts inside `rollout()`: one RequestOutput per prompt, in
        prompt order, its samples in index order. `sampling_params`: one for all prompts or one per
        prompt. Under TP, every rank of a TP group generates its first rank's batch (a follower may also
        be in its step() loop then). Requests of the request API progress alongside. Stats of the call go
        to `self.stats`."""
        return self._loop.generate(prompts, sampling_params, use_tqdm=use_tqdm)
