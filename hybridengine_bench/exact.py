"""Exact on-policy mode against the default mode (bench `exact`): mismatch, cost, determinism.

Workload per GPU (GPU runs): the GRPO workload of issue 23, 64 prompts of 128 random tokens, n = 4 samples
at temperature 1, 256 new tokens (no stop tokens), random 0/1 rewards, group-normalised advantages, one
`ppo_step` over the 256 sequences. CPU (the harness check): a tiny model, 2 prompts x 2 samples x 4 tokens.

For each model, each mode (`EngineConfig(exact_logprobs=False)` then `True`, one engine each, same seed):
one warm-up step, then `steps` measured GRPO steps, each
    rollout (switch + generate) -> log_probs of the sequences -> ppo_step
where the default mode's ppo_step takes the recomputed log-probs as old_logprobs (its rollout's differ) and
the exact mode's takes the rollout's own (bitwise the trainer's: the recompute is not needed; it still runs
here, untimed in the step, to measure the mismatch). Then two fresh engines of that mode run the same two
`ppo_step`s from the same state and their weights and optimizer states are compared bit for bit.

Rows (bench `exact`, provider `hybridengine`, case.mode default | exact):
- `tokens_per_s` case.phase generate (new tokens / generate seconds) and update (trained tokens / ppo_step
  seconds); `seconds` case.phase step: the GRPO step as a trainer runs it (default: rollout + log_probs +
  ppo_step; exact: rollout + ppo_step);
- `nats` case.stat mean | p99 | max: |rollout log-prob - log_probs| over the response tokens;
  `fraction` case.stat equal: the fraction of response tokens whose two log-probs are bitwise equal;
- `fraction` case.check deterministic: 1.0 when two runs of two ppo_steps end with bitwise-equal weights
  and optimizer states (compared by an order-sensitive digest of their bits, `_digest`), else 0.0;
- the peaks of each mode's measured steps.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch

from .common import Ctx, release_memory

BENCH = "exact"


@dataclass(frozen=True)
class ExactWork:
    prompts: int
    prompt: int
    n: int
    new_tokens: int
    steps: int


GPU_WORK = ExactWork(prompts=64, prompt=128, n=4, new_tokens=256, steps=2)
CPU_WORK = ExactWork(prompts=2, prompt=8, n=2, new_tokens=4, steps=1)


def _engine(he, model: str, ctx: Ctx, w: ExactWork, exact: bool):
    return he.HybridEngine(he.model_config(model), he.EngineConfig(
        dtype=torch.bfloat16 if ctx.cuda else torch.float32, device=str(ctx.device), exact_logprobs=exact,
        max_model_len=w.prompt + w.new_tokens, max_num_seqs=w.prompts * w.n, gpu_memory_utilization=0.85))


def _batch(he, outs, index: int, n: int, rank: int, old: list[torch.Tensor] | None):
    from hybridengine.train.advantages import grpo_advantages

    seqs = [(o.prompt_token_ids, s.token_ids, s.logprobs) for o in outs for s in o.outputs]
    ids = [torch.tensor(p + r) for p, r, _ in seqs]
    mask = [torch.tensor([0.0] * (len(p) - 1) + [1.0] * len(r)) for p, r, _ in seqs]
    rollout = [torch.tensor([0.0] * (len(p) - 1) + lp, dtype=torch.float32) for p, _, lp in seqs]
    g = torch.Generator().manual_seed(1000 * index + rank)
    adv = grpo_advantages(torch.randint(0, 2, (len(seqs),), generator=g).float(), n)
    return he.PPOBatch(input_ids=ids, response_mask=mask, old_logprobs=old if old is not None else rollout,
                       advantages=[a * m for a, m in zip(adv.tolist(), mask)]), rollout, mask


def exact(ctx: Ctx) -> None:
    """Default vs exact mode on one engine each: mismatch, generate / update throughput, the GRPO step, determinism."""
    import hybridengine as he

    w = GPU_WORK if ctx.cuda else CPU_WORK
    models = ctx.models if ctx.cuda else ["tiny-qwen2"]
    for model in models:
        cfg = he.model_config(model)
        g = torch.Generator().manual_seed(11 + ctx.rank)
        prompts = torch.randint(0, cfg.vocab_size, (w.prompts, w.prompt), generator=g).tolist()
        params = he.SamplingParams(n=w.n, temperature=1.0, max_tokens=w.new_tokens, seed=None)
        ppo = he.PPOConfig(lr=1e-6, clip_low=0.2, clip_high=0.28, micro_batch_tokens=16384)
        for exact_mode in (False, True):
            mode = "exact" if exact_mode else "default"
            engine = _engine(he, model, ctx, w, exact_mode)

            def step(index: int) -> dict:
                t = {}
                ctx.sync()
                t0 = time.perf_counter()
                with engine.rollout():
                    t1 = time.perf_counter()
                    outs = engine.generate(prompts, params)
                    ctx.sync()
                    t["generate"] = time.perf_counter() - t1
                ctx.sync()
                t["rollout"] = time.perf_counter() - t0
                batch, rollout, mask = _batch(he, outs, index, w.n, ctx.rank, None)
                t2 = time.perf_counter()
                logp = engine.log_probs(he.PPOBatch(input_ids=batch.input_ids))
                ctx.sync()
                t["log_probs"] = time.perf_counter() - t2
                recomputed = [logp[b, :len(batch.input_ids[b]) - 1].float().cpu() for b in range(len(rollout))]
                diff = torch.cat([(r - c)[m.bool()] for r, c, m in zip(rollout, recomputed, mask)])
                if not exact_mode:
                    batch = dataclasses.replace(batch, old_logprobs=recomputed)
                t3 = time.perf_counter()
                stats = engine.ppo_step(batch, ppo)
                ctx.sync()
                t["update"] = time.perf_counter() - t3
                t["step"] = t["rollout"] + t["update"] + (0.0 if exact_mode else t["log_probs"])
                t["trained_tokens"] = sum(len(i) for i in batch.input_ids)
                t["new_tokens"] = sum(len(m) - int((m == 0).sum()) for m in mask)
                t["diff"] = diff
                t["ppo_kl"] = stats["ppo_kl"]
                return t

            step(0)
            with ctx.peak() as pm:
                steps = [step(i) for i in range(1, 1 + w.steps)]
            case = dict(mode=mode, prompts=w.prompts, prompt=w.prompt, n=w.n, new_tokens=w.new_tokens)
            ctx.rec.add(BENCH, "hybridengine", model, {**case, "phase": "generate"}, "tokens_per_s",
                        [s["new_tokens"] / s["generate"] for s in steps])
            ctx.rec.add(BENCH, "hybridengine", model, {**case, "phase": "update"}, "tokens_per_s",
                        [s["trained_tokens"] / s["update"] for s in steps])
            ctx.rec.add(BENCH, "hybridengine", model, {**case, "phase": "log_probs"}, "seconds",
                        [s["log_probs"] for s in steps])
            ctx.rec.add(BENCH, "hybridengine", model, {**case, "phase": "step",
                                                       "recompute": not exact_mode}, "seconds",
                        [s["step"] for s in steps])
            diff = torch.cat([s["diff"] for s in steps]).abs().double()
            for stat, value in (("mean", diff.mean()), ("p99", diff.quantile(0.99) if diff.numel() < 2**24 else
                                                       diff.sort().values[int(0.99 * (diff.numel() - 1))]),
                                ("max", diff.max())):
                ctx.rec.add(BENCH, "hybridengine", model, {**case, "stat": stat}, "nats", float(value))
            ctx.rec.add(BENCH, "hybridengine", model, {**case, "stat": "equal"}, "fraction",
                        float((diff == 0).double().mean()))
            ctx.record_peak(pm, BENCH, "hybridengine", model, case)
            ctx.log(f"  {BENCH} {model} {mode}: |rollout - trainer| mean {diff.mean():.3g} max {diff.max():.3g}, "
                    f"{(diff == 0).double().mean():.1%} equal; first-step ppo_kl {steps[0]['ppo_kl']:.3g}")
            batch, _, _ = _batch(he, outs_for_determinism(engine, prompts, params), 0, w.n, ctx.rank, None)
            del engine
            release_memory()
            ctx.rec.add(BENCH, "hybridengine", model, {**case, "check": "deterministic"}, "fraction",
                        _determinism(he, model, ctx, w, exact_mode, batch, ppo))
            release_memory()


def outs_for_determinism(engine, prompts, params):
    """A rollout of the engine (its own log-probs as old_logprobs) for the determinism check's batch."""
    with engine.rollout():
        return engine.generate(prompts, params)


def _digest(t: torch.Tensor) -> tuple[int, int]:
    """Two wrapping int64 sums of a tensor's bits as integers, plain and position-weighted: equal tensors give
    equal digests; a changed bit changes them (barring a collision). In 64M-element chunks on the device."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    flat = t.detach().reshape(-1).view(ints)
    plain = weighted = 0
    for start in range(0, flat.numel(), 2**26):
        c = flat[start:start + 2**26].to(torch.int64)
        w = torch.arange(start, start + c.numel(), device=c.device, dtype=torch.int64) % 65521 + 1
        plain += int(c.sum())
        weighted += int((c * w).sum())
    return plain, weighted


def _determinism(he, model: str, ctx: Ctx, w: ExactWork, exact_mode: bool, batch, ppo) -> float:
    """Two fresh engines (same seed) run the same two ppo_steps: 1.0 when their weights and optimizer states
    are bitwise equal (by `_digest`), else 0.0."""
    digests = []
    for _ in range(2):
        engine = _engine(he, model, ctx, w, exact_mode)
        for _ in range(2):
            engine.ppo_step(batch, ppo)
        digests.append([_digest(t) for t in (engine.sharded.flat_buffer.data,
                                             *engine.trainer.optimizer.state_tensors())])
        del engine
        release_memory()
    ctx.log(f"  {BENCH} {model} {'exact' if exact_mode else 'default'}: two training runs "
            f"{'bitwise equal' if digests[0] == digests[1] else 'DIFFER'}")
    return float(digests[0] == digests[1])
