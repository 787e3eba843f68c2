"""Peers: DeepSpeed ZeRO-3, FSDP2 and plain HF generate, on random-init embedded configs (bf16).

Each bench measures, per model: the train->generate switch (gather every parameter, then release),
rollout generation (64 prompts x 128 new tokens per GPU), and a train step (4 x 1024 tokens per
GPU, fwd + bwd + AdamW), each with its peak memory. hybridengine's rows for the same workloads come
from the suites switch, generate and train_step (hybridengine_bench/switch.py, generate.py, train.py).
"""

from __future__ import annotations

import torch

from hybridengine.model.presets import model_config

from .common import Ctx, PeakMemory, generate, quantiles, random_ids, record_generate, record_train, release_memory

DS_HYBRID_ENGINE_REASON = (
    "DeepSpeed Hybrid Engine kernel mode: deepspeed 0.19.8 has no Qwen2 inference container "
    "(module_inject/replace_policy.py lists Llama, Llama2, InternLM, OPT, BLOOM, GPT-*), so it injects no "
    "kernel for these configs; its Llama container crashes in ds_transformer.py under transformers 5 "
    "(seen on the GPU machine; not re-run here). Nearest runnable row: deepspeed_gather_once.")


def hf_model(name: str, *, dtype: torch.dtype, device: torch.device | None):
    """A random-init HF model of an embedded config (no download); device None: the caller's context."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    if device is None:
        return AutoModelForCausalLM.from_config(model_config(name), dtype=dtype)
    with device:
        return AutoModelForCausalLM.from_config(model_config(name), dtype=dtype)


def record_switch(ctx: Ctx, provider: str, model: str, gather: list[float], release: list[float],
                  pm: PeakMemory, numel: int) -> None:
    """Switch rows; received bytes = bf16 model x (n-1)/n per rank, the floor's numerator."""
    case = dict(tg=1, params=numel, received_bytes_per_rank=2 * numel * (ctx.world - 1) // ctx.world)
    ctx.rec.add("switch", provider, model, {**case, "phase": "gather"}, "seconds", gather)
    ctx.rec.add("switch", provider, model, {**case, "phase": "release"}, "seconds", release)
    ctx.record_peak(pm, "switch", provider, model, case)
    ctx.log(f"  switch {provider} {model}: gather {quantiles(gather)[1] * 1e3:.1f} ms, "
            f"release {quantiles(release)[1] * 1e3:.1f} ms")


def hf_generate(ctx: Ctx) -> None:
    """HF generate on one unsharded bf16 replica per GPU: what a user does without us."""
    w = ctx.work
    for name in ctx.models:
        model = hf_model(name, dtype=torch.bfloat16, device=ctx.device).eval()
        ids = random_ids(ctx, w.batch, w.prompt, model.config.vocab_size, seed=1)
        numel = sum(p.numel() for p in model.parameters())
        # Warm-up calls are full length: the allocator reaches its final size before timing, and with
        # the static cache HF compiles the decode step on CUDA for that exact cache length. The eager
        # (dynamic) path is host-bound (the same step time at 1.5B and 7B) and its calls vary widely
        # from one to the next, so read its p20-p80.
        for cache in ("dynamic", "static"):
            kwargs = {} if cache == "dynamic" else {"cache_implementation": "static"}
            try:
                with ctx.peak() as pm:
                    times = ctx.measure(lambda: generate(model, ctx, ids, w.new_tokens, **kwargs), warmup=1,
                                        repeats=3, desc=f"hf_generate {name} {cache}")
            except Exception as e:  # noqa: BLE001 - the static cache is "if it runs" (issue 3)
                if cache == "dynamic":
                    raise
                ctx.rec.not_run("generate", "hf_generate", name, f"{type(e).__name__}: {str(e)[:300]}", cache=cache)
                continue
            record_generate(ctx, "hf_generate", name, times, pm, params=numel, cache=cache, replica="unsharded")
        del model
        torch._dynamo.reset()  # the static cache's compiled decode step holds the model and its graphs
        release_memory()


def fsdp2(ctx: Ctx, switch: bool = True) -> None:
    """FSDP2: fully_shard per decoder layer and the root; fp32 sharded params, bf16 compute, fp32 reduce.
    Train steps, then (switch) the unshard/reshard of every parameter."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(ctx.device.type, (ctx.world,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    w = ctx.work
    for name in ctx.models:
        model = hf_model(name, dtype=torch.float32, device=ctx.device)
        numel = sum(p.numel() for p in model.parameters())
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
        ids = random_ids(ctx, w.train_batch, w.train_seq, model.config.vocab_size, seed=2)

        def step():
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        for checkpointing in (False, True):  # HF's per-layer activation checkpointing (non-reentrant)
            if checkpointing:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            with ctx.peak() as pm:
                times = ctx.measure(step, warmup=3, repeats=10, desc=f"fsdp2 train {name}")
            record_train(ctx, "fsdp2", name, times, pm, params=numel, optimizer="torch AdamW (foreach)",
                         activation_checkpointing=checkpointing)
        model.gradient_checkpointing_disable()
        if not switch:
            del model, opt
            release_memory()
            continue

        units = [m for m in model.modules() if isinstance(m, FSDPModule)]

        def unshard():
            for handle in [u.unshard(async_op=True) for u in units]:
                handle.wait()

        def reshard():
            for u in units:
                u.reshard()

        gather, release = [], []
        with ctx.peak() as pm:
            for i in range(2 + ctx.reps(10)):
                g, r = ctx.timed(unshard), ctx.timed(reshard)
                if i >= 2:  # two warm-up switches
                    gather.append(g)
                    release.append(r)
        record_switch(ctx, "fsdp2", name, ctx.slowest(gather), ctx.slowest(release), pm, numel)
        del model, opt, units
        release_memory()


def _ds_config(ctx: Ctx) -> dict:
    return {
        "train_micro_batch_size_per_gpu": ctx.work.train_batch,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3},  # DeepSpeed's defaults for buckets, prefetch and persistence
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-5, "torch_adam": True}},
        "steps_per_print": 1 << 30,
    }


def _without_zero_hooks(engine, fn) -> None:
    """Run fn with ZeRO-3's module hooks removed, then register them again.

    Inside GatheredParameters the hooks would still fetch and release each module's parameters on
    every forward, and leaving the context then fails with "Cannot partition a param in flight".
    TRL's unwrap_model_for_generation and DeepSpeed's Hybrid Engine do the same.
    """
    offload = engine.optimizer.parameter_offload
    for hook in offload.forward_hooks + offload.backward_hooks:
        hook.remove()
    offload.forward_hooks, offload.backward_hooks = [], []
    try:
        fn()
    finally:
        offload._register_deepspeed_module(offload.module)


def _ds_engine(ctx: Ctx, name: str, config: dict | None = None):
    """A DeepSpeed ZeRO-3 engine over a random-init bf16 model of an embedded config (`config`: the
    DeepSpeed config, default `_ds_config`): (engine, model, params, numel)."""
    import deepspeed

    config = config or _ds_config(ctx)
    # Import the model's code (and torch._dynamo, which transformers pulls in) before zero.Init:
    # zero.Init patches torch.Tensor.__new__, and dynamo's polyfills refuse the patched signature.
    hf_model(name, dtype=torch.bfloat16, device=torch.device("meta"))
    with deepspeed.zero.Init(config_dict_or_path=config, dtype=torch.bfloat16):
        model = hf_model(name, dtype=torch.bfloat16, device=None)
    engine, *_ = deepspeed.initialize(model=model, config=config)
    params = list(engine.module.parameters())
    return engine, model, params, sum(p.ds_numel for p in params)


def _ds_switch(ctx: Ctx, name: str, params: list, numel: int) -> None:
    """ZeRO-3's gather of every parameter (GatheredParameters enter) and its release (exit)."""
    import deepspeed

    gather, release = [], []
    with ctx.peak() as pm:
        for i in range(2 + ctx.reps(10)):
            gathered = deepspeed.zero.GatheredParameters(params)
            g, r = ctx.timed(gathered.__enter__), ctx.timed(lambda: gathered.__exit__(None, None, None))
            if i >= 2:
                gather.append(g)
                release.append(r)
    record_switch(ctx, "deepspeed_zero3", name, ctx.slowest(gather), ctx.slowest(release), pm, numel)


def import_deepspeed(ctx: Ctx, bench: str):
    """The deepspeed module, or None after a not_run row per model (the wheel is carried to the GPU machine)."""
    try:
        import deepspeed
    except ImportError as e:
        for name in ctx.models:
            ctx.rec.not_run(bench, "deepspeed_zero3", name, f"deepspeed is not importable: {e}")
        return None
    return deepspeed


def deepspeed_switch(ctx: Ctx) -> None:
    """Only ZeRO-3's switch (the `switch` suite runs it after hybridengine's, in the same run)."""
    if import_deepspeed(ctx, "switch") is None:
        return
    for name in ctx.models:
        engine, model, params, numel = _ds_engine(ctx, name)
        _ds_switch(ctx, name, params, numel)
        engine.destroy()
        del engine, model, params
        release_memory()


def deepspeed_zero3(ctx: Ctx, rest: bool = True) -> None:
    """DeepSpeed ZeRO-3 (bf16, torch AdamW): train step, then (rest) switch, gather-once and naive generate."""
    deepspeed = import_deepspeed(ctx, "train_step")
    if deepspeed is None:
        return
    w = ctx.work
    for name in ctx.models:
        engine, model, params, numel = _ds_engine(ctx, name)
        ids = random_ids(ctx, w.train_batch, w.train_seq, model.config.vocab_size, seed=2)

        def step():
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()

        for checkpointing in (False, True):
            if checkpointing:
                engine.module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            with ctx.peak() as pm:
                times = ctx.measure(step, warmup=3, repeats=10, desc=f"zero3 train {name}")
            record_train(ctx, "deepspeed_zero3", name, times, pm, params=numel, optimizer="torch AdamW (foreach)",
                         activation_checkpointing=checkpointing)
        engine.module.gradient_checkpointing_disable()
        if not rest:
            engine.destroy()
            del engine, model, params
            release_memory()
            continue
        _ds_switch(ctx, name, params, numel)

        prompts = random_ids(ctx, w.batch, w.prompt, model.config.vocab_size, seed=1)
        engine.eval()

        def gather_once(new_tokens: int) -> None:
            with deepspeed.zero.GatheredParameters(params):
                _without_zero_hooks(engine, lambda: generate(engine.module, ctx, prompts, new_tokens))

        # DeepSpeed's throughput timer (on by default) synchronizes the device at every forward of the
        # engine's module, decode steps included: measured as shipped, then with it off. Off was not
        # faster, so the sync is not DeepSpeed's gap to HF.
        for timer_sync in (True, False):
            engine.tput_timer.config.synchronized = timer_sync
            with ctx.peak() as pm:
                times = ctx.measure(lambda: gather_once(w.new_tokens), warmup=1 if timer_sync else 0, repeats=3,
                                    desc=f"gather-once generate {name}")
            record_generate(ctx, "deepspeed_gather_once", name, times, pm, params=numel,
                            includes="gather+generate+release", timer_sync=timer_sync)

        engine.tput_timer.config.synchronized = True
        with ctx.peak() as pm:  # parameter fetches dominate here: a shorter warm-up does
            generate(engine.module, ctx, prompts, 32, synced_gpus=True)
            times = ctx.measure(lambda: generate(engine.module, ctx, prompts, w.new_tokens, synced_gpus=True),
                                warmup=0, repeats=2, desc=f"zero3 generate {name}")
        record_generate(ctx, "deepspeed_zero3", name, times, pm, params=numel, synced_gpus=True, timer_sync=True)
        ctx.rec.not_run("generate", "deepspeed_hybrid_engine", name, DS_HYBRID_ENGINE_REASON)
        engine.train()
        engine.destroy()
        del engine, model, params
        release_memory()
