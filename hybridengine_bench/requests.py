"""The request API of issue 24 (suite `requests`): multi-turn sessions with prefix caching, partial rollouts
of a long-tailed GRPO step, and `step()` against `generate` per decode step. One GPU; random weights and
random token ids (no tokenizer, no downloads); sampling at temperature 1 with no stop token, so every
sample is exactly its `max_tokens` long. Each bench runs both sides on one engine in one run.

`multi_turn` (GPU_TURNS): 256 concurrent conversations (fewer with `--scale` below 1) of 4 turns, one
asyncio task each over `generate_async`; a turn's prompt is the conversation so far plus a new 128-token
observation, its reply 128 tokens. `EngineConfig.enable_prefix_caching` on, then off, on the same engine
(the setting is read when `rollout()` opens): per setting one rollout holding a warm-up pass (2 turns of
16-token replies) and the measured passes, each with fresh random ids, so no pass hits another's
blocks. Rows (case prefix_caching): `seconds` per pass; `tokens_per_s` count response (replies) and all
(every turn's prompt + reply); `tokens` count prompt (a pass's prompt tokens), prefix_cache_hit
(`engine.stats["prefix_cache_hit_tokens"]` gained in the pass) and prefilled (prompt - hit); `fraction`
count prefill_saved (hit / prompt); the peaks.

`long_tail` (GPU_TAIL): GRPO steps of 64 prompts (128 tokens) x 4 samples whose lengths are drawn from a
lognormal (median 128, sigma 1, clipped to [1, 1024]: ~2% of the samples reach 1024; HE_BENCH_TAIL=MEDIAN,
MAX_TOKENS sets other lengths), each step
    rollout (generate_async tasks) -> ppo_step on the finished samples (old log-probs: the rollout's)
with the rollout waiting for the longest sample (case rollout wait_longest) against stopping once 90% of
the samples in flight have finished and carrying the rest into the next rollout
(`rollout(keep_unfinished=True)`; case rollout partial; in steady state ~28 samples carried, ~256 trained per
step). Each sample is its own n = 1 request: SamplingParams holds one max_tokens per request (the prefix
cache shares a prompt's blocks between its 4 requests as a fork would). Step k draws the same prompts and
lengths in both settings; per setting one warm-up step (for the partial rollout, the one that fills the
carry), then the measured steps. Rows: `seconds` per step and per phase (rollout; update: the batch and
`ppo_step`; rollout_decode, rollout_graph_capture, rollout_decode_step: inside the rollout); `tokens_per_s`
count response and all (prompt + response tokens of the trained samples per second of step); `fraction`
count carried (samples carried out of a rollout / samples in it) and stale_tokens (trained tokens sampled
by an older policy version); the peaks.

`request_api` (GPU_STEP): 256 prompts of 128 tokens x 256 new tokens, three ways in one rollout: the batch
`generate` (case api generate), `add_request` of every prompt then a `step()` loop (api step, arrival
at_once), and the loop with the requests arriving in 8 groups of 32, a group every 4 steps (arrival
staggered; a step is a prefill or a decode, so each group's prefill is a step of its own between
decodes). Rows: `seconds` case timing decode_step (generate: `stats["decode_s"]` per decode step; step():
the wall time of a `step()` call, building its outputs included, over the calls where every request runs
and progressed and none has finished, averaged per loop) and timing call (the whole call or loop; at_once
does generate's work); `tokens_per_s` (new tokens per call); one pair of peaks (case api all). Each case
once as a warm-up, then the measured calls round-robin, each with fresh prompts.

CPU (the harness check, `--cpu`): tiny-qwen2, the CPU_* shapes, the same code paths.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
import math
import os
import statistics
import time
from dataclasses import dataclass

import torch
from tqdm import tqdm

from .common import Ctx, quantiles, release_memory


@dataclass(frozen=True)
class TurnWork:
    sessions: int
    turns: int
    observation: int
    reply: int

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens of one pass: turn t (1-based) prompts t observations and t - 1 replies."""
        return self.sessions * sum(t * self.observation + (t - 1) * self.reply for t in range(1, self.turns + 1))

    @property
    def context(self) -> int:
        return self.turns * (self.observation + self.reply)


@dataclass(frozen=True)
class TailWork:
    prompts: int
    n: int
    prompt: int
    median: int
    sigma: float
    max_tokens: int
    finish_fraction: float = 0.9


@dataclass(frozen=True)
class StepWork:
    seqs: int
    prompt: int
    new_tokens: int
    groups: int
    every: int
    """Steps between two arriving groups."""


GPU_TURNS = TurnWork(sessions=256, turns=4, observation=128, reply=128)
CPU_TURNS = TurnWork(sessions=4, turns=3, observation=16, reply=16)
GPU_TAIL = TailWork(prompts=64, n=4, prompt=128, median=128, sigma=1.0, max_tokens=1024)
TAIL_LENGTHS = os.environ.get("HE_BENCH_TAIL")
"""'MEDIAN,MAX_TOKENS' of the long tail's lengths instead of GPU_TAIL's 128,1024 (CPU_TAIL's on CPU); e.g.
512,4096: responses as long as reasoning RL's, where the rollout is most of the step. The rows' case holds both."""
CPU_TAIL = TailWork(prompts=4, n=4, prompt=8, median=6, sigma=1.0, max_tokens=32)
GPU_STEP = StepWork(seqs=256, prompt=128, new_tokens=256, groups=8, every=4)
CPU_STEP = StepWork(seqs=8, prompt=8, new_tokens=24, groups=4, every=2)


def _one_cpu_thread(bench):
    """On CPU (the tiny model), one intra-op thread for the bench: a decode step of 8 sequences took 13 ms with
    one thread against ~280 ms with two on a busy 2-core host."""

    @functools.wraps(bench)
    def run(ctx: Ctx) -> None:
        if ctx.cuda:
            return bench(ctx)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return bench(ctx)
        finally:
            torch.set_num_threads(threads)

    return run


def _engine(ctx: Ctx, model: str, **overrides):
    import hybridengine as he

    cfg = dict(dtype=torch.bfloat16 if ctx.cuda else torch.float32, device=str(ctx.device),
               gpu_memory_utilization=0.85)
    return he.HybridEngine(he.model_config(model), he.EngineConfig(**(cfg | overrides)))


def _models(ctx: Ctx, bench: str) -> list[str]:
    """The models to run, or none (and a not_run row) on several processes: these benches are one GPU's."""
    if ctx.world > 1:
        ctx.rec.not_run(bench, "hybridengine", None, "one GPU: run with --gpus 1")
        return []
    return ctx.models if ctx.cuda else ["tiny-qwen2"]


def _ids(vocab: int, shape: tuple[int, ...], seed: int) -> list:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed)).tolist()


def _hits(engine) -> int:
    return int(engine.stats.get("prefix_cache_hit_tokens", 0))


# -- multi-turn sessions: prefix caching on and off ----------------------------------------------------------

async def _conversation(engine, observations: list[list[int]], params) -> None:
    context: list[int] = []
    for obs in observations:
        context = context + obs
        out = await engine.generate_async(context, params)
        context = context + out.outputs[0].token_ids


def _sessions_pass(engine, w: TurnWork, seed: int) -> None:
    """Every session's turns, all sessions at once (one asyncio task each)."""
    import hybridengine as he

    obs = _ids(engine.vocab_size, (w.sessions, w.turns, w.observation), seed)
    params = he.SamplingParams(temperature=1.0, max_tokens=w.reply)

    async def run():
        await asyncio.gather(*(_conversation(engine, o, params) for o in obs))

    asyncio.run(run())


@_one_cpu_thread
def multi_turn(ctx: Ctx) -> None:
    bench = "multi_turn"
    if ctx.cuda:
        w = GPU_TURNS
        w = TurnWork(sessions=max(4, round(w.sessions * min(1.0, ctx.scale))), turns=w.turns,
                     observation=w.observation, reply=w.reply)
    else:
        w = CPU_TURNS
    warm = TurnWork(sessions=w.sessions, turns=min(2, w.turns), observation=w.observation, reply=min(16, w.reply))
    for model in _models(ctx, bench):
        # max_model_len twice the longest conversation: the cache (at most max_num_seqs x max_model_len) then
        # keeps every session's history while the last turns run, as a serving-sized cache would.
        engine = _engine(ctx, model, max_model_len=2 * w.context, max_num_seqs=w.sessions)
        summary = {}
        for caching in (True, False):
            engine.config.enable_prefix_caching = caching
            case = dict(sessions=w.sessions, turns=w.turns, observation=w.observation, reply=w.reply,
                        block_size=engine.config.block_size, prefix_caching=caching)
            times, hits = [], []
            with engine.rollout():
                _sessions_pass(engine, warm, seed=1)
                with ctx.peak() as pm:
                    for i in tqdm(range(ctx.reps(2)), desc=f"{bench} caching={caching}", disable=ctx.rank != 0,
                                  mininterval=5, leave=False):
                        before = _hits(engine)
                        times.append(ctx.timed(lambda: _sessions_pass(engine, w, seed=100 + i)))
                        hits.append(float(_hits(engine) - before))
            prompt = w.prompt_tokens
            response = w.sessions * w.turns * w.reply
            ctx.rec.add(bench, "hybridengine", model, case, "seconds", times)
            ctx.rec.add(bench, "hybridengine", model, {**case, "count": "response"}, "tokens_per_s",
                        [response / t for t in times])
            ctx.rec.add(bench, "hybridengine", model, {**case, "count": "all"}, "tokens_per_s",
                        [(prompt + response) / t for t in times])
            ctx.rec.add(bench, "hybridengine", model, {**case, "count": "prompt"}, "tokens", float(prompt))
            ctx.rec.add(bench, "hybridengine", model, {**case, "count": "prefix_cache_hit"}, "tokens", hits)
            ctx.rec.add(bench, "hybridengine", model, {**case, "count": "prefilled"}, "tokens",
                        [prompt - h for h in hits])
            ctx.rec.add(bench, "hybridengine", model, {**case, "count": "prefill_saved"}, "fraction",
                        [h / prompt for h in hits])
            ctx.record_peak(pm, bench, "hybridengine", model, case)
            summary[caching] = quantiles(times)[1]
            ctx.log(f"  {bench} {model} prefix_caching={caching}: {summary[caching]:.2f} s/pass, "
                    f"{response / summary[caching]:,.0f} reply tok/s, prefill saved "
                    f"{quantiles(hits)[1] / prompt:.1%} of {prompt:,} prompt tokens, peak nvml {pm.nvml_gib:.1f} GiB")
        ctx.log(f"  {bench} {model}: caching on is {summary[False] / summary[True]:.2f}x re-prefilling every turn")
        del engine
        release_memory()


# -- long-tail GRPO steps: partial rollouts against waiting for the longest ----------------------------------

def _tail_lengths(text: str) -> dict[str, int]:
    """HE_BENCH_TAIL's 'MEDIAN,MAX_TOKENS' as TailWork fields."""
    parts = text.split(",")
    if len(parts) != 2 or not all(p.strip().isdigit() and int(p) > 0 for p in parts) or int(parts[0]) > int(parts[1]):
        raise ValueError(f"HE_BENCH_TAIL must be 'MEDIAN,MAX_TOKENS', two positive integers with MEDIAN <= "
                         f"MAX_TOKENS, got {text!r}")
    return dict(median=int(parts[0]), max_tokens=int(parts[1]))


def _lengths(w: TailWork, seed: int) -> list[int]:
    """Per-sample max_tokens: lognormal around the median, clipped to [1, max_tokens]."""
    z = torch.randn(w.prompts * w.n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return (w.median * torch.exp(w.sigma * z)).round().clamp(1, w.max_tokens).long().tolist()


def _tail_batch(outs: list, step: int, version: int):
    """A PPOBatch of finished samples (random +-1 advantages, the rollout's log-probs as the old ones) and
    (prompt tokens, response tokens, stale response tokens)."""
    import hybridengine as he

    g = torch.Generator().manual_seed(step)
    signs = (torch.randint(0, 2, (len(outs),), generator=g) * 2 - 1).tolist()
    ids, mask, old, adv = [], [], [], []
    prompt_tokens = response_tokens = stale = 0
    for out, sign in zip(outs, signs):
        p, c = out.prompt_token_ids, out.outputs[0]
        ids.append(torch.tensor(p + c.token_ids))
        m = torch.zeros(len(p) + len(c.token_ids) - 1)
        m[len(p) - 1:] = 1
        o = torch.zeros_like(m)
        o[len(p) - 1:] = torch.tensor(c.logprobs)
        mask.append(m), old.append(o), adv.append(m * sign)
        prompt_tokens += len(p)
        response_tokens += len(c.token_ids)
        stale += sum(v < version for v in c.policy_versions)
    return he.PPOBatch(input_ids=ids, response_mask=mask, old_logprobs=old, advantages=adv), (
        prompt_tokens, response_tokens, stale)


async def _tail_steps(ctx: Ctx, engine, w: TailWork, partial: bool, num_steps: int, desc: str) -> list[dict]:
    """num_steps GRPO steps; one dict of readings per step. Steps are numbered from 0 in both settings, so
    step k draws the same prompts and lengths in each."""
    import hybridengine as he

    ppo = he.PPOConfig(lr=1e-6, clip_low=0.2, clip_high=0.28, micro_batch_tokens=16384)
    carried: list[asyncio.Task] = []
    readings = []
    for k in tqdm(range(num_steps), desc=desc, disable=ctx.rank != 0, mininterval=5, leave=False):
        prompts = _ids(engine.vocab_size, (w.prompts, w.prompt), seed=1000 + k)
        lengths = _lengths(w, seed=2000 + k)
        ctx.sync()
        t0 = time.perf_counter()
        with engine.rollout(keep_unfinished=partial):
            tasks = [asyncio.create_task(engine.generate_async(
                prompts[i // w.n], he.SamplingParams(temperature=1.0, max_tokens=length)))
                for i, length in enumerate(lengths)]
            live = carried + tasks
            if partial:
                target = math.ceil(w.finish_fraction * len(live))
                pending = {t for t in live if not t.done()}
                while sum(t.done() for t in live) < target:
                    _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            else:
                await asyncio.wait(live)
        # A task whose request finished in the rollout's last step resumes at the next await: it is trained
        # in the next step.
        ctx.sync()
        t1 = time.perf_counter()
        stats = engine.stats
        inside = dict(rollout_decode=stats["rollout_decode_s"],
                      rollout_graph_capture=stats["rollout_cuda_graph_capture_s"],
                      rollout_decode_step=stats["rollout_decode_s"] / max(1, stats["rollout_steps"]))
        finished = [t.result() for t in live if t.done()]
        carried = [t for t in live if not t.done()]
        batch, (prompt_tokens, response_tokens, stale) = _tail_batch(finished, k, engine.policy_version)
        engine.ppo_step(batch, ppo)
        engine.prepare_rollout()
        ctx.sync()
        t2 = time.perf_counter()
        rollout_s, update_s, *inside_s = ctx.slowest([t1 - t0, t2 - t1, *inside.values()])
        readings.append(dict(zip(inside, inside_s), rollout=rollout_s, update=update_s, step=rollout_s + update_s,
                             samples=len(finished),
                             prompt_tokens=prompt_tokens, response_tokens=response_tokens,
                             carried=len(carried) / len(live), stale=stale / max(1, response_tokens)))
    if carried:  # drop the requests still kept: a rollout left without keep_unfinished aborts them
        with engine.rollout():
            pass
        await asyncio.gather(*carried)
    return readings


@_one_cpu_thread
def long_tail(ctx: Ctx) -> None:
    bench = "long_tail"
    w = GPU_TAIL if ctx.cuda else CPU_TAIL
    if TAIL_LENGTHS:
        w = dataclasses.replace(w, **_tail_lengths(TAIL_LENGTHS))
    for model in _models(ctx, bench):
        # Room for a step's samples and the carried ones at once (~284 in steady state on a GPU).
        engine = _engine(ctx, model, max_model_len=w.prompt + w.max_tokens, max_num_seqs=2 * w.prompts * w.n)
        summary = {}
        for partial in (False, True):
            name = "partial" if partial else "wait_longest"
            case = dict(prompts=w.prompts, samples=w.n, prompt=w.prompt, lengths="lognormal", median=w.median,
                        sigma=w.sigma, max_tokens=w.max_tokens, rollout=name)
            if partial:
                case["finish_fraction"] = w.finish_fraction
            measured = ctx.reps(2)  # a 7B step takes ~10-16 s: 3 steps per setting keep the suite near 4 min
            with ctx.peak() as pm:
                # Step 0 (compilation, the optimizer state; the partial rollout's first carry) is the warm-up;
                # the peak covers it too.
                steps = asyncio.run(_tail_steps(ctx, engine, w, partial, 1 + measured, f"{bench} {name}"))[1:]
            # rollout_decode: its decode iterations (host bookkeeping included), rollout_graph_capture: lazy CUDA
            # graph captures, rollout_decode_step: seconds per decode iteration; the rest of the rollout is
            # prefill (carried requests' recompute included), entry and exit.
            for phase in ("rollout", "update", "rollout_decode", "rollout_graph_capture", "rollout_decode_step"):
                ctx.rec.add(bench, "hybridengine", model, {**case, "phase": phase}, "seconds",
                            [s[phase] for s in steps])
            times = [s["step"] for s in steps]
            ctx.rec.add(bench, "hybridengine", model, case, "seconds", times)
            ctx.rec.add(bench, "hybridengine", model, {**case, "count": "response"}, "tokens_per_s",
                        [s["response_tokens"] / s["step"] for s in steps])
            ctx.rec.add(bench, "hybridengine", model, {**case, "count": "all"}, "tokens_per_s",
                        [(s["prompt_tokens"] + s["response_tokens"]) / s["step"] for s in steps])
            ctx.rec.add(bench, "hybridengine", model, {**case, "count": "carried"}, "fraction",
                        [s["carried"] for s in steps])
            ctx.rec.add(bench, "hybridengine", model, {**case, "count": "stale_tokens"}, "fraction",
                        [s["stale"] for s in steps])
            ctx.record_peak(pm, bench, "hybridengine", model, case)
            summary[partial] = quantiles(times)[1]
            ctx.log(f"  {bench} {model} {name}: {summary[partial]:.2f} s/step (rollout "
                    f"{quantiles([s['rollout'] for s in steps])[1]:.2f} s, update "
                    f"{quantiles([s['update'] for s in steps])[1]:.2f} s), "
                    f"{quantiles([s['samples'] for s in steps])[1]:.0f} samples trained, carried "
                    f"{quantiles([s['carried'] for s in steps])[1]:.1%}, stale tokens "
                    f"{quantiles([s['stale'] for s in steps])[1]:.1%}")
        ctx.log(f"  {bench} {model}: partial rollouts {summary[False] / summary[True]:.2f}x waiting for the longest")
        del engine
        release_memory()


# -- the request API's cost per decode step --------------------------------------------------------------

def _step_loop(engine, prompts: list[list[int]], params, groups: int, every: int, tag: str) -> list[float]:
    """add_request the prompts (ids tag-0, tag-1, ...) in `groups` groups, one every `every` steps, and step
    until every request has finished; returns the wall seconds of each step() in which every request was
    running and had progressed and none had finished."""
    size = math.ceil(len(prompts) / groups)
    chunks = [prompts[i:i + size] for i in range(0, len(prompts), size)]
    last_add = (len(chunks) - 1) * every
    full, added, finished = [], 0, 0
    for k in itertools.count():
        if k % every == 0 and k // every < len(chunks):
            for prompt in chunks[k // every]:
                engine.add_request(f"{tag}-{added}", prompt, params)
                added += 1
        if not engine.has_unfinished_requests():
            break
        ts = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - ts
        done = sum(o.finished for o in outs)
        # From the second step after the last prefill: the one right after it reports nothing (async decode).
        if k > last_add + 1 and finished == 0 and done == 0 and len(outs) == len(prompts):
            full.append(dt)
        finished += done
    return full


@_one_cpu_thread
def request_api(ctx: Ctx) -> None:
    import hybridengine as he

    bench = "request_api"
    w = GPU_STEP if ctx.cuda else CPU_STEP
    cases = [dict(api="generate"), dict(api="step", arrival="at_once", output_kind="cumulative"),
             dict(api="step", arrival="at_once", output_kind="delta"),
             dict(api="step", arrival="staggered", output_kind="delta", groups=w.groups, every_steps=w.every)]
    for model in _models(ctx, bench):
        # One prefill for generate's whole batch, so its decode steps are its steps but one; max_model_len as
        # in bench generate.
        engine = _engine(ctx, model, max_model_len=max(1024, w.prompt + w.new_tokens) if ctx.cuda else 64,
                         max_num_seqs=w.seqs,
                         max_num_batched_tokens=max(16384, w.seqs * w.prompt))
        params = he.SamplingParams(temperature=1.0, max_tokens=w.new_tokens)
        calls = {i: [] for i in range(len(cases))}
        steps = {i: [] for i in range(len(cases))}
        measured = ctx.reps(3)
        with engine.rollout():
            with ctx.peak() as pm:
                for rep in tqdm(range(1 + measured), desc=bench, disable=ctx.rank != 0, mininterval=5, leave=False):
                    for i, case in enumerate(cases):  # round-robin: drift hits every case alike
                        prompts = _ids(engine.vocab_size, (w.seqs, w.prompt), seed=10 * rep + i)
                        ctx.sync()
                        t0 = time.perf_counter()
                        if case["api"] == "generate":
                            engine.generate(prompts, params)
                            decode = [engine.stats["decode_s"] / max(1, engine.stats["steps"] - 1)]
                        else:
                            kind = dataclasses.replace(params, output_kind=case["output_kind"])
                            full = _step_loop(engine, prompts, kind, case.get("groups", 1),
                                                 case.get("every_steps", 1), tag=f"{rep}.{i}")
                            decode = [statistics.fmean(full)] if full else []
                        ctx.sync()
                        if rep:  # rep 0: warm-up (compilation, each batch size's CUDA graph)
                            calls[i].append(time.perf_counter() - t0)
                            steps[i] += decode
        ctx.record_peak(pm, bench, "hybridengine", model, dict(seqs=w.seqs, prompt=w.prompt, new_tokens=w.new_tokens,
                                                               api="all"))
        base = None
        for i, case in enumerate(cases):
            row = dict(seqs=w.seqs, prompt=w.prompt, new_tokens=w.new_tokens, **case)
            ctx.rec.add(bench, "hybridengine", model, {**row, "timing": "call"}, "seconds", calls[i])
            ctx.rec.add(bench, "hybridengine", model, row, "tokens_per_s",
                        [w.seqs * w.new_tokens / t for t in calls[i]])
            if not steps[i]:
                ctx.rec.not_run(bench, "hybridengine", model, "no decode step with every request running",
                                **row, timing="decode_step")
                continue
            ctx.rec.add(bench, "hybridengine", model, {**row, "timing": "decode_step"}, "seconds", steps[i])
            step = quantiles(steps[i])[1]
            base = step if base is None else base
            ctx.log(f"  {bench} {model} {case}: decode step {step * 1e3:.2f} ms ({step / base:.3f}x generate's), "
                    f"call {quantiles(calls[i])[1]:.2f} s")
        del engine
        release_memory()
