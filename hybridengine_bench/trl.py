"""TRL's GRPO step on hybridengine against TRL's own (bench `trl`, suite `trl`).

The same work through `trl.GRPOTrainer.train()` twice, one optimizer step per generation batch:
- `hybridengine`: `HybridGRPOTrainer` (hybridengine.integrations.trl): rollout by `engine.generate`,
  the update by `engine.train_step` with TRL's loss, on one bf16 engine;
- `trl`: TRL's `GRPOTrainer` with its default generation (transformers `generate`) on a transformers
  model of the same config, bf16, TRL's defaults otherwise (gradient checkpointing, fused LM head, AdamW).

Workload per GPU: 16 prompts of 128 random characters (a character tokenizer built in code: one token
per character, the model's whole vocabulary), 8 samples each (num_generations), 256 new tokens at
temperature 1 with no stop token in reach of a random model, so every completion has 256 tokens; a
random 0/1 reward; loss_type dapo; importance-sampling correction off on both (TRL applies it only to
vLLM rollouts, so its own loop never recomputes old log-probs; a second hybridengine row, case
is_correction, has it on: one `log_probs` pass more). The trainer updates in micro-batches of 32
sequences (gradient_accumulation_steps = steps_per_generation = 4); the engine steps once per window.
Models: random init from the embedded configs (default qwen2.5-1.5b). CPU (the harness check): the
tiny preset, 2 prompts x 2 samples x 4 tokens.

Rows: `seconds` per optimizer step (rollout, rewards and update; first step left out), `tokens_per_s`
(prompt + completion tokens of the step per second), the torch and NVML peaks over the timed steps.
Needs TRL on the GPU machine (`WITH_TRL=1 ../shared/device/make-wheelhouse.sh`); without it the rows
say not_run.
"""

from __future__ import annotations

import os
import time

import torch

from .common import Ctx, quantiles, release_memory

BENCH = "trl"
GPU = dict(prompts=16, prompt=128, n=8, new_tokens=256, micro_batch=32)
CPU = dict(prompts=2, prompt=8, n=2, new_tokens=4, micro_batch=2)


def _tokenizer(vocab_size: int):
    """One token per character of a small alphabet, "<pad>", "<eos>", and filler tokens up to the vocabulary."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = "abcdefghijklmnopqrstuvwxyz"
    vocab = {"<pad>": 0, "<eos>": 1, **{c: 2 + i for i, c in enumerate(chars)}}
    vocab.update({f"<x{i}>": i for i in range(len(vocab), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def _dataset(w: dict, steps: int, seed: int):
    from datasets import Dataset

    g = torch.Generator().manual_seed(seed)
    rows = torch.randint(0, 26, (w["prompts"] * steps, w["prompt"]), generator=g).tolist()
    return Dataset.from_dict({"prompt": ["".join(chr(97 + i) for i in row) for row in rows]})


def _coin(completion_ids, **kwargs):
    """A random 0/1 reward per completion (the reward's cost is not what this measures)."""
    return torch.randint(0, 2, (len(completion_ids),)).float().tolist()


def _args(ctx: Ctx, w: dict, out: str, steps: int, **overrides):
    from trl import GRPOConfig

    accum = w["prompts"] * w["n"] // w["micro_batch"]
    kwargs = dict(output_dir=out, per_device_train_batch_size=w["micro_batch"], gradient_accumulation_steps=accum,
                  steps_per_generation=accum, num_generations=w["n"], max_completion_length=w["new_tokens"],
                  temperature=1.0, learning_rate=1e-6, loss_type="dapo", vllm_importance_sampling_correction=False,
                  max_steps=steps, bf16=ctx.cuda, use_cpu=not ctx.cuda, report_to=[], save_strategy="no",
                  logging_strategy="no", disable_tqdm=True, seed=0, shuffle_dataset=False)
    kwargs.update(overrides)
    return GRPOConfig(**kwargs)


def _run(ctx: Ctx, trainer, steps: int) -> tuple[list[float], list[float], object]:
    """train() with per-optimizer-step wall times (synchronised) and tokens; the first step is warm-up."""
    from transformers import TrainerCallback

    times, tokens = [], []

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            ctx.sync()
            self.t0, self.seen = time.perf_counter(), state.num_input_tokens_seen

        def on_step_end(self, args, state, control, **kwargs):
            ctx.sync()
            times.append(time.perf_counter() - self.t0)
            tokens.append(state.num_input_tokens_seen - self.seen)

    trainer.add_callback(Timer())
    with ctx.peak() as pm:
        trainer.train()
    return times[1:], tokens[1:], pm


def _record(ctx: Ctx, provider: str, model: str, case: dict, times: list[float], tokens: list[float], pm) -> None:
    ctx.rec.add(BENCH, provider, model, case, "seconds", times)
    ctx.rec.add(BENCH, provider, model, case, "tokens_per_s", [n / t for n, t in zip(tokens, times)])
    ctx.record_peak(pm, BENCH, provider, model, case)
    med = quantiles(times)[1]
    ctx.log(f"  {BENCH} {provider} {model} {case.get('is_correction', '')}: {med:.2f} s/step, "
            f"{quantiles([n / t for n, t in zip(tokens, times)])[1]:,.0f} tok/s, peak {pm.torch_gib:.1f} GiB")


def trl_grpo(ctx: Ctx) -> None:
    """HybridGRPOTrainer and TRL's GRPOTrainer on the same prompts, shapes and loss."""
    try:
        import datasets  # noqa: F401
        import trl  # noqa: F401
    except ImportError as e:
        for provider in ("hybridengine", "trl"):
            ctx.rec.not_run(BENCH, provider, None, f"TRL is not installed ({e}); see hybridengine_bench/trl.py")
        return
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    import hybridengine as he
    from hybridengine.integrations.trl import HybridGRPOTrainer

    w = GPU if ctx.cuda else CPU
    steps = 1 + ctx.reps(3)
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    out = os.path.join(os.environ.get("TMPDIR", "/tmp"), "bench_trl")
    for model in (ctx.models if ctx.cuda else ["tiny-qwen2"]):
        cfg = he.model_config(model)
        tokenizer = _tokenizer(cfg.vocab_size)
        case = dict(prompts_per_gpu=w["prompts"], prompt=w["prompt"], samples=w["n"], new_tokens=w["new_tokens"],
                    micro_batch=w["micro_batch"], loss_type="dapo", trl=trl.__version__)
        dataset = _dataset(w, steps, seed=ctx.rank)
        for correction in (False, True):
            engine = he.HybridEngine(cfg, he.EngineConfig(
                dtype=dtype, device=str(ctx.device), max_model_len=w["prompt"] + w["new_tokens"],
                max_num_seqs=w["prompts"] * w["n"], gpu_memory_utilization=0.85))
            args = _args(ctx, w, out, steps, vllm_importance_sampling_correction=correction,
                         vllm_importance_sampling_mode="token_truncate")
            trainer = HybridGRPOTrainer(engine, _coin, args, processing_class=tokenizer, train_dataset=dataset)
            times, tokens, pm = _run(ctx, trainer, steps)
            _record(ctx, "hybridengine", model, {**case, "is_correction": correction}, times, tokens, pm)
            del trainer, engine
            release_memory()
        from transformers import AutoModelForCausalLM
        from trl import GRPOTrainer

        hf = AutoModelForCausalLM.from_config(cfg, dtype=dtype).to(ctx.device)
        trainer = GRPOTrainer(model=hf, reward_funcs=_coin, args=_args(ctx, w, out, steps), processing_class=tokenizer,
                              train_dataset=dataset)
        times, tokens, pm = _run(ctx, trainer, steps)
        _record(ctx, "trl", model, {**case, "is_correction": False}, times, tokens, pm)
        del trainer, hf
        release_memory()
