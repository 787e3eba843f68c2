"""One whole GRPO step, rollout to update (bench `ppo_e2e`): hybridengine against a DeepSpeed ZeRO-3 loop.

Workload per GPU (GPU runs): 32 prompts of 128 random tokens, n = 4 samples each, 256 new tokens
(sampling at temperature 1, no stop tokens, so every response is 256 tokens), random 0/1 rewards,
group-normalised advantages, log-probs of the rollout policy, one optimizer step over the 128
sequences of 384 tokens. CPU (the harness check): a tiny model, 2 prompts x 2 samples x 4 tokens.

Providers, same work, same run:
- `hybridengine`: `with engine.rollout(): engine.generate(...)` (switch to the generation view, KV
  cache, CUDA graphs, generation, switch back), `engine.log_probs`, `engine.ppo_step`, then
  `engine.prepare_rollout()` (the next switch's pages mapped on a host thread; rows: case prepare_rollout).
- `deepspeed_zero3`: the loop a DeepSpeed user writes (TRL/OpenRLHF-style without vLLM): gather every
  parameter once (`GatheredParameters`, ZeRO hooks off) and run HF `generate`, then ZeRO-3 forwards
  for the log-probs and ZeRO-3 forward/backward/step for the update, in micro-batches of
  DS_MICRO_BATCH sequences (full [micro, T, V] logits in fp32 for the loss).

Rows: `seconds` per step, `tokens_per_s` with case count "all" (prompt + response tokens of all GPUs
per second, verl's "throughput" convention) and count "response", one `seconds` row per phase (case
phase) and the peaks. The switch share = (switch to generation + switch back) / step, from the phase rows.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .common import Ctx, quantiles, release_memory

BENCH = "ppo_e2e"


@dataclass(frozen=True)
class E2EWork:
    prompts: int
    prompt: int
    n: int
    new_tokens: int


GPU_E2E = E2EWork(prompts=32, prompt=128, n=4, new_tokens=256)
CPU_E2E = E2EWork(prompts=2, prompt=8, n=2, new_tokens=4)
DS_MICRO_BATCH = 16
"""Sequences per DeepSpeed forward/backward: 16 x 384 tokens keeps the fp32 logits near 3.7 GB at V = 152k."""
PHASES = ("switch_to_generation", "rollout_setup", "generate", "switch_to_training", "log_probs", "update")


def _work(ctx: Ctx) -> E2EWork:
    return GPU_E2E if ctx.cuda else CPU_E2E


def _case(ctx: Ctx, w: E2EWork) -> dict:
    return dict(prompts_per_gpu=w.prompts, prompt=w.prompt, samples=w.n, new_tokens=w.new_tokens)


def engine_step(ctx: Ctx, engine, prompts: list[list[int]], params, ppo, index: int) -> dict[str, float]:
    """One GRPO step on a HybridEngine: rollout (switch, generate, switch back), log-probs, update; the seconds
    of each phase (slowest rank)."""
    t = {}
    ctx.sync()
    t0 = time.perf_counter()
    rollout = engine.rollout()
    rollout.__enter__()
    t["switch_to_generation"] = engine.stats["switch_to_generation_s"]
    t["rollout_setup"] = time.perf_counter() - t0 - t["switch_to_generation"]
    try:
        t1 = time.perf_counter()
        outs = engine.generate(prompts, params)
        ctx.sync()
        t["generate"] = time.perf_counter() - t1
    finally:
        t2 = time.perf_counter()
        rollout.__exit__(None, None, None)
        ctx.sync()
        t["switch_to_training"] = time.perf_counter() - t2
    train_on(ctx, engine, outs, index, params.n, ppo, t)
    return _phase_max(ctx, t)


def train_on(ctx: Ctx, engine, outs, index: int, n: int, ppo, t: dict[str, float]) -> None:
    """The GRPO step's training half on a rollout's outputs: old log-probs recomputed (t["log_probs"]), one
    ppo_step, then prepare_rollout() for the next rollout (t["update"])."""
    import hybridengine as he
    from hybridengine.train.advantages import grpo_advantages

    seqs = [(o.prompt_token_ids, s.token_ids) for o in outs for s in o.outputs]
    ids = [torch.tensor(p + r) for p, r in seqs]
    mask = [torch.tensor([0.0] * (len(p) - 1) + [1.0] * len(r)) for p, r in seqs]
    adv = grpo_advantages(_rewards(len(seqs), index, ctx.rank), n)
    t3 = time.perf_counter()
    old = engine.log_probs(he.PPOBatch(input_ids=ids))
    # The log-probs' stream only: offload "rollout"'s copy back runs on under the update, as in a trainer
    # (the update's device-wide sync below keeps it inside the step).
    ctx.sync(device_wide=False)
    t["log_probs"] = time.perf_counter() - t3
    old = [old[b, :len(ids[b]) - 1].float().cpu() for b in range(len(ids))]
    batch = he.PPOBatch(input_ids=ids, response_mask=mask, old_logprobs=old,
                        advantages=[a * m for a, m in zip(adv.tolist(), mask)])
    t4 = time.perf_counter()
    engine.ppo_step(batch, ppo)
    engine.prepare_rollout()  # the next rollout's pages mapped on a host thread (VMM) from here
    ctx.sync()
    t["update"] = time.perf_counter() - t4


def _rewards(num: int, step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, 2, (num,), generator=g).float()


def _record(ctx: Ctx, provider: str, model: str, w: E2EWork, steps: list[dict], pm, bench: str = BENCH,
            **variant) -> None:
    """Rows of one provider from per-step phase timings (seconds, slowest rank per phase), under `bench`."""
    case = {**_case(ctx, w), **variant}
    totals = [sum(s.values()) for s in steps]
    seqs = w.prompts * w.n
    all_tokens = ctx.world * seqs * (w.prompt + w.new_tokens)
    response = ctx.world * seqs * w.new_tokens
    ctx.rec.add(bench, provider, model, case, "seconds", totals)
    ctx.rec.add(bench, provider, model, {**case, "count": "all"}, "tokens_per_s", [all_tokens / t for t in totals])
    ctx.rec.add(bench, provider, model, {**case, "count": "response"}, "tokens_per_s", [response / t for t in totals])
    for phase in steps[0]:
        ctx.rec.add(bench, provider, model, {**case, "phase": phase}, "seconds", [s[phase] for s in steps])
    ctx.record_peak(pm, bench, provider, model, case)
    med = quantiles(totals)[1]
    split = ", ".join(f"{p} {quantiles([s[p] for s in steps])[1]:.3g} s" for p in steps[0])
    ctx.log(f"  {bench} {provider} {model}: {med:.2f} s/step, {all_tokens / med:,.0f} tok/s ({split})")


def _phase_max(ctx: Ctx, phases: dict[str, float]) -> dict[str, float]:
    return dict(zip(phases, ctx.slowest(list(phases.values()))))


def ppo_e2e(ctx: Ctx) -> None:
    """hybridengine: rollout -> log-probs -> update on one engine (random init, embedded configs)."""
    import hybridengine as he

    w = _work(ctx)
    models = ctx.models if ctx.cuda else ["tiny-qwen2"]
    for model in models:
        cfg = he.model_config(model)
        engine = he.HybridEngine(cfg, he.EngineConfig(
            dtype=torch.bfloat16 if ctx.cuda else torch.float32, device=str(ctx.device),
            max_model_len=w.prompt + w.new_tokens, max_num_seqs=w.prompts * w.n, gpu_memory_utilization=0.85))
        g = torch.Generator().manual_seed(7 + ctx.rank)
        prompts = torch.randint(0, cfg.vocab_size, (w.prompts, w.prompt), generator=g).tolist()
        params = he.SamplingParams(n=w.n, temperature=1.0, max_tokens=w.new_tokens)
        ppo = he.PPOConfig(lr=1e-6, clip_low=0.2, clip_high=0.28, micro_batch_tokens=16384)

        def step(index: int) -> dict[str, float]:
            return engine_step(ctx, engine, prompts, params, ppo, index)

        def graphs_case() -> dict:  # rows name the lazy setting (EngineTuning.lazy_cuda_graphs) when on
            lazy = {"lazy_cuda_graphs": True} if engine.config.tuning.lazy_cuda_graphs else {}
            return lazy | {"prepare_rollout": True}

        step(0)  # warm-up: Triton compilation, CUDA graph pools, optimizer state
        with ctx.peak() as pm:
            steps = [step(i) for i in range(1, 1 + ctx.reps(2))]
        _record(ctx, "hybridengine", model, w, steps, pm, **graphs_case())
        share = quantiles([(s["switch_to_generation"] + s["switch_to_training"]) / sum(s.values()) for s in steps])[1]
        ctx.log(f"  {BENCH} hybridengine {model}: the switch is {share:.1%} of the step")
        if ctx.cuda:  # the other EngineTuning.lazy_cuda_graphs setting (lazy: each decode bucket at its first step)
            lazy = engine.config.tuning.lazy_cuda_graphs
            engine.config.tuning.lazy_cuda_graphs = not lazy
            with ctx.peak() as pm:
                steps = [step(i) for i in range(3, 3 + ctx.reps(2))]
            _record(ctx, "hybridengine", model, w, steps, pm, **graphs_case())
            engine.config.tuning.lazy_cuda_graphs = lazy
        del engine
        release_memory()


def _ds_config(ctx: Ctx, w: E2EWork) -> dict:
    seqs = w.prompts * w.n
    return {
        "train_micro_batch_size_per_gpu": DS_MICRO_BATCH,
        "gradient_accumulation_steps": max(1, seqs // DS_MICRO_BATCH),
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-6, "torch_adam": True}},
        "gradient_clipping": 1.0,
        "steps_per_print": 1 << 30,
    }


def _response_logprobs(logits: torch.Tensor, ids: torch.Tensor, prompt: int) -> torch.Tensor:
    """fp32 log-probs [b, new_tokens] of the response tokens from HF logits [b, T, V]."""
    logp = torch.log_softmax(logits[:, prompt - 1:-1].float(), dim=-1)
    return logp.gather(-1, ids[:, prompt:, None]).squeeze(-1)


def ppo_e2e_deepspeed(ctx: Ctx) -> None:
    """The DeepSpeed ZeRO-3 loop of the same step (see the module docstring); GPU only."""
    if not ctx.cuda:
        ctx.rec.not_run(BENCH, "deepspeed_zero3", None, "GPU only")
        return
    from .peers import import_deepspeed

    deepspeed = import_deepspeed(ctx, BENCH)
    if deepspeed is None:
        return
    from .peers import _ds_engine, _without_zero_hooks

    w = _work(ctx)
    for name in ctx.models:
        config = _ds_config(ctx, w)
        engine, model, params, _ = _ds_engine(ctx, name, config)
        vocab = model.config.vocab_size
        g = torch.Generator().manual_seed(7 + ctx.rank)
        prompts = torch.randint(0, vocab, (w.prompts, w.prompt), generator=g).to(ctx.device)
        prompts = prompts.repeat_interleave(w.n, 0)

        def step(index: int, new_tokens: int) -> dict[str, float]:
            from hybridengine.train.advantages import grpo_advantages

            t = {}
            engine.eval()
            ctx.sync()
            t0 = time.perf_counter()
            out = {}

            def gen():
                out["ids"] = engine.module.generate(
                    input_ids=prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens,
                    min_new_tokens=new_tokens, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                    eos_token_id=None, pad_token_id=0)

            with deepspeed.zero.GatheredParameters(params):
                _without_zero_hooks(engine, gen)
            ctx.sync()
            t["generate"] = time.perf_counter() - t0  # gather + generate + release: DeepSpeed's rollout
            ids = out["ids"]
            t1 = time.perf_counter()
            olds = []
            with torch.no_grad():
                for mb in ids.split(DS_MICRO_BATCH):
                    olds.append(_response_logprobs(engine(input_ids=mb).logits, mb, w.prompt))
            ctx.sync()
            t["log_probs"] = time.perf_counter() - t1
            adv = grpo_advantages(_rewards(ids.shape[0], index, ctx.rank), w.n).to(ctx.device)
            engine.train()
            t2 = time.perf_counter()
            for mb, old, a in zip(ids.split(DS_MICRO_BATCH), olds, adv.split(DS_MICRO_BATCH)):
                logp = _response_logprobs(engine(input_ids=mb).logits, mb, w.prompt)
                ratio = torch.exp(torch.clamp(logp - old, -20, 20))
                pg = torch.maximum(-a[:, None] * ratio, -a[:, None] * torch.clamp(ratio, 0.8, 1.28))
                # token-mean over the whole batch: each micro-batch's share of the global mean
                engine.backward(pg.sum() / (ids.shape[0] * new_tokens) * config["gradient_accumulation_steps"])
                engine.step()
            ctx.sync()
            t["update"] = time.perf_counter() - t2
            return _phase_max(ctx, t)

        step(0, 8)  # warm-up with a short rollout (DeepSpeed's generate runs ~600 tok/s per GPU)
        with ctx.peak() as pm:
            steps = [step(1, w.new_tokens)]
        _record(ctx, "deepspeed_zero3", name, w, steps, pm)
        engine.destroy()
        del engine, model, params
        release_memory()
