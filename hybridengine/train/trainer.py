"""Training on the shared buffer: ZeRO-3-style forward/backward, log-probs and the PPO step.

The training view of the parameters never exists as a whole. Forward runs unit by unit: gather the
unit's shards from all ranks (`ShardedBuffer.gather_unit`, prefetching the next one), run it, drop it
(`GatheredModel`, train/gathered_model.py). With activation checkpointing (the default) forward keeps
only each layer's input; backward walks the layers in reverse, gathers the layer again, recomputes it
with autograd, backpropagates, packs the parameter gradients to slice-major order and reduce-scatters
them (fp32) into this rank's gradient shard (`GradShards`, train/gradients.py). Without, forward keeps
each layer's autograd graph over parameters it lets go of (`ReleasedParams`), and backward only gathers
them again. The loss is the fused `ppo_loss` over the LM head, so the [tokens, vocab] logits never
exist. The optimizer (`FlatAdamW`) updates fp32 master shards and writes the new bf16 weights straight
into the shard inside the generation buffer: the next rollout sees them with no sync.

Sequences are packed (no padding token is computed): flat token ids with positions restarting at 0
per sequence, attention per sequence (`PackedAttention`).

Data parallelism: each rank passes its own batch; its loss is aggregated over its own tokens or
sequences (`loss_agg`), and gradients are averaged over ranks.
"""

from __future__ import annotations

import math
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hybridengine import checks
from hybridengine.model.config import ModelConfig
from hybridengine.model.family import layer_prefix
from hybridengine.ops.masked_logprobs import masked_logprobs
from hybridengine.ops.ppo_loss import ppo_loss
from hybridengine.ops.token_logprobs import token_logprobs
from hybridengine.ops.value_loss import value_loss
from hybridengine.sharding.switch import ShardedBuffer
from hybridengine.train.batch import PPOBatch, plan_micro_batches
from hybridengine.train.config import PPOConfig, TrainConfig, ValueConfig
from hybridengine.train.gathered_model import GatheredModel
from hybridengine.train.gradients import GradShards, add_embedding_grad_
from hybridengine.train.losses import LossFields, LossFnError
from hybridengine.train.optimizer import FlatAdamW, mask_ranges
from hybridengine.train.router_loss import LoadBalance
from hybridengine.train.packed_attention import PackedAttention, _varlen_api  # noqa: F401 - hybridengine_bench.prefill_attention imports it from here

# the batch and configs are re-exported here
__all__ = ["PPOBatch", "PPOConfig", "TrainConfig", "Trainer", "ValueConfig"]


class Trainer:
    """Forward/backward and the optimizer of one rank, over a ShardedBuffer."""

    def __init__(self, sharded: ShardedBuffer, config: ModelConfig, *, optimizer_config: PPOConfig | None = None,
                 fused: bool = False, split_master: bool = False, keep_grads: bool = False, exact: bool = False,
                 offload: str = "none", offload_host_limit_bytes: int | None = None):
        # EngineConfig.exact_logprobs: linear_exact, exact_attention and the exact LM-head pass, the rollout's bits
        self.exact = exact
        self.split_master = split_master  # EngineTuning.split_master: bf16 weights + int16 low halves
        self.keep_grads = keep_grads  # EngineConfig.keep_grads: the grad shards outlive the optimizer step
        # EngineConfig.offload / offload_host_limit_gib: where FlatAdamW keeps its state (train/offload.py)
        self.offload, self.offload_host_limit_bytes = offload, offload_host_limit_bytes
        self.sharded, self.config = sharded, config
        self.layout = sharded.layout
        self.device = sharded.device
        self.model = GatheredModel(sharded, config, fused=fused, exact=exact)  # run on gathered units
        self.critic = config.value_head
        # Per unit shard: the ranges that take weight decay, and where the replicated copies sit (few
        # elements: norms and biases), for the grad norm. No per-element mask stays on the device.
        self._decay, replicated_index = self._masks()
        # Validated before it is kept: a rejected config must not stay behind to fail every later call.
        if optimizer_config is not None:
            if not isinstance(optimizer_config, (TrainConfig, ValueConfig)):
                raise ValueError(f"optimizer_config must be a TrainConfig, PPOConfig or ValueConfig, got "
                                 f"{type(optimizer_config).__name__}")
            optimizer_config.validate()
        self._opt_config = optimizer_config or PPOConfig()
        self.num_skipped_steps = 0  # optimizer steps skipped for a NaN/inf gradient norm (nonfinite_grad)
        self.num_retired_steps = 0  # updates made by optimizers that reset_optimizer dropped (`policy_version`)
        # AdamW state (12 B/param with fp32 master weights) appears at the first optimizer step: an engine
        # that only scores (a reference model's log_probs) never holds it. Gradient shards (4 B/param) live
        # through a step's backward and optimizer step (unless keep_grads; train/gradients.py).
        self._grad_shards = GradShards(sharded, replicated_index)
        self._optimizer: FlatAdamW | None = None

    @property
    def fused(self) -> bool:
        """EngineTuning.fused_training: the layers' norms, RoPE and SiLU * up as Triton kernels (settable)."""
        return self.model.fused

    @fused.setter
    def fused(self, value: bool) -> None:
        self.model.fused = value

    @property
    def grads(self) -> list[torch.Tensor]:
        """fp32 gradient shard per unit: the last step's with keep_grads, else (or after a failed step) zeros
        outside a step."""
        return self._grad_shards.all()

    @property
    def optimizer(self) -> FlatAdamW:
        """The FlatAdamW over this rank's shards (allocated on first use)."""
        if self._optimizer is None:
            c = self._opt_config
            master = "split" if self.split_master else None  # EngineConfig checked the dtype
            self._optimizer = FlatAdamW(self.sharded.shard_views(), self._decay, lr=c.lr, betas=c.betas, eps=c.eps,
                                        weight_decay=c.weight_decay, master_weights=master, offload=self.offload,
                                        host_limit_bytes=self.offload_host_limit_bytes, rank=self.sharded.rank)
        return self._optimizer

    def reset_optimizer(self, *, split_master: bool | None = None) -> None:
        """Drop the AdamW state: the next step starts a fresh one over the current weights, with
        `split_master` (bf16 weights + int16 low halves, or fp32 masters) when given. Its step count (the
        LR schedule's, the bias correction's) starts again at 0; `policy_version` goes on."""
        if split_master is not None:
            self.split_master = split_master
        if self._optimizer is not None:
            self.num_retired_steps += self._optimizer.num_steps
        self._optimizer = None

    @property
    def policy_version(self) -> int:
        """Optimizer updates the weights have had, across `reset_optimizer`: it never repeats."""
        return self.num_retired_steps + (self._optimizer.num_steps if self._optimizer is not None else 0)

    @property
    def has_optimizer(self) -> bool:
        """Whether the AdamW state exists (it appears at the first optimizer step or `optimizer` access)."""
        return self._optimizer is not None

    @property
    def held_gradients(self) -> list[torch.Tensor]:
        """The gradient shards this rank holds now (none between steps unless keep_grads); read-only use."""
        return self._grad_shards.held()

    # -- masks over the flat shards ------------------------------------------------------------------

    def _masks(self) -> tuple[list[list[tuple[int, int]]], list[torch.Tensor]]:
        """Per unit shard: the (start, end) ranges where weight decay applies (matrices, not norms/biases),
        and the indices of copies of replicated parameters (the norm counts them once: each of the tg
        slices holds one). Built on the host: a per-element mask on the device would cost a byte per
        parameter for the trainer's lifetime."""
        decay, replicated = [], []
        for unit in self.layout.units:
            d = torch.zeros(unit.numel, dtype=torch.bool)
            r = torch.zeros(unit.numel, dtype=torch.bool)
            specs = {s.name: s for s in unit.params}
            for piece in unit.pieces:
                s = specs[piece.name]
                d[piece.offset:piece.offset + piece.slot_numel] = len(s.shape) >= 2
                r[piece.offset:piece.offset + piece.slot_numel] = s.role == "replicated"
            start, end = unit.shard_range(self.sharded.rank)
            decay.append(mask_ranges(d[start:end]))
            replicated.append(r[start:end].nonzero().squeeze(1).to(self.device))
        return decay, replicated

    @staticmethod
    def _unpack(packed: torch.Tensor, cu: list[int]) -> torch.Tensor:
        """Packed [N, ...] per-token rows -> [B, max_len - 1, ...]: each sequence without its last token."""
        B, width = len(cu) - 1, max(e - s for s, e in zip(cu[:-1], cu[1:])) - 1
        out = packed.new_zeros(B, width, *packed.shape[1:])
        for b, (s, e) in enumerate(zip(cu[:-1], cu[1:])):
            out[b, :e - s - 1] = packed[s:e - 1]
        return out

    def _targets(self, batch: PPOBatch, rows: list[int], width: int) -> torch.Tensor:
        out = torch.zeros(len(rows), width, dtype=torch.long)
        for i, b in enumerate(rows):
            out[i, :len(batch.input_ids[b]) - 1] = batch.input_ids[b][1:]
        return out.to(self.device)

    def _check_batch(self, op: str, batch, fields: tuple[str, ...] = ()) -> None:
        """batch is a valid PPOBatch (`PPOBatch.validate`: token ids in the vocabulary, every float field
        finite) which has `fields` and no sequence longer than the model's positions; checked before the
        call's first collective."""
        if not isinstance(batch, PPOBatch):
            raise ValueError(f"{op}: batch must be a PPOBatch, got {type(batch).__name__}")
        missing = [name for name in fields if getattr(batch, name) is None]
        if missing:
            names = [f"batch.{name}" for name in fields]
            raise ValueError(f"{op} needs {', '.join(names[:-1])} and {names[-1]} (missing: {', '.join(missing)})")
        batch.validate(self.config.vocab_size, op=op)
        # RoPE is computed for any position, but the model has none past max_position_embeddings: its
        # outputs there are not the model's. (EngineConfig.max_model_len bounds the rollout, at most this.)
        limit = self.config.max_position_embeddings
        for b, n in enumerate(batch.lengths):
            if n > limit:
                raise ValueError(f"{op}: batch.input_ids[{b}] has {n} tokens, more than the model's "
                                 f"max_position_embeddings={limit} (its rotary positions end there)")

    # -- public ---------------------------------------------------------------------------------------

    def check(self, op: str, batch, cfg=None, *, temperature: float = 1.0, loss_fn=None) -> None:
        """Everything call `op` ('log_probs', 'values', 'ppo_step', 'train_step', 'value_step') validates before its
        first collective: the engine's role, the config, the batch (`PPOBatch.validate`). Each call
        runs it first; `HybridEngine` runs it on every rank before the call and agrees on the outcome."""
        if op == "log_probs":
            if self.critic:
                raise ValueError("log_probs() needs an actor engine; this one is a critic (use values)")
            checks.number(op, "temperature", temperature, low=0, low_open=True)
            self._check_batch(op, batch)
        elif op == "values":
            if not self.critic:
                raise ValueError("values() needs a critic engine (HybridEngine(..., role='critic'))")
            self._check_batch(op, batch)
        elif op == "ppo_step":
            if self.critic:
                raise ValueError("ppo_step is for the actor; this engine is a critic (use value_step)")
            if not isinstance(cfg, PPOConfig):
                raise ValueError(f"ppo_step: config must be a PPOConfig, got {type(cfg).__name__}")
            cfg.validate()  # again: a config may have been changed since its construction
            self._check_batch(op, batch, ("response_mask", "old_logprobs", "advantages"))
            cfg.check_batch(batch)  # ref_logprobs for a KL term, rollout_logprobs for a rollout correction
        elif op == "train_step":
            if self.critic:
                raise ValueError("train_step is for the actor; this engine is a critic (use value_step)")
            if not isinstance(cfg, TrainConfig):
                raise ValueError(f"train_step: config must be a TrainConfig (or PPOConfig), got {type(cfg).__name__}")
            if not callable(loss_fn):
                raise ValueError(f"train_step: loss_fn must be a callable (logp, entropy, fields) -> scalar, got "
                                 f"{type(loss_fn).__name__}")
            cfg.validate()
            self._check_batch(op, batch)
        elif op == "value_step":
            if not self.critic:
                raise ValueError("value_step needs a critic engine (HybridEngine(..., role='critic'))")
            if not isinstance(cfg, ValueConfig):
                raise ValueError(f"value_step: config must be a ValueConfig, got {type(cfg).__name__}")
            cfg.validate()
            self._check_batch(op, batch, ("response_mask", "old_values", "returns"))
        else:
            raise ValueError(f"op must be 'log_probs', 'values', 'ppo_step', 'train_step' or 'value_step', got {op!r}")

    def _scoring_passes(self, batch: PPOBatch, micro_batch_tokens: int):
        """Per micro-batch of a no-grad forward: (rows, final-normed hidden [tokens, H], head weight,
        cu_seqlens). An empty micro-batch (this rank ran out while others did not) still runs its
        gathers and collectives and yields nothing."""
        for rows in plan_micro_batches(batch.lengths, micro_batch_tokens, self.sharded.group):
            ids, cos, sin, attn, cu, _ = self.model.pack_inputs(batch, rows)
            x, _ = self.model.forward_layers(ids, cos, sin, attn, keep_inputs=False)
            norm_w, head_w = self.model.head_weights()
            if rows:
                yield rows, self.model.norm(norm_w, x), head_w, cu

    @torch.no_grad()
    def log_probs(self, batch: PPOBatch, *, temperature: float = 1.0, micro_batch_tokens: int = 16384,
                  return_entropy: bool = False, checked: bool = False):
        """[B, max_len - 1] log-probs of the target tokens (zero past each sequence); entropy optional.
        `checked`: the caller ran `check` on these arguments (as HybridEngine does), so it is not run again."""
        if not checked:
            self.check("log_probs", batch, temperature=temperature)
        width = max(batch.lengths) - 1
        logp = torch.zeros(len(batch.input_ids), width, dtype=torch.float32, device=self.device)
        ent = torch.zeros_like(logp) if return_entropy else None
        for rows, normed, head_w, cu in self._scoring_passes(batch, micro_batch_tokens):
            hidden = self._unpack(normed, cu)
            targets = self._targets(batch, rows, hidden.shape[1])
            out = token_logprobs(hidden, head_w, targets, temperature=temperature, return_entropy=return_entropy,
                                 exact=self.exact)
            lp, e = out if return_entropy else (out, None)
            for i, b in enumerate(rows):
                n = len(batch.input_ids[b]) - 1
                logp[b, :n] = lp[i, :n].float()
                if ent is not None:
                    ent[b, :n] = e[i, :n].float()
        return (logp, ent) if return_entropy else logp

    def ppo_step(self, batch: PPOBatch, cfg: PPOConfig, *, checked: bool = False) -> dict:
        """One optimizer step of the policy on this rank's batch; returns loss, metrics, grad_norm, lr, step,
        skipped (1 when a NaN/inf gradient norm skipped the update), skipped_steps, timings. `checked`: as
        in `log_probs`."""
        if not checked:
            self.check("ppo_step", batch, cfg)

        def head_loss(h, head_w, rows, cu):
            hidden = self._unpack(h, cu)
            width = hidden.shape[1]
            f = self._fields(batch, rows, width, ("old_logprobs", "advantages", "response_mask", "ref_logprobs",
                                                  "rollout_logprobs"))
            targets = self._targets(batch, rows, width) if rows else \
                torch.zeros(1, width, dtype=torch.long, device=self.device)
            return ppo_loss(hidden, head_w, targets, f["old_logprobs"], f["advantages"], f["response_mask"],
                            ref_logprobs=f["ref_logprobs"], rollout_logprobs=f["rollout_logprobs"], exact=self.exact,
                            **cfg.loss_kwargs())

        return self._step(batch, cfg, head_loss)

    def train_step(self, batch: PPOBatch, loss_fn, cfg: TrainConfig, *, checked: bool = False) -> dict:
        """One optimizer step of the policy with `loss_fn(logp, entropy, fields) -> scalar` (or (scalar,
        metrics)) on this rank's batch, through `masked_logprobs` (the fused LM-head pass): the same
        micro-batching, loss weighting (`TrainConfig.loss_scale`), data-parallel reduction, clipping and
        optimizer as `ppo_step`, whose fused `ppo_loss` takes the place of the two. `hybridengine.train.
        losses` describes `fields`. A loss that raises or returns a non-scalar or non-finite value raises
        `LossFnError` on every rank before the optimizer step. `checked`: as in `log_probs`."""
        if not checked:
            self.check("train_step", batch, cfg, loss_fn=loss_fn)
        counts = self._loss_counts(batch)

        def head_loss(h, head_w, rows, cu):
            hidden = self._unpack(h, cu)
            fields = self._loss_fields(batch, rows, hidden.shape[1], counts)
            logp, entropy = masked_logprobs(hidden, head_w, fields["targets"], fields["mask"],
                                            temperature=cfg.temperature, exact=self.exact)
            return self._call_loss(loss_fn, logp, entropy, fields, bool(rows))

        return self._step(batch, cfg, head_loss, counts=counts, op="train_step")

    def _loss_counts(self, batch: PPOBatch) -> dict[str, int]:
        """Response tokens and live sequences of this rank's batch and of all ranks (one all-reduce)."""
        tokens = self._token_counts(batch)
        mine = [int(sum(tokens)), sum(c > 0 for c in tokens)]
        total = torch.tensor(mine, dtype=torch.int64)
        if not self.sharded.local and self.sharded.world_size > 1:
            total = total.to(self.device)
            dist.all_reduce(total, group=self.sharded.group)
        total = total.tolist()
        return dict(num_tokens=mine[0], num_sequences=mine[1], global_tokens=total[0], global_sequences=total[1])

    @staticmethod
    def _token_counts(batch: PPOBatch) -> list[float]:
        """Response tokens per sequence (every target token without a response_mask)."""
        if batch.response_mask is None:
            return [float(n - 1) for n in batch.lengths]
        return [float(m.sum()) for m in batch.response_mask]

    def _loss_fields(self, batch: PPOBatch, rows: list[int], width: int, counts: dict[str, int]) -> LossFields:
        """What a loss function gets beside logp and entropy (see `hybridengine.train.losses`)."""
        names = [n for n in ("response_mask", "old_logprobs", "advantages", "ref_logprobs", "rollout_logprobs",
                             "old_values", "returns") if getattr(batch, n) is not None]
        fields = LossFields(self._fields(batch, rows, width, names))
        for name, values in (batch.extra or {}).items():
            fields[name] = (batch.padded(name, rows, width, self.device) if rows else
                            torch.zeros(1, width, dtype=values[0].dtype, device=self.device))
        n = torch.tensor([len(batch.input_ids[b]) - 1 for b in rows] or [0])
        valid = (torch.arange(width)[None, :] < n[:, None]).to(self.device)
        fields["valid"] = valid
        fields["mask"] = fields["response_mask"] != 0 if "response_mask" in fields else valid
        fields["targets"] = (self._targets(batch, rows, width) if rows else
                             torch.zeros(1, width, dtype=torch.long, device=self.device))
        fields["seq_index"] = torch.tensor(rows or [-1], device=self.device)[:, None].expand(-1, width)
        fields.update(counts)
        return fields

    def _call_loss(self, loss_fn, logp, entropy, fields, live: bool):
        """(loss, metrics) of loss_fn, checked (a scalar float tensor, finite) and agreed over the ranks: a
        failure on any rank raises LossFnError on every rank (one flag all-reduce and host read per
        micro-batch). The dummy row of an empty micro-batch skips the loss (a zero with the graph)."""
        error, loss, metrics = None, None, {}
        try:
            if not live:  # still agrees below: the peers' micro-batch runs the same collectives
                out = (logp * 0).sum() + (entropy * 0).sum()
            else:
                out = loss_fn(logp, entropy, fields)
            loss, metrics = out if isinstance(out, tuple) and len(out) == 2 else (out, {})
            if not isinstance(loss, torch.Tensor) or loss.dim() != 0 or not loss.is_floating_point():
                raise LossFnError(f"train_step: loss_fn must return a 0-dim float tensor (or (loss, metrics)), got "
                                  f"{_describe_loss(out)}")
            if not loss.requires_grad:
                raise LossFnError("train_step: loss_fn returned a loss that does not depend on logp or entropy "
                                  "(no gradient): nothing to train")
            if not isinstance(metrics, dict):
                raise LossFnError(f"train_step: loss_fn's metrics must be a dict of scalars, got "
                                  f"{type(metrics).__name__}")
            metrics = {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in metrics.items()}
            for k, v in metrics.items():
                if not isinstance(v, (int, float)) and not (isinstance(v, torch.Tensor) and v.numel() == 1):
                    raise LossFnError(f"train_step: loss_fn's metric {k!r} must be a scalar, got {_describe_loss(v)}")
        except LossFnError as e:
            error = e
        except Exception as e:  # noqa: BLE001 - any failure of the user's function is reported alike
            error = LossFnError(f"train_step: loss_fn raised {type(e).__name__}: {e}")
            error.__cause__ = e
        status = (torch.ones((), device=self.device) if error is not None
                  else (~torch.isfinite(loss.detach())).to(torch.float32) * 2)
        if not self.sharded.local and self.sharded.world_size > 1:
            status = status.reshape(1).to(self.device)
            dist.all_reduce(status, op=dist.ReduceOp.MAX, group=self.sharded.group)
        failed = float(status.max())
        if error is not None:
            raise error
        if failed == 2 and not torch.isfinite(loss.detach()):
            raise LossFnError(f"train_step: loss_fn returned a non-finite loss ({float(loss.detach())}) on rank "
                              f"{self.sharded.rank}; nothing was updated")
        if failed:
            raise LossFnError("train_step: loss_fn failed on another rank (its error names the cause); nothing was "
                              "updated")
        return loss, metrics

    def value_step(self, batch: PPOBatch, cfg: ValueConfig, *, checked: bool = False) -> dict:
        """One optimizer step of the critic (`value_loss`) on this rank's batch. `checked`: as in `log_probs`."""
        if not checked:
            self.check("value_step", batch, cfg)

        def head_loss(h, head_w, rows, cu):
            values = self._unpack(F.linear(h, head_w).squeeze(-1), cu)
            f = self._fields(batch, rows, values.shape[1], ("old_values", "returns", "response_mask"))
            loss = value_loss(values, f["old_values"], f["returns"], f["response_mask"], clip=cfg.clip,
                              loss_agg=cfg.loss_agg)
            mask = f["response_mask"]
            vpred = (values.float() * mask).sum() / mask.sum().clamp(min=1)
            return loss, {"vf_loss": loss.detach(), "vpred_mean": vpred.detach()}

        return self._step(batch, cfg, head_loss)

    def _fields(self, batch: PPOBatch, rows: list[int], width: int, names) -> dict:
        """Padded [B, width] fields; the dummy row of an empty micro-batch is all zeros (fully masked)."""
        out = {}
        for name in names:
            if getattr(batch, name) is None:
                out[name] = None
            elif rows:
                out[name] = batch.padded(name, rows, width, self.device)
            else:
                out[name] = torch.zeros(1, width, device=self.device)
        return out

    def _step(self, batch: PPOBatch, cfg, head_loss, *, counts: dict | None = None, op: str | None = None) -> dict:
        t0 = time.perf_counter()
        self.sharded.clear_prefetch()
        self._grad_shards.finish()  # one left in flight by a step that raised: its shard is rewritten below
        # The last rollout's generation pages go back to the driver on a host thread (switch_to_training);
        # the step's allocations must not race that release for memory. Usually long done by now.
        self.sharded.wait_released()
        self._grad_shards.begin()  # no zeroing pass: each unit's first reduce-scatter writes its shard
        groups = plan_micro_batches(batch.lengths, cfg.micro_batch_tokens, self.sharded.group, batch.groups)
        share, scale = self._loss_weights(batch, groups, cfg, counts)
        totals: dict[str, float] = {}
        try:
            for rows, w, c in zip(groups, share, scale):
                stats = self._micro_step(batch, rows, c, head_loss, cfg.activation_checkpointing)
                for k, v in stats.items():
                    totals[k] = totals.get(k, 0.0) + w * v
            self._grad_shards.zero_unreduced()
            grad_norm = self._clip_and_step(cfg)
        except BaseException as err:
            self._grad_shards.drop(wait=isinstance(err, LossFnError))
            raise
        if not self.keep_grads:
            self._grad_shards.release()
        opt = self._optimizer
        step = opt.num_steps if opt is not None else 0
        skipped = not math.isfinite(grad_norm)
        if skipped:
            self.num_skipped_steps += 1
            lr = cfg.lr(step + 1) if callable(cfg.lr) else cfg.lr  # what the skipped step would have used
        else:
            lr = opt.lr_at(step)
        totals.update(grad_norm=grad_norm, lr=lr, step=step, skipped=int(skipped),
                      skipped_steps=self.num_skipped_steps, micro_batches=len(groups), step_s=time.perf_counter() - t0)
        if skipped and cfg.nonfinite_grad != "skip":
            op = op or ("ppo_step" if isinstance(cfg, PPOConfig) else "value_step")
            message = (f"{op}: the gradient norm is {grad_norm}; the update was skipped (weights and optimizer "
                       f"state unchanged, {self.num_skipped_steps} step(s) skipped so far)")
            if cfg.nonfinite_grad == "raise":
                raise FloatingPointError(message)
            warnings.warn(message, RuntimeWarning, stacklevel=3)
        return totals

    def _loss_weights(self, batch: PPOBatch, groups: list[list[int]], cfg, counts: dict | None
                      ) -> tuple[list[float], list[float]]:
        """Per micro-batch: its share of the rank's loss (the stats' weights) and the coefficient of its loss
        in the backward (`TrainConfig.loss_scale`; ValueConfig: by loss_agg)."""
        mode = cfg.resolved_loss_scale() if isinstance(cfg, TrainConfig) else \
            "tokens" if cfg.loss_agg == "token-mean" else "sequences"
        mask_counts = self._token_counts(batch)
        live = [c > 0 for c in mask_counts]
        if mode in ("tokens", "global-tokens"):
            share = [sum(mask_counts[b] for b in rows) / max(sum(mask_counts), 1.0) for rows in groups]
        else:
            share = [sum(live[b] for b in rows) / max(sum(live), 1) for rows in groups]
        if mode == "sum":
            return [1.0] * len(groups), [1.0] * len(groups)
        if mode in ("global-tokens", "global-sequences"):
            counts = counts or self._loss_counts(batch)
            if mode == "global-tokens":
                total = max(counts["global_tokens"], 1)
                return share, [sum(mask_counts[b] for b in rows) / total for rows in groups]
            total = max(counts["global_sequences"], 1)
            return share, [sum(live[b] for b in rows) / total for rows in groups]
        # Data parallel: the global loss is the mean of the ranks' losses.
        return share, [w / self.sharded.world_size for w in share]

    def _micro_step(self, batch: PPOBatch, rows: list[int], weight: float, head_loss, recompute: bool) -> dict:
        model = self.model
        ids, cos, sin, attn, cu, id_index = model.pack_inputs(batch, rows, embedding_rows=True)
        graphs = None
        if recompute:
            with torch.no_grad():
                x_last, inputs = model.forward_layers(ids, cos, sin, attn, keep_inputs=True)
        else:
            x_last, graphs = model.forward_layers_with_graphs(ids, cos, sin, attn)
        # MoE: the load-balancing loss of this micro-batch (its value now, each layer's gradient in that layer's
        # backward); an empty micro-batch (a dummy sequence) adds none.
        coef = self.config.router_aux_loss_coef
        balance = LoadBalance(attn.routing, self.config.num_experts) if coef and attn.routing and rows else None
        # Head: recompute with autograd from the final residual stream.
        head_u, embed_u = model.units["head"], model.units["embed"]
        natural_head = self.sharded.gather_unit(head_u)
        norm_name, embed_name = model.family.norm_name, model.family.embed_name
        norm_w = self.layout.natural_view(natural_head, norm_name).detach().requires_grad_(True)
        head_src = self.sharded.gather_unit(embed_u) if model.tied else natural_head
        head_w = self.layout.natural_view(head_src, model.head_name).detach().requires_grad_(True)
        x = x_last.detach().requires_grad_(True)
        loss, metrics = head_loss(model.norm(norm_w, x), head_w, rows, cu)
        (loss * weight).backward()  # weight: the micro-batch's coefficient in the step's loss (`_loss_weights`)
        grad_x = x.grad
        # The head's gradients are reduced after the layers' backward, not now: now every layer's
        # activations are alive, and the reduce's fp32 unit buffers (2 x V x H x 4 bytes with the
        # shard: 3.3 GB for 7B) would stack on them; held, the bf16 gradient costs V x H x 2.
        head_grads = {norm_name: norm_w.grad}
        tied_head_grad = head_w.grad if model.tied else None  # goes out with the embedding's rows
        if not model.tied:
            head_grads[model.head_name] = head_w.grad
        del head_w
        # Layers in reverse: gather again, recompute with autograd, backpropagate, reduce-scatter.
        for i in reversed(range(self.config.num_hidden_layers)):
            u = model.units[f"layers.{i}"]
            if i > 0:
                self.sharded.prefetch_unit(u - 1)
            natural = self.sharded.gather_unit(u, own_experts=True)
            if graphs is None:
                xi = inputs[i].detach().requires_grad_(True)
                with torch.enable_grad():
                    out, params = model.layer(i, natural, xi, cos, sin, attn, grad=True)
                inputs[i] = None
            else:
                xi, out, slots = graphs[i]
                slots.attach(natural)
                params = slots.params
                graphs[i] = None
            if balance is not None and i in attn.routing:
                aux = balance.layer_term(attn.routing[i][0]) * (coef * weight)
                torch.autograd.backward([out, aux], [grad_x, None])
            else:
                out.backward(grad_x)
            grad_x = xi.grad
            prefix = layer_prefix(i)
            self._reduce(u, {prefix + k: p.grad for k, p in params.items()})
        self._reduce(head_u, head_grads)
        del head_grads
        # Embedding: the input gradient rows summed per token id, straight into the unit's natural fp32
        # gradient (tied: on top of the LM head's share, one reduce-scatter for both).
        natural = self._grad_shards.natural(embed_u)
        embed_grad = self.layout.natural_view(natural, embed_name)
        if tied_head_grad is not None:
            embed_grad.copy_(tied_head_grad)
            del tied_head_grad
        add_embedding_grad_(embed_grad, *id_index, grad_x)
        self._reduce(embed_u, natural=natural)
        self._grad_shards.finish()
        stats = {"loss": float(loss.detach()), **{k: float(v) for k, v in metrics.items()}}
        if balance is not None:  # the loss transformers reports: the head's loss + coef * aux
            stats["loss"] += coef * balance.value
            stats["aux_loss"] = balance.value
        return stats

    @torch.no_grad()
    def values(self, batch: PPOBatch, *, micro_batch_tokens: int = 16384, checked: bool = False) -> torch.Tensor:
        """Critic: [B, max_len - 1] values at the positions of the target tokens (zero past each sequence).
        `checked`: as in `log_probs`."""
        if not checked:
            self.check("values", batch)
        width = max(batch.lengths) - 1
        out = torch.zeros(len(batch.input_ids), width, dtype=torch.float32, device=self.device)
        for rows, normed, head_w, cu in self._scoring_passes(batch, micro_batch_tokens):
            v = self._unpack(F.linear(normed, head_w).squeeze(-1), cu)
            for i, b in enumerate(rows):
                n = len(batch.input_ids[b]) - 1
                out[b, :n] = v[i, :n].float()
        return out

    def _reduce(self, u: int, grads: dict[str, torch.Tensor] | None = None,
                natural: torch.Tensor | None = None) -> None:
        """Unit u's natural-layout fp32 gradients (by name, or a filled `GradShards.natural` buffer) into this
        rank's grad shard, by an asynchronous reduce-scatter (`GradShards.reduce`)."""
        self._grad_shards.reduce(u, grads, natural)

    def _clip_and_step(self, cfg: PPOConfig | ValueConfig) -> float:
        """The global gradient norm; when it is finite, the clipped AdamW step (none otherwise)."""
        norm = self._grad_shards.norm()
        if not math.isfinite(norm):  # the same on every rank (the norm is all-reduced): no rank updates
            return norm
        scale = 1.0
        if cfg.max_grad_norm is not None and norm > cfg.max_grad_norm:
            scale = cfg.max_grad_norm / (norm + 1e-6)  # torch.nn.utils.clip_grad_norm_'s coefficient
        opt = self.optimizer  # the step's config sets the hyper-parameters (a schedule stays a callable)
        opt.lr, opt.betas, opt.eps, opt.weight_decay = cfg.lr, tuple(cfg.betas), cfg.eps, cfg.weight_decay
        opt.step(self.grads, grad_scale=scale)
        return norm


def _describe_loss(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"a {x.dtype} tensor of shape {list(x.shape)}"
    if isinstance(x, tuple):
        return f"a tuple of {len(x)}: ({', '.join(_describe_loss(v) for v in x)})"
    return f"{type(x).__name__} {x!r}"[:200]
