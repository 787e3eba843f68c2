"""Optimizer-state offload (`EngineConfig.offload`, issue 25), bench `offload`. Default model: Qwen2-7B shapes.

`offload_rollout` (one engine, offload='rollout'; 'none' is the same engine with the offload switched
off in its config, so both see the same weights, optimizer state and allocator):
- part kv_capacity: the KV cache `rollout()` can hold after a `ppo_step` (the optimizer state exists),
  offload 'rollout' against 'none': GiB and tokens (on CUDA the 'rollout' cache starts in the memory
  free at entry, count kv_tokens_at_entry, and grows into the state's memory when it is full;
  big_rollout's kv_GiB_at_exit shows a rollout that grew), `memory_report()` inside the rollout (rows
  with case source memory_report), the time the rollout's entry waited for the copies out
  (offload_wait).
- part grpo_step: bench ppo_e2e's workload (32 prompts x 4 samples x 256 new tokens per GPU, log-probs,
  one update) with each setting: seconds per step and per phase, tokens/s; the transfers' share of
  the step is (step 'rollout' - step 'none') / step 'none'. Each phase ends in a device-wide sync but
  log_probs, which waits for its own stream only (a trainer reads the log-probs; the state's copy back
  runs on under the update, whose sync ends the step). Rows with case key `transfer` say where the
  transfers' time goes (TRANSFERS: host seconds of the calls that start each direction, device seconds
  of the copies); they are inside the phases, not added to the step.
- part big_rollout: ROLLOUT (HE_BENCH_OFFLOAD_ROLLOUT, default 512x2048: sequences x new tokens, 128-token
  prompts) with offload 'rollout', against the largest batch whose KV fits the 'none' cache (no
  preemption) with offload 'none': generate seconds, response tokens/s, preempted sequences.

`offload_optimizer` (engines with offload 'none' and 'optimizer', or HE_BENCH_OFFLOAD_MODES): the most
tokens per micro-batch a training step takes without activation checkpointing (sequences of SEQ tokens,
one micro-batch; TOKEN_LADDER climbed up to the first out-of-memory), and tokens/s and peak memory at each
count that ran: rows `tokens` (the most that ran; count first_failed: the rung that failed) and
`tokens_per_s` / `seconds` / `peak_GiB` per count.

`offload_deepspeed`: DeepSpeed ZeRO-3 with `offload_optimizer: cpu` (its CPU Adam, pinned host memory)
on the same ladder of micro-batches (HF forward with labels: full logits), most tokens and tokens/s.
GPU only. Mind the host: ZeRO-Offload keeps 16 B per parameter there (fp32 master, moments, grads), 113 GiB
for Qwen2-7B, so on a host where that passes HOST_FRACTION of the available memory (the 1-GPU machine's
128 GiB) the bench records not_run rather than pinning it. Suite `offload_zero` runs `offload_optimizer` and
`offload_deepspeed` on one model in one run: `--suite offload_zero --model qwen2.5-1.5b` there.

CPU (the harness check): tiny-qwen2, a tiny workload and a short ladder; the CPU KV cache is sized
without looking at free memory, so kv_capacity is the same for both settings there.
"""

from __future__ import annotations

import os
import statistics
import time

import torch

from .common import Ctx, quantiles, release_memory
from .e2e import CPU_E2E, GPU_E2E, E2EWork

BENCH = "offload"
ROLLOUT = os.environ.get("HE_BENCH_OFFLOAD_ROLLOUT", "512x2048")
"""The big rollout: sequences x new tokens per GPU (scale it down, e.g. 128x1024, for a quick pass)."""
PARTS = tuple(os.environ.get("HE_BENCH_OFFLOAD_PARTS", "grpo_step,big_rollout").split(","))
"""The parts of offload_rollout that run after kv_capacity, which always does (a quick pass: PARTS empty)."""
PROMPT = 128
SEQ = 1024
"""Tokens per training sequence in the micro-batch ladder."""
KV_SEQS = 1024
"""max_num_seqs while the KV capacity is measured: with max_model_len 4096 the cap on the cache (what
running sequences can hold, 240 GB at 7B) does not bind, so the cache gets what memory leaves."""
TOKEN_LADDER = (2048, 4096, 8192, 10240, 12288, 14336, 16384, 20480, 24576, 28672, 32768, 40960, 49152, 65536,
                98304, 131072)
"""Tokens per micro-batch, climbed until the first step that runs out of memory. Nothing runs after a
failure: in one process, rungs run after an out-of-memory step were seen to peak about 25 GiB higher than
the same step in a fresh process (docs/memory.md), so a bisection below the failure would measure that."""
CPU_LADDER = (32, 64)
MODES = tuple(os.environ.get("HE_BENCH_OFFLOAD_MODES", "none,optimizer").split(","))
"""The offload modes offload_optimizer climbs the ladder with, in one process; on the GPU run each in its
own (`HE_BENCH_OFFLOAD_MODES=none`, then `=optimizer`, under one run id), since each ends in a failure."""


def _engine(ctx: Ctx, model: str, offload: str, **overrides):
    import hybridengine as he

    cfg = dict(dtype=torch.bfloat16 if ctx.cuda else torch.float32, device=str(ctx.device), offload=offload,
               gpu_memory_utilization=0.9)
    cfg.update(overrides)
    return he.HybridEngine(he.model_config(model), he.EngineConfig(**cfg))


def _batch(vocab: int, lengths: list[int], seed: int):
    import hybridengine as he

    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, vocab, (n,), generator=g) for n in lengths]
    return he.PPOBatch(input_ids=ids, response_mask=[torch.ones(n - 1) for n in lengths],
                       old_logprobs=[-5 + 0.1 * torch.randn(n - 1, generator=g) for n in lengths],
                       advantages=[torch.randn(n - 1, generator=g) for n in lengths])


def _models(ctx: Ctx) -> list[str]:
    return ctx.models if ctx.cuda else ["tiny-qwen2"]


# -- rollout: KV capacity, the GRPO step, a rollout that needs the memory -----------------------------

def offload_rollout(ctx: Ctx) -> None:
    import hybridengine as he

    unknown = set(PARTS) - {"", "grpo_step", "big_rollout"}
    if unknown:
        raise ValueError(f"HE_BENCH_OFFLOAD_PARTS names grpo_step and big_rollout (comma-separated, or empty), got "
                         f"{sorted(unknown)}")
    w: E2EWork = GPU_E2E if ctx.cuda else CPU_E2E
    seqs, new_tokens = (int(x) for x in ROLLOUT.lower().split("x")) if ctx.cuda else (8, 8)
    for model in _models(ctx):
        engine = _engine(ctx, model, "rollout", max_num_seqs=KV_SEQS if ctx.cuda else 16,
                         max_model_len=max(4096 if ctx.cuda else 64, PROMPT + new_tokens, w.prompt + w.new_tokens))
        vocab = engine.vocab_size
        ppo = he.PPOConfig(lr=1e-6, clip_low=0.2, clip_high=0.28, micro_batch_tokens=16384)
        engine.ppo_step(_batch(vocab, [w.prompt + w.new_tokens] * 4, 1 + ctx.rank), ppo)  # the state exists
        capacity = {}
        for mode in ("none", "rollout"):
            engine.config.offload = mode
            release_memory()
            ctx.sync()
            with engine.rollout():
                report = engine.memory_report()
            stats = dict(engine.stats)
            engine.trainer.optimizer.state_location()  # (`trainer`: a training call's hook brings the state back)
            case = dict(part="kv_capacity", offload=mode)
            # what the cache holds, or (on CUDA with 'rollout') grows to when it is full: big_rollout's
            # kv_GiB_at_exit shows a rollout that grew into it
            capacity[mode] = stats["kv_blocks"] * engine.config.block_size
            ctx.rec.add(BENCH, "hybridengine", model, case, "GiB", ctx.slowest([report["kv_cache_capacity"]])[0])
            ctx.rec.add(BENCH, "hybridengine", model, {**case, "count": "kv_tokens_at_entry"}, "tokens",
                        float(-ctx.slowest([-stats["kv_blocks_at_entry"] * engine.config.block_size])[0]))
            ctx.rec.add(BENCH, "hybridengine", model, {**case, "count": "kv_tokens"}, "tokens",
                        float(-ctx.slowest([-capacity[mode]])[0]))  # the smallest rank's
            for key, value in report.items():
                ctx.rec.add(BENCH, "hybridengine", model, {**case, "source": "memory_report", "key": key}, "GiB",
                            float(value))
            if mode == "rollout":
                ctx.rec.add(BENCH, "hybridengine", model, {**case, "phase": "offload_wait"}, "seconds",
                            ctx.slowest([stats.get("offload_wait_s", 0.0)])[0])
            ctx.log(f"  {BENCH} kv_capacity {model} offload={mode}: KV {report['kv_cache_capacity']:.1f} GiB "
                    f"({capacity[mode]:,} tokens; {stats['kv_blocks_at_entry'] * engine.config.block_size:,} "
                    f"at entry), optimizer on device {report['optimizer']:.1f} GiB, host "
                    f"{report['host_optimizer']:.1f} GiB")
        ctx.log(f"  {BENCH} kv_capacity {model}: rollout/none = {capacity['rollout'] / capacity['none']:.2f}x")
        if "grpo_step" in PARTS:
            _grpo_steps(ctx, engine, model, w, ppo)
        if "big_rollout" in PARTS:
            _big_rollout(ctx, engine, model, seqs, new_tokens, capacity["none"])
        del engine
        release_memory()


TRANSFERS = ("offload_start_out_s", "offload_copy_out_s", "offload_start_back_s", "offload_copy_back_s")
"""engine.stats of offload 'rollout' (noted where a rollout joins or drops the copy out): host seconds of the
calls that start each direction (allocation, launch) and device seconds of the copies (CUDA)."""


def _transfers(engine) -> dict[str, float]:
    return {k: engine.stats[k] for k in TRANSFERS if k in engine.stats}


def _grpo_steps(ctx: Ctx, engine, model: str, w: E2EWork, ppo) -> None:
    """bench ppo_e2e's step with each offload setting (the same engine)."""
    import hybridengine as he

    from .e2e import train_on

    g = torch.Generator().manual_seed(7 + ctx.rank)
    prompts = torch.randint(0, engine.vocab_size, (w.prompts, w.prompt), generator=g).tolist()
    params = he.SamplingParams(n=w.n, temperature=1.0, max_tokens=w.new_tokens)
    max_num_seqs = engine.config.max_num_seqs
    engine.config.max_num_seqs = w.prompts * w.n

    def step(index: int, grow: bool) -> tuple[dict[str, float], dict[str, float]]:
        """(the step's phases, the offload's transfer costs that this rollout noted: see TRANSFERS).
        `grow`: a filler holds all but FORCED_KV_GIB of the free memory while the rollout sizes its cache,
        and is freed right after, so that the rollout's cache fills and grows into the state's memory."""
        t = {}
        filler = _filler(engine) if grow else None
        ctx.sync()
        t0 = time.perf_counter()
        with engine.rollout():
            filler = None  # noqa: F841 - back to torch's allocator: the cache's growth frees it to the driver
            t["enter"] = time.perf_counter() - t0
            t1 = time.perf_counter()
            outs = engine.generate(prompts, params)
            ctx.sync()
            t["generate"] = time.perf_counter() - t1
            t2 = time.perf_counter()
        ctx.sync()
        t["exit"] = time.perf_counter() - t2
        transfers = _transfers(engine)
        train_on(ctx, engine, outs, index, w.n, ppo, t)  # with prepare_rollout(): offload starts there
        return dict(zip(t, ctx.slowest(list(t.values())))), transfers

    medians = {}
    for mode, grow in (("none", False), ("rollout", False), ("rollout", True)):
        if grow and not engine._offload.cache_grows():
            continue  # the cache cannot grow here (off CUDA): 'rollout' above is the whole story
        engine.config.offload = mode
        for k in (*TRANSFERS, "kv_grow_s"):
            engine.stats.pop(k, None)
        step(0, grow)  # warm-up: this setting's first transfer, CUDA graphs of the batch
        with ctx.peak() as pm:
            steps, transfers = zip(*[step(i, grow) for i in range(1, 1 + ctx.reps(3))])
        with engine.rollout():  # untimed: notes the last step's copy back (a growing cache: at its exit)
            engine.generate(prompts[:1], he.SamplingParams(max_tokens=2))
        transfers += (_transfers(engine),)
        case = dict(part="grpo_step", offload=mode, prompts_per_gpu=w.prompts, prompt=w.prompt, samples=w.n,
                    new_tokens=w.new_tokens, **({"kv": f"grows from {FORCED_KV_GIB} GiB"} if grow else {}))
        label = mode + (" (cache grows)" if grow else "")
        totals = [sum(s.values()) for s in steps]
        tokens = ctx.world * w.prompts * w.n * (w.prompt + w.new_tokens)
        ctx.rec.add(BENCH, "hybridengine", model, case, "seconds", totals)
        ctx.rec.add(BENCH, "hybridengine", model, {**case, "count": "all"}, "tokens_per_s",
                    [tokens / t for t in totals])
        for phase in steps[0]:
            ctx.rec.add(BENCH, "hybridengine", model, {**case, "phase": phase}, "seconds", [s[phase] for s in steps])
        ctx.record_peak(pm, BENCH, "hybridengine", model, case)
        for key in TRANSFERS:  # the step's phases hold them; these say where (not added to the step)
            values = [x[key] for x in transfers if key in x]
            if values:
                ctx.rec.add(BENCH, "hybridengine", model, {**case, "transfer": key[:-2]}, "seconds",
                            ctx.slowest([statistics.median(values)]))
        if "kv_grow_s" in engine.stats:
            ctx.rec.add(BENCH, "hybridengine", model, {**case, "phase": "kv_grow"}, "seconds",
                        ctx.slowest([engine.stats["kv_grow_s"]]))
        medians[label] = quantiles(totals)[1]
        split = ", ".join(f"{p} {quantiles([s[p] for s in steps])[1]:.3g} s" for p in steps[0])
        moved = ", ".join(f"{k[:-2]} {statistics.median([x[k] for x in transfers if k in x]):.3g} s"
                          for k in TRANSFERS if any(k in x for x in transfers))
        ctx.log(f"  {BENCH} grpo_step {model} offload={label}: {medians[label]:.2f} s ({split})"
                + (f"; transfers: {moved}" if moved else ""))
    for label in medians:
        if label != "none":
            ctx.log(f"  {BENCH} grpo_step {model}: offload={label} adds {medians[label] / medians['none'] - 1:+.1%} "
                    "to the step")
    engine.config.max_num_seqs = max_num_seqs


FORCED_KV_GIB = 0.5
"""grpo_step's growing variant: the GiB the rollout's cache starts with (the step's KV needs more)."""


def _filler(engine):
    """A tensor holding all but FORCED_KV_GIB of what the next rollout's cache could take now (None when
    that is already less)."""
    from hybridengine.rollout.kv_cache import cuda_budget

    torch.cuda.empty_cache()
    spare = cuda_budget(engine.config, engine.model.config, engine.device) - int(FORCED_KV_GIB * 2**30)
    return torch.empty(spare, dtype=torch.uint8, device=engine.device) if spare > 0 else None


def _big_rollout(ctx: Ctx, engine, model: str, seqs: int, new_tokens: int, none_tokens: int) -> None:
    """ROLLOUT with offload 'rollout' against the largest batch the 'none' cache holds whole."""
    import hybridengine as he

    fits = max(1, none_tokens // (PROMPT + new_tokens + engine.config.block_size))
    g = torch.Generator().manual_seed(11 + ctx.rank)
    for mode, batch in (("none", min(fits, seqs)), ("rollout", seqs)):
        engine.config.offload = mode
        engine.config.max_num_seqs = batch
        prompts = torch.randint(0, engine.vocab_size, (batch, PROMPT), generator=g).tolist()
        params = he.SamplingParams(temperature=1.0, max_tokens=new_tokens)  # no stop tokens: every one runs out

        def run():
            with engine.rollout():
                t0 = time.perf_counter()
                outs = engine.generate(prompts, params)
                ctx.sync()
                elapsed = time.perf_counter() - t0
            stats = dict(engine.stats)
            engine.trainer  # noqa: B018 - a training call's hook: the state comes back
            return elapsed, sum(len(s.token_ids) for o in outs for s in o.outputs), stats

        with ctx.peak() as pm:
            runs = [run() for _ in range(ctx.reps(1))]
        times = ctx.slowest([r[0] for r in runs])
        tokens = runs[0][1]
        case = dict(part="big_rollout", offload=mode, seqs_per_gpu=batch, prompt=PROMPT, new_tokens=new_tokens,
                    kv_GiB=round(runs[0][2]["kv_cache_GiB"], 2),
                    kv_GiB_at_exit=round(runs[0][2]["kv_cache_GiB"] * runs[0][2]["rollout_kv_blocks"]
                                         / runs[0][2]["kv_blocks"], 2))
        ctx.rec.add(BENCH, "hybridengine", model, case, "seconds", times)
        ctx.rec.add(BENCH, "hybridengine", model, {**case, "count": "response"}, "tokens_per_s",
                    [ctx.world * tokens / t for t in times])
        ctx.rec.add(BENCH, "hybridengine", model, {**case, "count": "preemptions"}, "tokens",
                    float(runs[0][2].get("preemptions", 0)))
        ctx.record_peak(pm, BENCH, "hybridengine", model, case)
        ctx.log(f"  {BENCH} big_rollout {model} offload={mode}: {batch} x {new_tokens} in {quantiles(times)[1]:.1f} s, "
                f"{ctx.world * tokens / quantiles(times)[1]:,.0f} tok/s (KV {runs[0][2]['kv_cache_GiB']:.1f} GiB)")


# -- optimizer offload: the largest micro-batch a step takes -------------------------------------------

def _is_oom(err: BaseException) -> bool:
    return isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower()


def _ladder(ctx: Ctx, try_step) -> tuple[int, dict[int, list[float]], int | None]:
    """The ladder's token counts in order until the first failure for memory: (the most tokens that ran,
    {tokens: seconds per step}, the first count that failed or None)."""
    ladder = TOKEN_LADDER if ctx.cuda else CPU_LADDER
    ran: dict[int, list[float]] = {}
    for tokens in ladder:
        times = try_step(tokens)
        if times is None:
            return (max(ran) if ran else 0), ran, tokens
        ran[tokens] = times
    return (max(ran) if ran else 0), ran, None


def offload_optimizer(ctx: Ctx) -> None:
    import hybridengine as he

    unknown = set(MODES) - {"none", "rollout", "optimizer"}
    if unknown or not MODES:
        raise ValueError(f"HE_BENCH_OFFLOAD_MODES names offload modes (none, rollout, optimizer; comma-separated), "
                         f"got {sorted(unknown) or MODES}")
    seq = SEQ if ctx.cuda else 16
    for model in _models(ctx):
        most = {}
        for mode in MODES:
            engine = _engine(ctx, model, mode)
            vocab = engine.vocab_size

            def try_step(tokens: int):
                batch = _batch(vocab, [seq] * (tokens // seq), 3 + ctx.rank)
                ppo = he.PPOConfig(lr=1e-6, max_grad_norm=1.0, micro_batch_tokens=tokens,
                                   activation_checkpointing=False)
                try:
                    with ctx.peak() as pm:
                        times = ctx.measure(lambda: engine.ppo_step(batch, ppo), warmup=1, repeats=3,
                                            desc=f"offload {mode} {tokens}")
                    peaks[tokens] = pm
                    return times
                except Exception as err:  # noqa: BLE001 - out of memory ends the ladder; anything else is a failure
                    if not _is_oom(err):
                        raise
                    ctx.log(f"  {BENCH} optimizer {model} offload={mode}: {tokens} tokens out of memory")
                    return None
                finally:
                    del batch
                    release_memory()

            peaks = {}  # per rung that ran: the peak, so base + slope x tokens shows what binds each mode
            most[mode], ran, failed = _ladder(ctx, try_step)
            case = dict(part="max_micro_batch", offload=mode, seq=seq, activation_checkpointing=False)
            ctx.rec.add(BENCH, "hybridengine", model, case, "tokens", float(most[mode]))
            if failed is not None:
                ctx.rec.add(BENCH, "hybridengine", model, {**case, "count": "first_failed"}, "tokens", float(failed))
            for tokens, times in sorted(ran.items()):
                c = {**case, "tokens_per_gpu": tokens}
                ctx.rec.add(BENCH, "hybridengine", model, c, "seconds", times)
                ctx.rec.add(BENCH, "hybridengine", model, c, "tokens_per_s", [ctx.world * tokens / t for t in times])
                ctx.record_peak(peaks[tokens], BENCH, "hybridengine", model, c)
                ctx.log(f"  {BENCH} optimizer {model} offload={mode} {tokens} tokens: {quantiles(times)[1]:.2f} s, "
                        f"{ctx.world * tokens / quantiles(times)[1]:,.0f} tok/s")
            report = engine.memory_report()
            for key in ("parameters_shard", "gradients", "optimizer", "host_optimizer", "host_pinned_total"):
                ctx.rec.add(BENCH, "hybridengine", model, {**case, "source": "memory_report", "key": key}, "GiB",
                            float(report[key]))
            del engine
            release_memory()
        if most.get("none") and "optimizer" in most:
            ctx.log(f"  {BENCH} optimizer {model}: most tokens optimizer/none = "
                    f"{most['optimizer'] / most['none']:.2f}x")


HOST_FRACTION = 0.8
"""ZeRO-Offload runs only where its host state takes at most this share of the available host memory: past
it, pinning the state can take the machine's memory from under the process."""


def _zero_offload_host_bytes(model: str) -> int:
    """ZeRO-Offload's host state for the whole model: fp32 master, two fp32 moments and fp32 gradients (16 B
    per parameter); with several ranks on one host each holds its shard, the sum is the same."""
    import hybridengine as he
    from hybridengine.model.config import ModelConfig
    from hybridengine.model.decoder import CausalLM

    meta = CausalLM(ModelConfig.from_hf(he.model_config(model)), dtype=torch.bfloat16, device="meta")
    return 16 * sum(p.numel() for p in meta.parameters())


def offload_deepspeed(ctx: Ctx) -> None:
    """DeepSpeed ZeRO-3 with offload_optimizer: cpu on the micro-batch ladder (GPU only)."""
    if not ctx.cuda:
        ctx.rec.not_run(BENCH, "deepspeed_zero3_offload", None, "GPU only")
        return
    from hybridengine.rollout.kv_cache import available_memory

    from .peers import _ds_engine, import_deepspeed

    if import_deepspeed(ctx, BENCH) is None:
        return
    for name in ctx.models:
        need, avail = _zero_offload_host_bytes(name), available_memory()  # ranks share one host: the sum
        if avail is not None and need > HOST_FRACTION * avail:
            ctx.rec.not_run(BENCH, "deepspeed_zero3_offload", name,
                            f"ZeRO-Offload keeps ~{need / 2**30:.0f} GiB on the host for this model and these ranks; "
                            f"{avail / 2**30:.0f} GiB are available (run it on a larger host or a smaller model)")
            ctx.log(f"  {BENCH} deepspeed offload {name}: not run, host memory ({need / 2**30:.0f} GiB needed)")
            continue
        config = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "bf16": {"enabled": True},
            "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True}},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-6}},  # DeepSpeedCPUAdam with the offload
            "gradient_clipping": 1.0,
            "steps_per_print": 1 << 30,
        }
        engine, model, params, numel = _ds_engine(ctx, name, config)
        vocab = model.config.vocab_size

        def try_step(tokens: int):
            g = torch.Generator().manual_seed(3 + ctx.rank)
            ids = torch.randint(0, vocab, (tokens // SEQ, SEQ), generator=g).to(ctx.device)

            def step():
                engine.backward(engine(input_ids=ids, labels=ids).loss)
                engine.step()

            try:
                return ctx.measure(step, warmup=1, repeats=3, desc=f"zero3 offload {tokens}")
            except Exception as err:  # noqa: BLE001
                if not _is_oom(err):
                    raise
                return None
            finally:
                del ids
                release_memory()

        most, ran, failed = _ladder(ctx, try_step)
        case = dict(part="max_micro_batch", offload="optimizer (ZeRO-Offload, cpu)", seq=SEQ,
                    activation_checkpointing=False, params=numel)
        ctx.rec.add(BENCH, "deepspeed_zero3_offload", name, case, "tokens", float(most))
        if failed is not None:
            ctx.rec.add(BENCH, "deepspeed_zero3_offload", name, {**case, "count": "first_failed"}, "tokens",
                        float(failed))
        for tokens, times in sorted(ran.items()):
            c = {**case, "tokens_per_gpu": tokens}
            ctx.rec.add(BENCH, "deepspeed_zero3_offload", name, c, "seconds", times)
            ctx.rec.add(BENCH, "deepspeed_zero3_offload", name, c, "tokens_per_s",
                        [ctx.world * tokens / t for t in times])
            ctx.log(f"  {BENCH} deepspeed offload {name} {tokens} tokens: {quantiles(times)[1]:.2f} s")
        engine.destroy()
        del engine, model, params
        release_memory()
