"""verl's training engine on a HybridEngine: `HybridVerlEngine`, verl's backend "hybridengine".

verl's workers (`TrainingWorker`, `ActorRolloutRefWorker` with the new worker implementation) build a
`BaseEngine` through `EngineRegistry.new(model_type, backend=engine_config.strategy, model_config=...,
engine_config=..., optimizer_config=..., checkpoint_config=...)` and drive it with `train_batch` /
`infer_batch`. This class is that engine over one `HybridEngine`:

- `initialize`: the actor (a training engine) offers how to build its HybridEngine to `shared` and builds
  it at first use, so the rollout of the same worker, created after it, can still set the rollout's
  options (TP degree of generation, memory share, exact mode); a forward-only engine (the reference
  policy) builds its own frozen HybridEngine at once and shares nothing.
- `forward_backward_batch(forward_only=True)`: `engine.log_probs` (with entropy when asked), returned
  in verl's no-padding layout (nested `log_probs` / `entropy` over each whole sequence), micro-batch by
  micro-batch as verl plans them (`prepare_micro_batches`), through verl's loss when one is given.
- `forward_backward_batch(forward_only=False)` + `optimizer_step`: one `engine.train_step`. The engine
  runs forward, backward, clipping and AdamW as one collective step, so `forward_backward_batch` records
  its batch and loss and returns the output dict that `optimizer_step` fills (loss per micro-batch,
  verl's metrics) when it runs the step; `BaseEngine.train_batch` reads it after `optimizer_step`, as
  always. Several `forward_backward_batch` calls before one `optimizer_step` accumulate into that step.
  A caller that reads the outputs before the step (verl's Tinker worker, `return_model_output`) is
  refused with a NotImplementedError.
- verl's loss function runs unchanged as the step's loss hook: each engine micro-batch is one of verl's
  micro-batches (`PPOBatch.groups`), and the hook hands verl's loss the micro-batch's `TensorDict` and a
  `model_output` whose `log_probs` / `entropy` are the fused LM-head pass's, in verl's nested layout,
  differentiable. verl's losses are already normalised over the whole data-parallel batch
  (`batch_num_tokens`, `dp_size`, `global_batch_size`), so the step sums them (`loss_scale="sum"`), each
  divided by the world size: FSDP averages gradients over ranks, the engine's reduce-scatter sums.
- `lr_scheduler_step`: verl's own schedule (`lr_scheduler_type`, warm-up, cosine) on a stand-in
  optimizer, read by the step as its learning rate.
- `get_per_tensor_param`: `engine.state_dict()` (transformers names, one unit gathered at a time).
- `to`: nothing moves. The weights live in the shared buffer; with verl's `optimizer_offload` the
  engine's `EngineConfig.offload="rollout"` keeps the AdamW state in host memory during rollouts.
- `save_checkpoint` / `load_checkpoint`: `engine.save` / `HybridEngine.load` (sharded, checksummed) plus
  the scheduler's state.
"""

from __future__ import annotations

import dataclasses
import json
import os
from functools import partial

import torch
import torch.distributed as dist

try:
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.utils.torch_dtypes import PrecisionType
    from verl.utils.torch_functional import get_constant_schedule_with_warmup, get_cosine_schedule_with_warmup
    from verl.workers.engine.base import BaseEngine, BaseEngineCtx, EngineRegistry
    from verl.workers.engine.utils import postprocess_batch_func, prepare_micro_batches
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError("hybridengine.integrations.verl needs verl (the verl extra: pip install --no-build-isolation "
                      "-e '.[verl]', or make setup EXTRAS=dev,verl in a checkout)") from e

from hybridengine.config import EngineConfig
from hybridengine.engine import HybridEngine
from hybridengine.integrations.verl import shared
from hybridengine.train.batch import PPOBatch
from hybridengine.train.config import TrainConfig

__all__ = ["BACKEND", "HybridVerlEngine", "register_engine"]

_DEFAULT_MAX_MODEL_LEN = next(f.default for f in dataclasses.fields(EngineConfig) if f.name == "max_model_len")

BACKEND = "hybridengine"
"""The name verl selects the engine by: `actor_rollout_ref.actor.strategy=hybridengine`."""


class HybridVerlEngine(BaseEngine):
    """verl's `BaseEngine` over one `HybridEngine` (module docstring)."""

    def __init__(self, model_config, engine_config, optimizer_config, checkpoint_config):
        super().__init__()
        if getattr(model_config, "lora_rank", 0):
            raise ValueError(f"model_config.lora_rank={model_config.lora_rank}: the hybridengine backend trains "
                             f"full weights, not LoRA adapters")
        if getattr(model_config, "model_type", "language_model") != "language_model":
            raise ValueError(f"model_config.model_type={model_config.model_type!r}: the hybridengine backend is "
                             f"registered for 'language_model' (a critic is not supported)")
        sp = getattr(engine_config, "ulysses_sequence_parallel_size", 1)
        if sp != 1:
            raise ValueError(f"engine_config.ulysses_sequence_parallel_size={sp}: the hybridengine backend has no "
                             f"sequence parallelism (set it to 1)")
        self.model_config, self.engine_config = model_config, engine_config
        self.optimizer_config, self.checkpoint_config = optimizer_config, checkpoint_config
        self.forward_only = bool(getattr(engine_config, "forward_only", False))
        if not self.forward_only:
            self._check_optimizer(optimizer_config)
        self.mode = None
        self._own: HybridEngine | None = None  # a forward-only engine's; the actor's lives in `shared`
        self._restore_from: str | None = None  # a checkpoint to build from (load_checkpoint before first use)
        self._pending: list[tuple[TensorDict, object, dict]] = []  # forward_backward_batch calls awaiting a step
        self._scheduler = None

    # -- construction ---------------------------------------------------------------------------------

    @staticmethod
    def _check_optimizer(cfg) -> None:
        name = getattr(cfg, "optimizer", "AdamW")
        if str(name).lower() != "adamw" or getattr(cfg, "optimizer_impl", "torch.optim") != "torch.optim":
            raise ValueError(f"optimizer_config.optimizer={name!r} (optimizer_impl="
                             f"{getattr(cfg, 'optimizer_impl', None)!r}): the hybridengine backend's optimizer is "
                             f"its sharded AdamW (optimizer='AdamW', optimizer_impl='torch.optim')")
        if getattr(cfg, "clip_grad", None) is None:
            raise ValueError("optimizer_config.clip_grad must be set (verl's FSDP engine requires it too)")

    def engine_config_for(self, options: dict) -> EngineConfig:
        """The HybridEngine's `EngineConfig`: the dtype, seed and optimizer offload of verl's engine config,
        max_model_len within the model's positions, and `options` (the rollout's fields, `shared.configure`)
        over them."""
        ec = self.engine_config
        mixed = getattr(ec, "mixed_precision", None) or {}
        dtype = PrecisionType.to_dtype(mixed.get("param_dtype") or getattr(ec, "dtype", "bfloat16"))
        fields = dict(dtype=dtype, seed=int(getattr(ec, "seed", 0)),
                      offload="rollout" if getattr(ec, "optimizer_offload", False) and not self.forward_only
                      else "none")
        limit = getattr(getattr(self.model_config, "hf_config", None), "max_position_embeddings", None)
        if limit is not None:  # the rollout sets its own max_model_len; the default must fit the model
            fields["max_model_len"] = min(_DEFAULT_MAX_MODEL_LEN, int(limit))
        fields.update(options)
        return EngineConfig(**fields)

    def _build(self, options: dict) -> HybridEngine:
        config = self.engine_config_for(options)
        if self._restore_from is not None:
            return HybridEngine.load(self._restore_from, config)
        path = self.model_config.local_path or self.model_config.path
        return HybridEngine(path, config)

    def initialize(self):
        """The actor offers its engine to `shared` (built at first use); a forward-only engine builds its own."""
        if self.forward_only:
            if self._own is None:
                self._own = self._build({})
            return
        if self._scheduler is None:
            shared.offer(self._build, owner=f"verl backend {BACKEND!r} (actor)")
            self._scheduler = _lr_scheduler(self.optimizer_config)

    @property
    def engine(self) -> HybridEngine:
        """The HybridEngine (the actor's is built here at its first use)."""
        if self.forward_only:
            if self._own is None:
                raise RuntimeError("the engine is not initialized: call initialize() first")
            return self._own
        if self._scheduler is None:
            raise RuntimeError("the engine is not initialized: call initialize() first")
        return shared.get()

    # -- modes, offload, data parallelism -----------------------------------------------------------------

    @property
    def is_param_offload_enabled(self) -> bool:
        return False  # the weights never leave the shared buffer

    @property
    def is_optimizer_offload_enabled(self) -> bool:
        return False  # the engine moves its AdamW state itself (EngineConfig.offload): verl's context must not

    def train_mode(self, **kwargs):
        return _ModeCtx(self, "train", **kwargs)

    def eval_mode(self, **kwargs):
        return _ModeCtx(self, "eval", **kwargs)

    def to(self, device: str, model: bool = True, optimizer: bool = True, grad: bool = True):
        """Nothing moves: the weights stay in the shared buffer, and the optimizer state follows the engine's
        offload policy (`EngineConfig.offload`, set from verl's `optimizer_offload`)."""
        super().to(device, model=model, optimizer=optimizer, grad=grad)

    def get_data_parallel_rank(self):
        return dist.get_rank() if dist.is_initialized() else 0

    def get_data_parallel_size(self):
        return dist.get_world_size() if dist.is_initialized() else 1

    def get_data_parallel_group(self):
        return dist.group.WORLD if dist.is_initialized() else None

    def is_mp_src_rank_with_outputs(self):
        return True  # every rank is a data-parallel rank with its own outputs

    # -- forward / backward ---------------------------------------------------------------------------

    def forward_backward_batch(self, data: TensorDict, loss_function, forward_only=False):
        """forward_only: log-probs (and entropy when `calculate_entropy`) per verl micro-batch, verl's loss on
        them when given; returns verl's postprocessed output. Else: records the batch for the next
        `optimizer_step`, which runs the engine's step and fills the returned dict."""
        if not isinstance(data, TensorDict):
            raise ValueError(f"forward_backward_batch: data must be a TensorDict, got {type(data).__name__}")
        if not forward_only and tu.get_non_tensor_data(data=data, key="return_model_output", default=False):
            raise NotImplementedError("forward_backward_batch: the hybridengine backend runs forward, backward and "
                                      "the optimizer step as one engine step, so its outputs exist only after "
                                      "optimizer_step; a caller that reads them before (return_model_output, "
                                      "verl's Tinker worker) is not supported")
        if not forward_only and self.forward_only:
            raise RuntimeError("forward_backward_batch: this engine is forward-only (engine_config.forward_only)")
        if not forward_only and loss_function is None:
            raise ValueError("forward_backward_batch: training needs a loss_function")
        _check_layout(data)
        self._add_global_batch_info(data)
        micro, indices = prepare_micro_batches(data=data, dp_group=self.get_data_parallel_group(),
                                               same_micro_num_in_dp=True)
        if forward_only:
            return self._infer(data, micro, indices, loss_function)
        outputs = {"model_output": {}, "loss": [], "metrics": {}}
        self._pending.append((data, loss_function, dict(micro=micro, indices=indices, outputs=outputs)))
        return outputs

    def _add_global_batch_info(self, data: TensorDict) -> None:
        """What verl's losses normalise by, as verl's FSDP engine sets it: the batch's loss tokens over all
        data-parallel ranks and the data-parallel size."""
        tokens = data["loss_mask"].sum().reshape(1).to(torch.int64)
        if dist.is_initialized() and dist.get_world_size() > 1:
            if dist.get_backend() == "nccl":
                tokens = tokens.cuda()
            dist.all_reduce(tokens)
        tu.assign_non_tensor(data, sp_size=1, batch_num_tokens=int(tokens.item()),
                             dp_size=self.get_data_parallel_size())

    @torch.no_grad()
    def _infer(self, data, micro, indices, loss_function):
        batch, spans = _ppo_batch(micro, response_only=False)
        entropy = bool(tu.get_non_tensor_data(data=data, key="calculate_entropy", default=False))
        out = self.engine.log_probs(batch, temperature=_temperature(data), return_entropy=entropy)
        logp, ent = out if entropy else (out, None)
        output_lst = []
        for k, mb in enumerate(micro):
            rows = list(range(*spans[k]))
            model_output = {"log_probs": _nested(logp, rows, mb)}
            if ent is not None:
                model_output["entropy"] = _nested(ent, rows, mb)
            entry = {"model_output": model_output}
            if loss_function is not None:
                loss, metrics = loss_function(model_output=model_output, data=mb,
                                              dp_group=self.get_data_parallel_group())
                entry.update(loss=float(loss), metrics=metrics)
            output_lst.append(entry)
        return postprocess_batch_func(output_lst=output_lst, indices=indices, data=data)

    def optimizer_zero_grad(self):
        """Drop the batches recorded since the last step (verl's zero_grad: forget accumulated gradients)."""
        self._pending.clear()

    def optimizer_step(self):
        """One `engine.train_step` over every batch recorded by `forward_backward_batch` since the last step;
        fills their outputs (loss per micro-batch, verl's metrics) and returns the gradient norm before
        clipping, as verl's FSDP engine does."""
        if self.forward_only:
            raise RuntimeError("optimizer_step: this engine is forward-only (engine_config.forward_only)")
        if not self._pending:
            raise RuntimeError("optimizer_step: no forward_backward_batch since the last step (nothing to train)")
        pending, self._pending = self._pending, []
        micro = [(p, mb) for p, (_, _, rec) in enumerate(pending) for mb in rec["micro"]]
        batch, spans = _ppo_batch([mb for _, mb in micro], response_only=True)
        temperatures = {_temperature(data) for data, _, _ in pending}
        if len(temperatures) != 1:
            raise ValueError(f"optimizer_step: the recorded batches have different temperatures {sorted(temperatures)}")
        results: list = [None] * len(micro)
        calc = [bool(tu.get_non_tensor_data(data=mb, key="calculate_entropy", default=False)) for _, mb in micro]
        hook = partial(_verl_loss, micro=micro, spans=spans, losses=[fn for _, fn, _ in pending], calc=calc,
                       results=results, dp_group=self.get_data_parallel_group(),
                       world_size=self.get_data_parallel_size())
        stats = self.engine.train_step(batch, hook, self._train_config(temperatures.pop()))
        for p, (data, _, rec) in enumerate(pending):
            output_lst = [{"loss": results[k][0], "metrics": results[k][1]}
                          for k, (q, _) in enumerate(micro) if q == p]
            rec["outputs"].update(postprocess_batch_func(output_lst=output_lst, indices=rec["indices"], data=data))
        return float(stats["grad_norm"])

    def _train_config(self, temperature: float) -> TrainConfig:
        cfg = self.optimizer_config
        override = dict(getattr(cfg, "override_optimizer_config", None) or {})
        lr = self._scheduler.get_last_lr()[0]
        return TrainConfig(lr=lambda step: lr, betas=tuple(override.get("betas", cfg.betas)),
                           eps=float(override.get("eps", 1e-8)),
                           weight_decay=float(override.get("weight_decay", cfg.weight_decay)),
                           max_grad_norm=float(cfg.clip_grad), nonfinite_grad="warn", loss_scale="sum",
                           micro_batch_tokens=1,  # one verl micro-batch (a PPOBatch group) per engine micro-batch
                           temperature=temperature,
                           activation_checkpointing=bool(getattr(self.model_config, "enable_gradient_checkpointing",
                                                                 True)))

    def lr_scheduler_step(self):
        """Advance verl's schedule; returns the learning rate the next step uses."""
        self._scheduler.optimizer.step()  # the stand-in has no gradient: a no-op that keeps torch's order check
        self._scheduler.step()
        return self._scheduler.get_last_lr()[0]

    # -- weights and checkpoints ------------------------------------------------------------------------

    def get_per_tensor_param(self, **kwargs):
        """(name, full tensor) pairs in transformers naming, one unit all-gathered at a time, and no PEFT config.
        The iterator is lazy: nothing is gathered (nor agreed across ranks) until it is iterated, so verl's
        weight sync, whose rollout here loads nothing and never iterates it, costs nothing."""
        def weights():
            yield from self.engine.state_dict()

        return weights(), None

    def save_checkpoint(self, local_path: str, hdfs_path=None, global_step: int = 0, max_ckpt_to_keep=None,
                        **kwargs) -> None:
        """`engine.save` into `local_path`/engine and the LR schedule's state into `local_path`/scheduler.json.
        Older checkpoints are not removed (max_ckpt_to_keep is verl's checkpoint manager's business)."""
        if hdfs_path is not None:
            raise ValueError(f"save_checkpoint: hdfs_path={hdfs_path!r}: the hybridengine backend writes local "
                             f"checkpoints only")
        if not isinstance(local_path, (str, os.PathLike)) or not str(local_path):
            raise ValueError(f"save_checkpoint: local_path must be a non-empty path, got {local_path!r}")
        os.makedirs(local_path, exist_ok=True)
        self.engine.save(os.path.join(local_path, "engine"))
        if self.get_data_parallel_rank() == 0 and self._scheduler is not None:
            state = {"global_step": global_step, "scheduler": self._scheduler.state_dict()}
            with open(os.path.join(local_path, "scheduler.json"), "w") as f:
                json.dump(state, f)

    def load_checkpoint(self, local_path: str, hdfs_path=None, del_local_after_load: bool = True, **kwargs) -> None:
        """Restore a `save_checkpoint` folder. The actor's engine is built from it, so this must come before
        the engine's first use (verl's trainer loads right after building its workers)."""
        engine_path = os.path.join(local_path, "engine")
        if not os.path.isdir(engine_path):
            raise ValueError(f"load_checkpoint: {local_path!r} holds no hybridengine checkpoint (no engine/ folder)")
        if self.forward_only:
            self._own = HybridEngine.load(engine_path, self.engine_config_for({}))
        else:
            if shared.is_built():
                raise RuntimeError("load_checkpoint: the engine is already built and in use; load before its first "
                                   "use (verl's trainer loads right after building its workers)")
            self._restore_from = engine_path
            state_path = os.path.join(local_path, "scheduler.json")
            if os.path.exists(state_path):
                with open(state_path) as f:
                    self._scheduler.load_state_dict(json.load(f)["scheduler"])


class _ModeCtx(BaseEngineCtx):
    """verl's mode context: the mode flag only (nothing to load or offload); leaving train mode with
    `zero_grad_on_exit` (verl's default) or by an exception drops batches recorded and never stepped."""

    def __exit__(self, exc_type, exc_val, exc_tb):
        if self.mode == "train" and (self.zero_grad_on_exit or exc_type is not None):
            self.engine.optimizer_zero_grad()
        super().__exit__(exc_type, exc_val, exc_tb)


def _lr_scheduler(cfg):
    """verl's schedule (FSDPEngine._build_lr_scheduler's choices) over a one-parameter stand-in optimizer."""
    stand_in = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=cfg.lr)
    total = getattr(cfg, "total_training_steps", -1)
    warmup = getattr(cfg, "lr_warmup_steps", -1) or -1
    if warmup <= 0:
        warmup = int(getattr(cfg, "lr_warmup_steps_ratio", 0.0) * total)
    kind = getattr(cfg, "lr_scheduler_type", "constant")
    if kind == "constant":
        return get_constant_schedule_with_warmup(optimizer=stand_in, num_warmup_steps=warmup)
    if kind == "cosine":
        return get_cosine_schedule_with_warmup(optimizer=stand_in, num_warmup_steps=warmup, num_training_steps=total,
                                               min_lr_ratio=cfg.min_lr_ratio, num_cycles=cfg.num_cycles,
                                               zero_indexed_step=cfg.zero_indexed_step)
    raise ValueError(f"optimizer_config.lr_scheduler_type={kind!r}: expected 'constant' or 'cosine'")


def _check_layout(data: TensorDict) -> None:
    """verl's no-padding layout with plain positions: nested input_ids and position_ids, each sequence's
    positions 0..L-1 (the engine packs sequences and restarts positions itself)."""
    for key in ("input_ids", "position_ids", "loss_mask"):
        if key not in data.keys():
            raise ValueError(f"forward_backward_batch: data has no {key!r} (verl's no-padding layout: "
                             f"left_right_2_no_padding)")
    ids, pos = data["input_ids"], data["position_ids"]
    if not (ids.is_nested and pos.is_nested):
        raise ValueError("forward_backward_batch: data['input_ids'] and data['position_ids'] must be nested "
                         "(jagged) tensors, verl's no-padding layout")
    if pos.dim() != 2:
        raise ValueError(f"forward_backward_batch: data['position_ids'] has {pos.dim()} dimensions (mRoPE); the "
                         f"hybridengine backend takes text models with 1-D positions")
    lengths = ids.offsets().diff()
    expected = torch.cat([torch.arange(int(n)) for n in lengths]) if len(lengths) else torch.zeros(0)
    if not torch.equal(pos.values().cpu().long(), expected.long()):
        raise ValueError("forward_backward_batch: data['position_ids'] must be 0..L-1 within each sequence (no "
                         "left padding inside a sequence); the engine computes positions itself")
    if (lengths < 2).any():
        raise ValueError(f"forward_backward_batch: every sequence needs at least 2 tokens, got lengths "
                         f"{lengths.tolist()}")


def _temperature(data: TensorDict) -> float:
    """The batch's sampling temperature: one number (the engine's step takes one)."""
    t = tu.get(data, "temperature", default=1.0)
    if isinstance(t, torch.Tensor):
        values = t.flatten().unique()
        if values.numel() != 1:
            raise ValueError(f"data['temperature'] holds {values.numel()} different values; the hybridengine "
                             f"backend takes one temperature per batch")
        t = float(values)
    return float(t)


def _response_lengths(mb: TensorDict) -> list[int] | None:
    """Response tokens per sequence (verl's no_padding_2_padding's reading), or None without responses."""
    if "responses" not in mb.keys():
        return None
    responses = mb["responses"]
    if responses.is_nested:
        return responses.offsets().diff().tolist()
    width = mb["prompts"].shape[1]
    return mb["attention_mask"][:, width:].sum(dim=1).tolist()


def _ppo_batch(micro: list[TensorDict], *, response_only: bool) -> tuple[PPOBatch, list[tuple[int, int]]]:
    """One PPOBatch of the micro-batches' sequences in order, each micro-batch a group; and each micro-batch's
    rows (start, end). response_only: the loss mask covers the response targets (the LM head skips the
    prompt); else every target token."""
    ids, masks, groups, spans = [], [], [], []
    for k, mb in enumerate(micro):
        seqs = list(mb["input_ids"].unbind())
        resp = _response_lengths(mb) if response_only else None
        start = len(ids)
        for b, seq in enumerate(seqs):
            n = seq.numel()
            mask = torch.ones(n - 1)
            if resp is not None:
                mask[:max(n - 1 - int(resp[b]), 0)] = 0
            ids.append(seq.cpu().long())
            masks.append(mask)
            groups.append(k)
        spans.append((start, len(ids)))
    return PPOBatch(input_ids=ids, response_mask=masks, groups=groups), spans


def _nested(per_target: torch.Tensor, rows: list[int], mb: TensorDict) -> torch.Tensor:
    """[B, T] per-target values of `rows` -> verl's nested [b, L_b] over each whole sequence: position t holds
    the value of target t + 1 (verl's rolled labels); the last position, which has no target, holds 0."""
    offsets = mb["input_ids"].offsets()
    lengths = offsets.diff().tolist()
    parts = []
    for i, n in zip(rows, lengths):
        parts += [per_target[i, :n - 1], per_target.new_zeros(1)]
    return torch.nested.nested_tensor_from_jagged(torch.cat(parts), offsets.to(per_target.device))


def _verl_loss(logp, entropy, fields, *, micro, spans, losses, calc, results, dp_group, world_size):
    """The step's loss hook: verl's loss function on the engine micro-batch, which is one verl micro-batch."""
    seq = fields["seq_index"][:, 0].tolist()
    k = next(j for j, (s, e) in enumerate(spans) if s <= seq[0] < e)
    assert seq == list(range(*spans[k])), "an engine micro-batch is one verl micro-batch (PPOBatch.groups)"
    p, mb = micro[k]
    rows = list(range(len(seq)))
    model_output = {"log_probs": _nested(logp, rows, mb)}
    if calc[k]:
        model_output["entropy"] = _nested(entropy, rows, mb)
    loss, metrics = losses[p](model_output=model_output, data=mb, dp_group=dp_group)
    results[k] = (float(loss.detach()), metrics)
    return loss / world_size  # FSDP averages gradients over ranks; the engine's reduce-scatter sums them


def register_engine() -> None:
    """Register `HybridVerlEngine` in verl's EngineRegistry as backend "hybridengine" for language models, on
    CUDA and CPU devices (idempotent)."""
    registered = EngineRegistry._engines.get("language_model", {}).get(BACKEND, {})
    devices = [d for d in ("cuda", "cpu") if d not in registered]
    if devices:
        EngineRegistry.register(model_type="language_model", backend=BACKEND, device=devices)(HybridVerlEngine)

