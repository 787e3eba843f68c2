"""The configs of one optimizer step: `TrainConfig` (a custom loss), `PPOConfig` (the policy's built-in loss:
a `TrainConfig` with the loss options of `ops.policy_loss.LossOptions`) and `ValueConfig` (the critic)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from hybridengine import checks
from hybridengine.ops.policy_loss import LOSS_AGGS, LOSS_FIELDS, LossOptions

LOSS_SCALES = ("auto", "tokens", "sequences", "global-tokens", "global-sequences", "sum")
"""How a step weights the loss of each micro-batch (`TrainConfig.loss_scale`)."""
NONFINITE_GRAD = ("skip", "warn", "raise")
"""What a step does when its gradient norm is NaN or inf (`_StepConfig.nonfinite_grad`)."""


@dataclass(kw_only=True, slots=True)
class _StepConfig:
    """What every optimizer step takes: micro-batching, clipping and AdamW."""

    loss_agg: str = "token-mean"
    """How the per-token losses of a rank's batch are aggregated (one of `LOSS_AGGS`; `PPOConfig`'s loss
    option of the same name is this field)."""
    micro_batch_tokens: int = 16384
    """Most tokens in one forward/backward (gradients accumulate over micro-batches)."""
    max_grad_norm: float | None = 1.0
    """Global gradient-norm clipping (> 0); None: off."""
    nonfinite_grad: str = "warn"
    """A step whose global gradient norm is NaN or inf never updates: weights and optimizer state (step
    count included) stay as they were; its stats say `skipped=1` and `skipped_steps` counts such steps
    over the trainer's life. 'skip': only that; 'warn': also a RuntimeWarning; 'raise': also a
    FloatingPointError after the skip. The norm is all-reduced first, so every rank decides the same."""
    lr: float | Callable[[int], float] = 1e-6
    """A float > 0, or a schedule: step (from 1) -> learning rate (checked when the step uses it)."""
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW's moment decays, each in [0, 1)."""
    eps: float = 1e-8
    """AdamW's denominator term, > 0."""
    activation_checkpointing: bool = True
    """True: forward keeps only each layer's input and backward recomputes the layer (least memory).
    False: forward keeps every layer's autograd activations and backward only gathers the parameters
    again (no recompute: one layer forward less per layer, activations of all layers held)."""

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first bad field. Runs on construction, and again where a step
        takes the config (the dataclass is mutable)."""
        self._check_step(type(self).__name__)

    def _check_step(self, op: str) -> None:
        checks.one_of(op, "loss_agg", self.loss_agg, LOSS_AGGS)
        checks.number(op, "micro_batch_tokens", self.micro_batch_tokens, low=1, integer=True)
        if self.max_grad_norm is not None:
            checks.number(op, "max_grad_norm", self.max_grad_norm, low=0, low_open=True)
        checks.one_of(op, "nonfinite_grad", self.nonfinite_grad, NONFINITE_GRAD)
        if not callable(self.lr):
            checks.number(op, "lr", self.lr, low=0, low_open=True)
        checks.number(op, "weight_decay", self.weight_decay, low=0)
        if not (isinstance(self.betas, (tuple, list)) and len(self.betas) == 2):
            raise ValueError(f"{op}: betas must be a pair of numbers in [0, 1), got {self.betas!r}")
        for b in self.betas:
            checks.number(op, "betas", b, low=0, high=1, high_open=True)
        checks.number(op, "eps", self.eps, low=0, low_open=True)
        if not isinstance(self.activation_checkpointing, bool):
            raise ValueError(f"{op}: activation_checkpointing must be a bool, got {self.activation_checkpointing!r}")


@dataclass(kw_only=True, slots=True)
class TrainConfig(_StepConfig):
    """One optimizer step with a loss of the caller's (`HybridEngine.train_step`); `PPOConfig` extends it.

    Normalisation: the loss function sees one micro-batch at a time and returns a scalar L_k; the step
    backpropagates sum_k c_k * L_k over the micro-batches k of every rank, with c_k set by `loss_scale`:

    - "tokens": c_k = (response tokens of k) / (response tokens of the rank's batch) / world_size. For a
      loss that is a token mean over its micro-batch, the rank's loss is the token mean over the rank's
      batch, and ranks are averaged (as `ppo_step` with loss_agg "token-mean").
    - "sequences": the same with the sequences that have at least one response token (a loss that is a
      mean over sequences: `ppo_step` with the seq-mean loss_aggs, GSPO, DPO over pairs).
    - "global-tokens" / "global-sequences": c_k = (tokens or sequences of k) / (those of all ranks): the
      token (sequence) mean over the whole data-parallel batch, whatever the split across ranks (one
      all-reduce of two counts per step).
    - "sum": c_k = 1: the step's loss is the plain sum of the losses returned; the loss normalises itself
      (with `fields["global_tokens"]` and the like).
    - "auto" (default): "tokens" when loss_agg is "token-mean", else "sequences": what `ppo_step` does.

    Gradients of the step are then d(sum_k c_k L_k) / d(weights): the all-reduce over ranks sums.
    """

    temperature: float = 1.0
    """The sampling temperature of the rollout: log-probs are those of logits / temperature."""
    loss_scale: str = "auto"
    """How the micro-batch losses are weighted (one of `LOSS_SCALES`; see the class docstring)."""

    def validate(self) -> None:
        self._check_train("TrainConfig")

    def _check_train(self, op: str) -> None:
        self._check_step(op)
        checks.number(op, "temperature", self.temperature, low=0, low_open=True)
        checks.one_of(op, "loss_scale", self.loss_scale, LOSS_SCALES)

    def resolved_loss_scale(self) -> str:
        """`loss_scale` with "auto" resolved by loss_agg."""
        if self.loss_scale != "auto":
            return self.loss_scale
        return "tokens" if self.loss_agg == "token-mean" else "sequences"


@dataclass(kw_only=True, slots=True)
class PPOConfig(TrainConfig, LossOptions):
    """One PPO/GRPO optimizer step: a `TrainConfig` plus the loss options of `ppo_loss` (clip range, dual clip,
    KL, entropy, loss_agg, rollout correction), declared once in `ops.policy_loss.LossOptions`. A rollout
    correction needs batch.rollout_logprobs, a nonzero kl_coef batch.ref_logprobs (`check_batch`)."""

    def validate(self) -> None:
        self._check_train("PPOConfig")
        try:  # the loss options are checked where they are declared
            self.check_loss()
        except ValueError as e:
            raise ValueError(f"PPOConfig: {e}") from None

    def loss_kwargs(self) -> dict:
        """The keyword arguments of `ppo_loss` this config sets."""
        return {name: getattr(self, name) for name in (*LOSS_FIELDS, "temperature")}

    def check_batch(self, batch) -> None:
        """Raise ValueError when the batch lacks a field this config needs beyond the policy's own
        (response_mask, old_logprobs, advantages): ref_logprobs for a nonzero kl_coef, rollout_logprobs
        for a rollout correction. The fields' shapes and values are `PPOBatch.validate`'s."""
        if self.kl_coef and batch.ref_logprobs is None:
            raise ValueError("PPOConfig.kl_coef > 0 needs batch.ref_logprobs")
        if self.rollout_correction is not None and batch.rollout_logprobs is None:
            raise ValueError(f"PPOConfig.rollout_correction = {self.rollout_correction!r} needs batch.rollout_logprobs")


@dataclass(kw_only=True, slots=True)
class ValueConfig(_StepConfig):
    """One critic optimizer step with `value_loss`."""

    clip: float | None = 0.2
    """Value clipping around old_values; None: off."""
    lr: float | Callable[[int], float] = 1e-5

    def validate(self) -> None:
        self._check_step("ValueConfig")
        if self.clip is not None:
            checks.number("ValueConfig", "clip", self.clip, low=0, low_open=True)
