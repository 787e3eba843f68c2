"""TRL's GRPO trainer on a HybridEngine: `HybridGRPOTrainer`.

`HybridGRPOTrainer` is TRL's `GRPOTrainer` (the version pinned by the `trl` extra) with the two heavy
parts moved onto one `HybridEngine`: rollout runs through `engine.generate` on the generation view of
the engine's buffer, and each optimizer step is one `engine.train_step(batch, loss_fn, config)` on the
training view of the same buffer, so the weights the next rollout samples from are the ones the step
wrote, with no copy and no sync. Everything else is TRL's: the dataset and its repeat sampler, prompt
tokenisation and chat templates, reward functions (callables or reward models), reward weighting and
group normalisation, logging, callbacks, evaluation scheduling and checkpoint cadence.

What maps to what:

- generation: TRL's `_generate_single_turn` -> `engine.generate` inside `engine.rollout()`, one request
  per run of identical consecutive prompts (TRL repeats each prompt `num_generations` times) with
  `SamplingParams(n=..., temperature, top_p, top_k, max_tokens=max_completion_length,
  stop_token_ids=<the tokenizer's and the model's eos ids>)`. The samples carry the sampler's
  log-probs (TRL's `sampling_per_token_logps`).
- old / reference log-probs: TRL's `_get_per_token_logps_and_entropies` -> `engine.log_probs` (policy)
  or `ref_engine.log_probs` (a second, frozen engine: the `beta` term's reference model).
- the loss (`trl_loss`, which needs no TRL): TRL's `_compute_loss` is `grpo_loss`, a plain-torch
  function of the per-token `logp` and `entropy` of the fused LM-head pass and the batch's per-token
  fields; TRL's per-micro-batch normalisations (`grpo`, `bnpo`, `dr_grpo`, `dapo`, ...) become per-token
  weights (`token_weights`), so one engine step over the whole gradient-accumulation window has TRL's
  objective, whatever the engine's own micro-batching.
- the optimizer step: the `Trainer`'s AdamW step -> the engine's sharded AdamW inside `train_step`,
  with TRL's learning-rate schedule (read from the `Trainer`'s scheduler every step), betas, eps,
  weight decay and `max_grad_norm`; `gradient_checkpointing` is the engine's activation checkpointing.
- importance-sampling correction (`vllm_importance_sampling_correction`): the engine is a separate
  sampler like vLLM, so TRL's correction applies as is, to the engine's rollout log-probs against the
  recomputed old log-probs (every mode: token/sequence, truncate/mask). With
  `EngineConfig(exact_logprobs=True)` the rollout's log-probs are the trainer's bit for bit: the ratio
  is 1, so the correction and its extra forward pass are skipped.

The `Trainer` holds a weightless stand-in of the model (`engine_shell`: the transformers class of the
engine's config, every parameter an empty tensor): the weights live only in the engine's buffer.
`save_model` writes the engine's weights as a transformers checkpoint (`engine.export_hf`).

Which `GRPOConfig` options hold is `check_grpo_config`'s to say (`UNSUPPORTED` lists the rest, each
raising a ValueError at construction).
"""

from __future__ import annotations

import os
import time

import torch

try:
    from trl import GRPOConfig, GRPOTrainer
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError("hybridengine.integrations.trl needs TRL (the trl extra: pip install trl==1.16.0, or "
                      "make setup EXTRAS=dev,bench,trl in a checkout)") from e

from hybridengine.engine import HybridEngine
from hybridengine.integrations.trl_loss import (IS_MODES, LOSS_TYPES, GRPOLossConfig, grpo_loss,
                                                importance_sampling_ratio, token_weights)
from hybridengine.rollout.sampling_params import SamplingParams
from hybridengine.train.batch import PPOBatch
from hybridengine.train.config import TrainConfig

__all__ = ["GRPOLossConfig", "HybridGRPOTrainer", "LOSS_TYPES", "UNSUPPORTED", "check_grpo_config", "engine_shell",
           "grpo_loss", "token_weights"]

ADAMW = ("adamw_torch", "adamw_torch_fused", "adamw_hf")
"""`TrainingArguments.optim` values that the engine's AdamW stands for."""

UNSUPPORTED: dict[str, tuple[object, str]] = {
    # option: (the value it must keep, why)
    "use_vllm": (False, "generation runs on the engine"),
    "use_transformers_continuous_batching": (False, "generation runs on the engine"),
    "use_transformers_paged": (False, "generation runs on the engine"),
    "generation_kwargs": (None, "the engine's SamplingParams take temperature, top_p, top_k and max_tokens only"),
    "cache_implementation": (None, "the engine has its own paged KV cache"),
    "min_p": (None, "the engine's sampler has no min-p"),
    "repetition_penalty": (1.0, "the engine's sampler has no repetition penalty"),
    "top_entropy_quantile": (1.0, "the entropy mask needs a quantile over a whole TRL micro-batch of the "
                                  "step's own entropies"),
    "use_adaptive_entropy": (False, "the adaptive entropy controller steps between micro-batches"),
    "sync_ref_model": (False, "the reference engine is frozen"),
    "model_init_kwargs": (None, "the engine builds the model"),
    "deepspeed": (None, "the engine shards the model itself"),
    "fsdp": (None, "the engine shards the model itself"),
    "torch_compile": (False, "the engine runs its own kernels"),
    "use_liger_kernel": (False, "the engine's fused LM-head pass computes the log-probs"),
    "router_aux_loss_coef": (None, "the engine's models have no router"),
    "max_tool_calling_iterations": (None, "tools are not supported"),
}
"""`GRPOConfig` options that must keep their default: the value and the reason, in the error message."""


# -- the configuration ----------------------------------------------------------------------------------


def check_grpo_config(args: GRPOConfig, *, ref_engine: HybridEngine | None = None) -> None:
    """Raise ValueError naming the first `GRPOConfig` option `HybridGRPOTrainer` does not support.

    Supported as in TRL: loss_type (all of `LOSS_TYPES`), epsilon, epsilon_high, delta,
    importance_sampling_level, beta (with `ref_engine`), use_bias_correction_kl, sapo_*/vespo_*,
    off_policy_mask_threshold, entropy_coef (static), scale_rewards, multi_objective_aggregation,
    reward_weights, num_generations(_eval), max_completion_length, mask_truncated_completions,
    temperature, top_p, top_k, num_iterations, steps_per_generation / generation_batch_size,
    vllm_importance_sampling_correction / _mode / _clip_min / _clip_max (applied to the engine's
    rollout log-probs), the learning rate and its scheduler, weight_decay, adam_beta1/2, adam_epsilon,
    max_grad_norm, optim in `ADAMW`, gradient_accumulation_steps, gradient_checkpointing (the engine's
    activation checkpointing), logging, evaluation, saving and callbacks. Ignored (the engine decides):
    bf16 / fp16 (`EngineConfig.dtype`), cast_lm_head_to_fp32 (the fused LM-head pass accumulates in
    fp32), disable_dropout (the engine's models have no dropout), pad_to_multiple_of, ds3_gather_for_generation.
    The rest (`UNSUPPORTED`, optimizers other than AdamW) raise."""
    if not isinstance(args, GRPOConfig):
        raise ValueError(f"args must be a trl.GRPOConfig, got {type(args).__name__}")
    for name, (keep, why) in UNSUPPORTED.items():
        value = getattr(args, name, keep)
        if name in ("deepspeed", "fsdp") and not value:
            continue  # '' and [] are TrainingArguments' "off" too
        if value != keep:
            raise ValueError(f"HybridGRPOTrainer: GRPOConfig.{name}={value!r} is not supported ({why}); "
                             f"leave it at {keep!r}")
    optim = str(getattr(args.optim, "value", args.optim))
    if optim not in ADAMW:
        raise ValueError(f"HybridGRPOTrainer: GRPOConfig.optim={optim!r} is not supported (the engine's optimizer "
                         f"is AdamW: one of {ADAMW})")
    if args.loss_type not in LOSS_TYPES:
        raise ValueError(f"HybridGRPOTrainer: GRPOConfig.loss_type={args.loss_type!r} is not one of {LOSS_TYPES}")
    if args.vllm_importance_sampling_correction and args.vllm_importance_sampling_mode not in IS_MODES:
        raise ValueError(f"HybridGRPOTrainer: GRPOConfig.vllm_importance_sampling_mode="
                         f"{args.vllm_importance_sampling_mode!r} is not one of {IS_MODES}")
    if args.beta != 0.0 and ref_engine is None:
        raise ValueError(f"HybridGRPOTrainer: GRPOConfig.beta={args.beta} needs ref_engine (a frozen HybridEngine "
                         "of the reference policy)")
    if args.temperature <= 0:
        raise ValueError(f"HybridGRPOTrainer: GRPOConfig.temperature must be > 0, got {args.temperature}")


def engine_shell(engine: HybridEngine):
    """A weightless transformers model of the engine's config, for the `Trainer`'s bookkeeping: the
    `PreTrainedModel` class of `engine.hf_config` with every parameter and buffer an empty tensor
    (no gradient). The weights live only in the engine's buffer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if engine.hf_config is None:
        raise ValueError("HybridGRPOTrainer needs an engine built from a transformers config, model or checkpoint "
                         "(engine.hf_config is None)")
    cfg = dict(engine.hf_config)
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=engine.config.dtype)
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            setattr(module, name, torch.nn.Parameter(torch.empty(0, dtype=p.dtype), requires_grad=False))
        for name, b in list(module.named_buffers(recurse=False)):
            module.register_buffer(name, torch.empty(0, dtype=b.dtype), persistent=False)
    return model


# -- the trainer ----------------------------------------------------------------------------------------


class HybridGRPOTrainer(GRPOTrainer):
    """TRL's `GRPOTrainer` with rollout and the optimizer step on `engine` (see the module docstring).

    engine: the policy (`HybridEngine`, an actor built from a transformers config, model or
    checkpoint). ref_engine: a frozen `HybridEngine` of the reference policy, needed when
    `args.beta != 0`. The other arguments are `GRPOTrainer`'s, less those the engine replaces (`model`,
    `peft_config`, `quantization_config`, `optimizers`, `tools`, `rollout_func`,
    `environment_factory`); `processing_class` is required (a tokenizer: the engine does not know one).
    micro_batch_tokens: the engine step's micro-batch size in tokens (`TrainConfig.micro_batch_tokens`):
    the engine packs sequences into micro-batches itself, whatever per_device_train_batch_size is."""

    def __init__(self, engine: HybridEngine, reward_funcs, args: GRPOConfig, *, processing_class,
                 train_dataset=None, eval_dataset=None, reward_processing_classes=None, callbacks=None,
                 ref_engine: HybridEngine | None = None, micro_batch_tokens: int = 16384):
        if not isinstance(engine, HybridEngine) or engine.role != "actor":
            raise ValueError(f"engine must be an actor HybridEngine, got {type(engine).__name__}")
        if ref_engine is not None and (not isinstance(ref_engine, HybridEngine) or ref_engine.role != "actor"):
            raise ValueError(f"ref_engine must be None or an actor HybridEngine, got {type(ref_engine).__name__}")
        from transformers import PreTrainedTokenizerBase

        if not isinstance(processing_class, PreTrainedTokenizerBase):
            raise ValueError("HybridGRPOTrainer: processing_class must be a tokenizer (PreTrainedTokenizerBase); "
                             f"got {type(processing_class).__name__} (multimodal processors are not supported)")
        check_grpo_config(args, ref_engine=ref_engine)
        self.engine, self.ref_engine = engine, ref_engine
        # Exact mode: the rollout's log-probs are the trainer's, so the correction would multiply by 1.
        self._is_correction = bool(args.vllm_importance_sampling_correction) and not engine.config.exact_logprobs
        self._max_grad_norm = args.max_grad_norm
        self.micro_batch_tokens = micro_batch_tokens
        self._engine_stats: dict = {}
        self._window: list[dict] = []  # the accumulation window's micro-batches, stepped together
        beta = args.beta
        args.beta = 0.0  # GRPOTrainer would load a transformers reference model from the hub: ref_engine is it
        try:
            super().__init__(model=engine_shell(engine), reward_funcs=reward_funcs, args=args,
                             train_dataset=train_dataset, eval_dataset=eval_dataset, processing_class=processing_class,
                             reward_processing_classes=reward_processing_classes, callbacks=callbacks)
        finally:
            args.beta = beta
        self.beta = beta
        self.ref_model = ref_engine if beta != 0.0 else None
        self.loss_config = GRPOLossConfig.from_args(args, is_correction=self._is_correction)
        # The engine clips; the Trainer's clip over the shell's empty parameters would log a norm of 0.
        self.args.max_grad_norm = 0.0
        # The engine is the data parallelism: the shell is never wrapped (Accelerate wraps a module in DDP
        # under a CPU process group even when no parameter trains, and DDP refuses such a module).
        prepare_model = self.accelerator.prepare_model

        def prepare_shell(model, *args, **kwargs):
            return model if model is self.model else prepare_model(model, *args, **kwargs)

        self.accelerator.prepare_model = prepare_shell

    # -- rollout --------------------------------------------------------------------------------------

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        """Completions (token ids incl. the stop token) and their sampler log-probs, from the engine."""
        groups: list[tuple[list[int], int]] = []  # (prompt, consecutive repeats)
        for ids in prompt_ids:
            ids = list(ids)
            if groups and groups[-1][0] == ids:
                groups[-1] = (ids, groups[-1][1] + 1)
            else:
                groups.append((ids, 1))
        top_k = -1 if not self.top_k else int(self.top_k)
        params = [SamplingParams(n=n, temperature=self.temperature, top_p=self.top_p, top_k=top_k,
                                 max_tokens=self.max_completion_length, stop_token_ids=tuple(self.eos_token_ids))
                  for _, n in groups]
        with self.engine.rollout():
            outputs = self.engine.generate([ids for ids, _ in groups], params)
        completion_ids, logprobs = [], []
        for out in outputs:
            for sample in out.outputs:
                completion_ids.append(list(sample.token_ids))
                logprobs.append(list(sample.logprobs))
        for key, value in self.engine.stats.items():
            if isinstance(value, (int, float)) and key in ("tokens_per_s", "generate_s"):
                self._metrics["train" if self.model.training else "eval"][f"engine/{key}"].append(float(value))
        return completion_ids, logprobs

    def _generate_and_score_completions(self, inputs):
        """TRL's, plus the completion lengths and, with the correction on, TRL's importance-sampling
        ratio of the recomputed old log-probs against the engine's rollout log-probs."""
        out = super()._generate_and_score_completions(inputs)
        device = out["completion_ids"].device
        mode = "train" if self.model.training else "eval"
        out["completion_lengths"] = torch.tensor([len(ids) for ids in self._last_completion_ids], device=device)
        if not self._is_correction:
            return out
        mask = out["completion_mask"] * out["tool_mask"] if "tool_mask" in out else out["completion_mask"]
        if out.get("old_per_token_logps") is None:
            with torch.no_grad():
                ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
                attn = torch.cat([out["prompt_mask"], out["completion_mask"]], dim=1)
                out["old_per_token_logps"], _, _ = self._get_per_token_logps_and_entropies(
                    self.model, ids, attn, out["completion_ids"].size(1), lengths=out["completion_lengths"])
        old, sampling = out["old_per_token_logps"], out["sampling_per_token_logps"]
        out["importance_sampling_ratio"] = importance_sampling_ratio(
            old, sampling, mask, self.vllm_importance_sampling_mode, self.vllm_importance_sampling_clip_min,
            self.vllm_importance_sampling_clip_max)
        delta = torch.abs(old - sampling)[mask.bool()]
        ratio = out["importance_sampling_ratio"]
        ratio = ratio.flatten() if ratio.shape[1] == 1 else ratio[mask.bool()]
        for name, values in (("sampling/sampling_logp_difference", delta), ("sampling/importance_sampling_ratio",
                                                                             ratio)):
            if values.numel():
                self._metrics[mode][f"{name}/mean"].append(values.float().mean().item())
                self._metrics[mode][f"{name}/max"].append(values.float().max().item())
                if "ratio" in name:
                    self._metrics[mode][f"{name}/min"].append(values.float().min().item())
        return out

    def _generate(self, prompts: list):
        result = super()._generate(prompts)
        self._last_completion_ids = result[1]
        return result

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, lengths=None, **kwargs):
        """[B, logits_to_keep] log-probs (and entropies) of the completion tokens from the engine: the
        reference engine when `model` is it, else the policy's. No gradient (the step computes its own)."""
        if any(v is not None for v in kwargs.values()):
            raise ValueError("HybridGRPOTrainer: multimodal inputs are not supported")
        engine = model if isinstance(model, HybridEngine) else self.engine
        prompt_width = input_ids.size(1) - logits_to_keep
        seqs = _Sequences.from_padded(input_ids[:, :prompt_width], attention_mask[:, :prompt_width],
                                      input_ids[:, prompt_width:], attention_mask[:, prompt_width:], lengths)
        with torch.no_grad():
            result = engine.log_probs(PPOBatch(input_ids=seqs.input_ids), temperature=self.temperature,
                                      return_entropy=compute_entropy)
        logp, ent = result if compute_entropy else (result, None)
        device = input_ids.device
        logp = seqs.completion_columns(logp, logits_to_keep).to(device)
        ent = seqs.completion_columns(ent, logits_to_keep).to(device) if ent is not None else None
        return logp, ent, None

    # -- the update -----------------------------------------------------------------------------------

    def training_step(self, model, inputs, num_items_in_batch=None):
        """TRL's micro-batch of the accumulation window; the window's last one runs the engine's step on
        all of them. Returns the window's loss on its last micro-batch (0 on the others), so the
        Trainer's logged loss is the step's."""
        start = time.perf_counter()
        inputs = self._prepare_inputs(inputs)  # TRL's: generate and score every steps_per_generation
        self._window.append(inputs)
        self._step += 1
        loss = 0.0
        if self.accelerator.sync_gradients:  # the Trainer's last micro-batch before an optimizer step
            loss = self._engine_step(self._window)
            self._window = []
        self._current_train_step_time += time.perf_counter() - start
        if self.accelerator.sync_gradients:
            self._metrics["train"]["step_time"].append(self._current_train_step_time)
            self._current_train_step_time = 0.0
        return torch.tensor(loss, device=self.args.device)

    def _engine_step(self, window: list[dict]) -> float:
        args = self.args
        seqs, fields = self._step_fields(window, training=True)
        lr = self.lr_scheduler.get_last_lr()[0] if self.lr_scheduler is not None else args.learning_rate
        stats: dict = {}
        cfg = self.loss_config

        def loss_fn(logp, entropy, f):
            return grpo_loss(logp, entropy, f, cfg, stats)

        # loss_scale "sum": the step's loss is the sum of the micro-batch losses, which token_weights
        # normalise as TRL does; the engine sums gradients over its ranks where DDP averages them.
        config = TrainConfig(lr=lr, temperature=self.temperature, loss_scale="sum",
                             max_grad_norm=self._max_grad_norm or None, weight_decay=args.weight_decay,
                             betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon,
                             activation_checkpointing=bool(args.gradient_checkpointing),
                             micro_batch_tokens=self.micro_batch_tokens)
        world = self.engine.world_size
        for name in ("weight", "entropy_weight"):
            fields[name] = [w / world for w in fields[name]]
        result = _train_step(self.engine, seqs, fields, loss_fn, config)
        self._engine_stats = result
        self._log_loss_stats("train", stats)
        return float(result["loss"]) * self.engine.world_size

    def _log_loss_stats(self, mode: str, stats: dict) -> None:
        tokens = float(stats.get("tokens", 0.0))
        for key, value in stats.items():
            if key != "tokens":
                self._metrics[mode][key].append(float(value) / max(tokens, 1.0))

    def _step_fields(self, window: list[dict], training: bool):
        """The window's sequences (`_Sequences`) and per-token fields aligned with their targets."""
        seqs = _Sequences.from_inputs(window)
        cfg, args = self.loss_config, self.args
        fields: dict[str, list[torch.Tensor]] = {}
        for inputs in window:
            mask = inputs["completion_mask"]
            mask = mask * inputs["tool_mask"] if "tool_mask" in inputs else mask
            weight, entropy_weight = token_weights(
                cfg.loss_type, mask.cpu(), accumulation_steps=self.current_gradient_accumulation_steps,
                max_completion_length=self.max_completion_length,
                num_items_in_batch=float(inputs["num_items_in_batch"]), num_processes=self.accelerator.num_processes,
                steps_per_generation=args.steps_per_generation, training=training)
            adv = inputs["advantages"]
            adv = adv.unsqueeze(1) if adv.dim() == 1 else adv
            per_micro = {"mask": mask, "weight": weight, "entropy_weight": entropy_weight,
                         "advantages": adv.expand_as(mask)}
            for name, key in (("old_logprobs", "old_per_token_logps"), ("ref_logprobs", "ref_per_token_logps"),
                              ("rollout_logprobs", "sampling_per_token_logps")):
                if inputs.get(key) is not None:
                    per_micro[name] = inputs[key]
            if cfg.is_correction:
                per_micro["is_ratio"] = inputs["importance_sampling_ratio"].expand_as(mask)
            for name, value in per_micro.items():
                fields.setdefault(name, []).append(value.detach().float().cpu())
        width = max(v.shape[1] for v in fields["mask"])
        columns = {name: torch.cat([_pad_right(v, width, 1.0 if name == "is_ratio" else 0.0) for v in values])
                   for name, values in fields.items()}
        return seqs, {name: seqs.to_targets(v, fill=1.0 if name == "is_ratio" else 0.0)
                      for name, v in columns.items()}

    def _clip_grad_norm(self, model):
        return self._engine_stats.get("grad_norm")

    def _get_grad_norm(self, model, grad_norm=None):
        return self._engine_stats.get("grad_norm")

    # -- evaluation and saving ----------------------------------------------------------------------------

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The loss of one (evaluation) batch: `grpo_loss` on the engine's log-probs, no gradient."""
        if return_outputs:
            raise ValueError("The GRPOTrainer does not support returning outputs")
        seqs, fields = self._step_fields([inputs], training=self.model.training)
        batch = PPOBatch(input_ids=seqs.input_ids)
        with torch.no_grad():
            logp, ent = self.engine.log_probs(batch, temperature=self.temperature, return_entropy=True)
        logp, ent = seqs.unpad(logp.cpu()), seqs.unpad(ent.cpu())
        stats: dict = {}
        f = {name: torch.cat(v) for name, v in fields.items()}
        f["seq_index"] = torch.cat([torch.full((len(v),), b) for b, v in enumerate(logp)])
        loss = grpo_loss(torch.cat(logp), torch.cat(ent), f, self.loss_config, stats)
        self._log_loss_stats("train" if self.model.training else "eval", stats)
        return loss.to(self.args.device)

    def train(self, resume_from_checkpoint=None, **kwargs):
        if resume_from_checkpoint:
            raise ValueError("HybridGRPOTrainer: resume_from_checkpoint is not supported (restore the engine with "
                             "HybridEngine.load and start a new run)")
        return super().train(**kwargs)

    def _save(self, output_dir: str | None = None, state_dict=None) -> None:
        """The engine's weights as a transformers checkpoint (`export_hf`), the tokenizer and the args."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        self.engine.export_hf(output_dir)  # every rank joins; rank 0 writes
        if self.args.should_save:
            os.makedirs(output_dir, exist_ok=True)
            self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, "training_args.bin"))


def _pad_right(x: torch.Tensor, width: int, value: float) -> torch.Tensor:
    if x.shape[1] == width:
        return x
    return torch.nn.functional.pad(x, (0, width - x.shape[1]), value=value)


class _Sequences:
    """TRL's padded rows (left-padded prompt, right-padded completion) as variable-length sequences,
    and the map between completion columns and target positions (completion token j of row b is
    target prompt_len[b] - 1 + j)."""

    def __init__(self, input_ids: list[torch.Tensor], prompt_lens: list[int], completion_lens: list[int]):
        self.input_ids, self.prompt_lens, self.completion_lens = input_ids, prompt_lens, completion_lens

    @classmethod
    def from_padded(cls, prompt_ids, prompt_mask, completion_ids, completion_mask, lengths=None) -> "_Sequences":
        prompt_ids, prompt_mask, completion_ids = prompt_ids.cpu(), prompt_mask.cpu(), completion_ids.cpu()
        if lengths is None:  # a row masked out whole (mask_truncated_completions) still scores one token
            lengths = completion_mask.sum(-1).clamp(min=1)
        ids, plens, clens = [], [], []
        for b in range(prompt_ids.size(0)):
            prompt = prompt_ids[b][prompt_mask[b].bool()]
            n = int(lengths[b])
            ids.append(torch.cat([prompt, completion_ids[b, :n]]))
            plens.append(len(prompt))
            clens.append(n)
        return cls(ids, plens, clens)

    @classmethod
    def from_inputs(cls, window: list[dict]) -> "_Sequences":
        parts = [cls.from_padded(x["prompt_ids"], x["prompt_mask"], x["completion_ids"], x["completion_mask"],
                                 x.get("completion_lengths")) for x in window]
        return cls([t for p in parts for t in p.input_ids], [n for p in parts for n in p.prompt_lens],
                   [n for p in parts for n in p.completion_lens])

    def to_targets(self, columns: torch.Tensor, fill: float = 0.0) -> list[torch.Tensor]:
        """[B, C] completion columns -> per sequence [T_b - 1] target-aligned (`fill` on prompt targets)."""
        out = []
        for b, ids in enumerate(self.input_ids):
            row = torch.full((len(ids) - 1,), fill, dtype=torch.float32)
            p, n = self.prompt_lens[b], self.completion_lens[b]
            row[p - 1:p - 1 + n] = columns[b, :n].float()
            out.append(row)
        return out

    def completion_columns(self, targets: torch.Tensor, width: int) -> torch.Tensor:
        """[B, max_len - 1] target-aligned -> [B, width] completion columns (0 past each completion)."""
        out = torch.zeros(len(self.input_ids), width, dtype=torch.float32)
        targets = targets.float().cpu()
        for b in range(len(self.input_ids)):
            p, n = self.prompt_lens[b], self.completion_lens[b]
            out[b, :n] = targets[b, p - 1:p - 1 + n]
        return out

    def unpad(self, targets: torch.Tensor) -> list[torch.Tensor]:
        """[B, max_len - 1] -> per sequence [T_b - 1]."""
        return [targets[b, :len(ids) - 1] for b, ids in enumerate(self.input_ids)]


def _train_step(engine: HybridEngine, seqs: _Sequences, fields: dict[str, list[torch.Tensor]], loss_fn,
                config: TrainConfig) -> dict:
    """One `engine.train_step` with `loss_fn` over the sequences and their target-aligned fields (the
    TRL names of `_step_fields` become the batch's fields; the rest go to `batch.extra`)."""
    builtin = {name: fields.get(name) for name in ("old_logprobs", "ref_logprobs", "rollout_logprobs")}
    extra = {name: v for name, v in fields.items() if name not in builtin and name not in ("mask", "advantages")}
    batch = PPOBatch(input_ids=seqs.input_ids, response_mask=fields["mask"], advantages=fields["advantages"],
                     extra=extra, **builtin)
    return engine.train_step(batch, loss_fn, config)
