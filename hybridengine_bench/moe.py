"""Mixture-of-experts benches (issue 43), one GPU: the GRPO step against transformers' own MoE model trained
with FSDP2, decode against its bytes floor, and the routing mismatch between rollout and training.

Model: `qwen3-moe-7b` (the Qwen3-MoE architecture at OLMoE-1B-7B's shapes, random weights); on CPU (the
harness check) `tiny-qwen3-moe`. Workload: the GRPO step of `ppo_e2e` (hybridengine_bench/e2e.py): 32 prompts of
128 random tokens x n = 4 samples x 256 new tokens at temperature 1, random 0/1 rewards, group-normalised
advantages, old log-probs recomputed, one optimizer step (lr 1e-6, clip 0.2/0.28, gradient clipping 1.0).

Benches, in the order the `moe` suite runs them:
- `moe_routing` (provider hybridengine, `EngineConfig(exact_logprobs=True)`, CUDA graphs off so that a Python
  hook sees every step): one rollout, each MoE layer's chosen experts recorded at every prompt and response
  position the rollout fed, then `log_probs` over the same sequences with training's routing recorded.
  Rows: `fraction` case.stat mismatch_token_layer (the (token, layer) pairs whose top-k sets differ),
  mismatch_token (tokens with a differing set in any layer), each for case.phase prefill and decode (goal 0);
  `nats` case.stat max / mean |rollout log-prob - log_probs| and `fraction` case.stat logprob_equal;
  `fraction` case.stat touched_experts: the mean fraction of a layer's experts that one decode step's batch
  routes to (what the decode floor reads).
- `moe_e2e` (provider hybridengine): the GRPO step of e2e.engine_step (rows as `ppo_e2e`'s: seconds, tokens/s,
  a row per phase, peaks), then, on the same engine, decode: rows of bench `moe_decode`, seconds per generate
  call, new tokens/s, the decode step (engine.stats), its floor (provider floor: bytes per decode step over this
  run's HBM copy bandwidth; the parts in case) and `ratio` rows: decode step / floor (goal <= 2), decode
  tokens/s / floor tokens/s. A CUDA-graph capture that fails is recorded as a not_run row and the bench goes on
  with an engine without graphs (case.cuda_graphs says which ran); HE_BENCH_MOE_GRAPHS=0 starts without them.
- `moe_e2e_fsdp2` (provider fsdp2_hf): transformers' `Qwen3MoeForCausalLM` in fp32 with `fully_shard` per decoder
  layer and the root (bf16 compute, fp32 reduce), torch AdamW: every unit unsharded once and HF `generate`
  (sampling, dynamic cache), then the reshard; log-probs by no-grad forwards and the update by forward/backward
  in micro-batches of MICRO_BATCH sequences (full fp32 logits, the clipped surrogate, the load-balancing loss at
  the config's coefficient), clip_grad_norm_ 1.0, one AdamW step: the loop of `ppo_e2e_deepspeed` with FSDP2
  in place of ZeRO-3. Then `ratio` rows (bench moe_e2e, provider hybridengine, case.to fsdp2_hf): the peer's
  step seconds over hybridengine's, from the two `seconds` rows of this run (goal >= 3).
"""

from __future__ import annotations

import contextlib
import os
import time
import traceback

import torch

from . import e2e
from .common import GiB, Ctx, quantiles, release_memory

BENCH_E2E = "moe_e2e"
BENCH_DECODE = "moe_decode"
BENCH_ROUTING = "moe_routing"
PEER = "fsdp2_hf"
MICRO_BATCH = e2e.DS_MICRO_BATCH
"""Sequences per forward/backward of the peer (as the DeepSpeed loop of ppo_e2e)."""
HBM_GBPS_DESIGN = 4210.0
"""DESIGN.md's HBM copy bandwidth on an H200 (GB/s): the floor's bandwidth when this run measured none."""
CPU_MODEL = "tiny-qwen3-moe"


def models(ctx: Ctx) -> list[str]:
    return ctx.models if ctx.cuda else [CPU_MODEL]


def run_value(ctx: Ctx, bench: str, metric: str, provider: str | None = None, model: str | None = None,
              **match) -> float | None:
    """The median of the last row of this run (this process's recorder) with that bench, metric, provider,
    model and case entries; None when there is none."""
    for row in reversed(ctx.rec.rows):
        if (row["bench"] == bench and row["metric"] == metric and (provider is None or row["provider"] == provider)
                and (model is None or row["model"] == model)
                and all(row["case"].get(k) == v for k, v in match.items())):
            return row["value"]
    return None


def hbm_gbps(ctx: Ctx) -> tuple[float, str]:
    """(GB/s, source): this run's HBM copy row (the `hbm_copy` floor bench), else DESIGN.md's figure."""
    value = run_value(ctx, "hbm_copy", "GB_per_s")
    return (value, "hbm_copy row of this run") if value is not None else (HBM_GBPS_DESIGN, "DESIGN.md")


def cuda_graphs_first(ctx: Ctx) -> bool:
    """Whether `moe_e2e` starts with CUDA graphs: on CUDA, unless HE_BENCH_MOE_GRAPHS=0."""
    return ctx.cuda and os.environ.get("HE_BENCH_MOE_GRAPHS", "1") != "0"


def _engine(he, model: str, ctx: Ctx, w: e2e.E2EWork, *, exact: bool, cuda_graphs: bool):
    return he.HybridEngine(he.model_config(model), he.EngineConfig(
        dtype=torch.bfloat16 if ctx.cuda else torch.float32, device=str(ctx.device), exact_logprobs=exact,
        cuda_graphs=cuda_graphs, max_model_len=w.prompt + w.new_tokens, max_num_seqs=w.prompts * w.n,
        gpu_memory_utilization=0.85))


def _inputs(he, model: str, ctx: Ctx, w: e2e.E2EWork):
    """The GRPO workload's prompts (seeded as ppo_e2e's), sampling parameters and PPO config."""
    g = torch.Generator().manual_seed(7 + ctx.rank)
    prompts = torch.randint(0, he.model_config(model).vocab_size, (w.prompts, w.prompt), generator=g).tolist()
    params = he.SamplingParams(n=w.n, temperature=1.0, max_tokens=w.new_tokens)
    ppo = he.PPOConfig(lr=1e-6, clip_low=0.2, clip_high=0.28, micro_batch_tokens=16384)
    return prompts, params, ppo


# -- the GRPO step and decode on hybridengine -------------------------------------------------------------------


def moe_e2e(ctx: Ctx) -> None:
    """hybridengine: the GRPO step, then decode on the same engine against its bytes floor."""
    import hybridengine as he

    w = e2e._work(ctx)
    for model in models(ctx):
        prompts, params, ppo = _inputs(he, model, ctx, w)
        graphs, failure = cuda_graphs_first(ctx), None
        engine = _engine(he, model, ctx, w, exact=False, cuda_graphs=graphs)
        try:
            e2e.engine_step(ctx, engine, prompts, params, ppo, 0)  # warm-up: compilation, graphs, optimizer state
        except Exception as e:  # noqa: BLE001 - recorded; the bench goes on without CUDA graphs
            if not graphs:
                raise
            ctx.log(traceback.format_exc())
            failure = f"cuda_graphs=True: {type(e).__name__}: {str(e)[:300]}"
        if failure is not None:  # out of the except block: its traceback no longer holds the engine's memory
            ctx.rec.not_run(BENCH_E2E, "hybridengine", model, failure, cuda_graphs=True)
            ctx.log(f"  {BENCH_E2E} {model}: the warm-up step with CUDA graphs failed; again without them")
            del engine
            release_memory()
            graphs = False
            engine = _engine(he, model, ctx, w, exact=False, cuda_graphs=False)
            e2e.engine_step(ctx, engine, prompts, params, ppo, 0)
        with ctx.peak() as pm:
            steps = [e2e.engine_step(ctx, engine, prompts, params, ppo, i) for i in range(1, 1 + ctx.reps(2))]
        e2e._record(ctx, "hybridengine", model, w, steps, pm, bench=BENCH_E2E, cuda_graphs=graphs,
                    activation_checkpointing=ppo.activation_checkpointing)
        _decode(ctx, engine, model, w, prompts, params, graphs)
        del engine
        release_memory()


def _decode(ctx: Ctx, engine, model: str, w: e2e.E2EWork, prompts, params, graphs: bool) -> None:
    """Generate calls of the GRPO rollout (batch prompts x n) on a warm engine; the decode step against its floor."""
    batch = w.prompts * w.n
    with engine.rollout():
        with ctx.peak() as pm:
            times = ctx.measure(lambda: engine.generate(prompts, params), warmup=1, repeats=3,
                                desc=f"moe decode {model}")
        stats = engine.stats
    step = stats["decode_s"] / max(1, stats["steps"] - 1)
    case = dict(batch_per_gpu=batch, prompt=w.prompt, new_tokens=w.new_tokens, cuda_graphs=graphs)
    ctx.rec.add(BENCH_DECODE, "hybridengine", model, case, "seconds", times)
    ctx.rec.add(BENCH_DECODE, "hybridengine", model, case, "tokens_per_s", [batch * w.new_tokens / t for t in times])
    ctx.record_peak(pm, BENCH_DECODE, "hybridengine", model, case)
    ctx.rec.add(BENCH_DECODE, "hybridengine", model, {**case, "what": "decode_step"}, "seconds", step)
    floor_s, parts = decode_floor(ctx, engine.model.config, model, batch, w.prompt + w.new_tokens // 2,
                                  elem=torch.finfo(engine.config.dtype).bits // 8)
    ctx.rec.add(BENCH_DECODE, "floor", model, {**case, "what": "decode_step", **parts}, "seconds", floor_s)
    ratio_case = {**case, "what": "decode_step", "to": "floor", "touched_source": parts["touched_source"]}
    ctx.rec.add(BENCH_DECODE, "hybridengine", model, ratio_case, "ratio", step / floor_s)
    ctx.rec.add(BENCH_DECODE, "hybridengine", model, {**ratio_case, "what": "decode_tokens_per_s"}, "ratio",
                (batch / step) / (batch / floor_s))
    ctx.log(f"  {BENCH_DECODE} {model}: decode step {step * 1e3:.2f} ms, floor {floor_s * 1e3:.2f} ms "
            f"({step / floor_s:.2f}x; goal <= 2), {batch / step:,.0f} tok/s")


def decode_floor(ctx: Ctx, cfg, model: str, batch: int, mean_context: int, *, elem: int) -> tuple[float, dict]:
    """Seconds of one decode step reading only what it must, and its parts, for a model whose every layer is an
    MoE layer: every weight but the experts' and the embedding's, the experts the batch routes to (this run's
    touched fraction from `moe_routing` at the same batch, else the expectation under uniform routing), `batch`
    embedding rows and the KV of `batch` sequences at `mean_context` tokens, `elem` bytes an element, over this
    run's HBM copy bandwidth."""
    L, H, E, k = cfg.num_hidden_layers, cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok
    inter, hd = cfg.moe_intermediate_size, cfg.head_dim
    attn = H * hd * (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads) + 2 * hd + 2 * H
    router = E * H
    expert = 3 * H * inter
    head = cfg.vocab_size * H + H
    fraction = run_value(ctx, BENCH_ROUTING, "fraction", "hybridengine", model, stat="touched_experts",
                         batch_per_gpu=batch)
    source = "moe_routing row of this run"
    if fraction is None:  # no routing measured in this run: uniform top-k routing's expected coverage
        fraction, source = 1 - (1 - k / E) ** batch, "uniform routing (expected)"
    touched = fraction * E
    weights = L * (attn + router + touched * expert) + head + batch * H
    kv = batch * mean_context * 2 * L * cfg.num_key_value_heads * hd
    bw, bw_source = hbm_gbps(ctx)
    nbytes = (weights + kv) * elem
    parts = dict(mean_context=mean_context, touched_experts_per_layer=touched, touched_source=source,
                 weights_GiB=weights * elem / GiB, kv_GiB=kv * elem / GiB, hbm_GBps=bw, hbm_source=bw_source,
                 all_experts_floor_s=(L * (attn + router + E * expert) + head + batch * H + kv) * elem / (bw * 1e9))
    return nbytes / (bw * 1e9), parts


# -- routing mismatch in exact mode ------------------------------------------------------------------------------


class RoutingLog:
    """Each MoE layer's chosen experts (sorted: a top-k set) at every position a rollout fed, keyed by
    (request, position) for prompt positions and (request, sample, position) after, with the step's phase.
    Installed on the rollout's runner and attention metadata while the context is open (eager steps only:
    a CUDA graph's replay runs no Python)."""

    def __init__(self):
        self.steps: list[tuple[list, str, dict[int, torch.Tensor]]] = []

    @contextlib.contextmanager
    def installed(self):
        from hybridengine.rollout.runner import AttentionMetadata, ModelRunner

        step, record = ModelRunner.step, AttentionMetadata.record_routing
        log = self

        def logged_step(runner, batch, *args, **kwargs):
            keys = []
            for seq in batch.seqs:
                first = seq.num_cached_tokens if batch.is_prefill else seq.num_tokens - 1
                for p in range(first, seq.num_tokens):
                    keys.append((seq.request, p) if p < seq.num_prompt_tokens else (seq.request, seq.sample, p))
            log.steps.append((keys, "prefill" if batch.is_prefill else "decode", {}))
            return step(runner, batch, *args, **kwargs)

        def logged_record(meta, layer, router_logits, experts):
            log.steps[-1][2][layer] = experts.sort(dim=-1).values.to(torch.int16)

        ModelRunner.step, AttentionMetadata.record_routing = logged_step, logged_record
        try:
            yield self
        finally:
            ModelRunner.step, AttentionMetadata.record_routing = step, record

    def table(self) -> tuple[dict, torch.Tensor, list[str]]:
        """(key -> row, experts int16 [layers, rows, k] on the CPU, phase of each row); a key fed twice (a prefix
        recomputed) keeps its last row."""
        index, blocks, phases = {}, [], []
        for keys, phase, layers in self.steps:
            if not layers:
                continue
            base = len(phases)
            index.update((key, base + i) for i, key in enumerate(keys))
            phases += [phase] * len(keys)
            blocks.append(torch.stack([layers[i] for i in sorted(layers)]).cpu())
        return index, torch.cat(blocks, dim=1), phases

    def touched_fraction(self, num_experts: int) -> float:
        """The mean over decode steps and layers of the fraction of experts the step's batch routes to."""
        counts = [torch.unique(e).numel() / num_experts for _, phase, layers in self.steps if phase == "decode"
                  for e in layers.values()]
        return sum(counts) / len(counts)


@contextlib.contextmanager
def training_routing(passes: list):
    """Appends (rows, attention) for every packed forward of training (`GatheredModel.pack_inputs`); each
    attention's `routing` then holds its layers' (router logits, experts)."""
    from hybridengine.train.gathered_model import GatheredModel

    pack = GatheredModel.pack_inputs

    def logged(model, batch, rows, *args, **kwargs):
        out = pack(model, batch, rows, *args, **kwargs)
        passes.append((list(rows), out[3]))
        return out

    GatheredModel.pack_inputs = logged
    try:
        yield passes
    finally:
        GatheredModel.pack_inputs = pack


def moe_routing(ctx: Ctx) -> None:
    """Exact mode: rollout vs training top-k sets per (token, layer), log-prob differences, touched experts."""
    import hybridengine as he

    w = e2e._work(ctx)
    for model in models(ctx):
        prompts, params, _ = _inputs(he, model, ctx, w)
        engine = _engine(he, model, ctx, w, exact=True, cuda_graphs=False)
        log = RoutingLog()
        with engine.rollout(), log.installed():
            t0 = time.perf_counter()
            outs = engine.generate(prompts, params)
            ctx.sync()
            generate_s = time.perf_counter() - t0
        seqs = [(o.prompt_token_ids, s.token_ids, s.logprobs) for o in outs for s in o.outputs]
        samples = [(i, s.index) for i, o in enumerate(outs) for s in o.outputs]
        ids = [torch.tensor(p + r) for p, r, _ in seqs]
        passes = []
        with training_routing(passes):
            logp = engine.log_probs(he.PPOBatch(input_ids=ids))
        case = dict(mode="exact", cuda_graphs=False, prompts=w.prompts, prompt=w.prompt, n=w.n,
                    new_tokens=w.new_tokens, batch_per_gpu=w.prompts * w.n)
        ctx.rec.add(BENCH_ROUTING, "hybridengine", model, {**case, "phase": "generate", "routing_logged": True},
                    "tokens_per_s", len(seqs) * w.new_tokens / generate_s)
        diff = torch.cat([torch.tensor(lp, dtype=torch.float32) - logp[b, len(p) - 1:len(p) - 1 + len(r)].float().cpu()
                          for b, (p, r, lp) in enumerate(seqs)]).abs().double()
        for stat, value in (("max", diff.max()), ("mean", diff.mean())):
            ctx.rec.add(BENCH_ROUTING, "hybridengine", model, {**case, "stat": stat}, "nats", float(value))
        ctx.rec.add(BENCH_ROUTING, "hybridengine", model, {**case, "stat": "logprob_equal"}, "fraction",
                    float((diff == 0).double().mean()))
        mismatch, missing = _mismatch(log, passes, seqs, samples)
        for phase, (pairs, tokens, count) in mismatch.items():
            c = {**case, "phase": phase, "tokens": count, "positions_not_logged": missing}
            ctx.rec.add(BENCH_ROUTING, "hybridengine", model, {**c, "stat": "mismatch_token_layer"}, "fraction", pairs)
            ctx.rec.add(BENCH_ROUTING, "hybridengine", model, {**c, "stat": "mismatch_token"}, "fraction", tokens)
        num_experts = engine.model.config.num_experts
        ctx.rec.add(BENCH_ROUTING, "hybridengine", model, {**case, "stat": "touched_experts",
                                                           "num_experts": num_experts}, "fraction",
                    log.touched_fraction(num_experts))
        ctx.log(f"  {BENCH_ROUTING} {model}: top-k sets differing (token, layer) "
                + ", ".join(f"{ph} {m[0]:.3%} of {m[2]}" for ph, m in mismatch.items())
                + f"; |log-prob diff| max {diff.max():.3g} (goal: 0 and 0)")
        del engine, passes, log
        release_memory()


def _mismatch(log: RoutingLog, passes: list, seqs: list, samples: list) -> tuple[dict, int]:
    """(phase -> (fraction of (token, layer) pairs whose top-k sets differ, fraction of tokens with any layer
    differing, tokens compared), positions the log lacks) over every position the rollout fed: the prompt and
    the response but its last token. `seqs`: (prompt, response, log-probs) in training's batch order; `samples`:
    (prompt index, sample index) of each."""
    index, rollout, phases = log.table()
    train_rows, train_blocks, base = {}, [], 0
    for rows, attn in passes:
        experts = torch.stack([attn.routing[i][1] for i in sorted(attn.routing)]).sort(dim=-1).values
        train_blocks.append(experts.to(torch.int16).cpu())
        for b, start in zip(rows, attn.cu[:-1]):
            train_rows[b] = base + start
        base += attn.cu[-1]
    training = torch.cat(train_blocks, dim=1)
    request = sorted({k[0] for k in index})  # prompt index -> request key (keys count up in admission order)
    r_idx, t_idx, r_phase, missing = [], [], [], 0
    for b, ((p, r, _), (prompt_i, sample)) in enumerate(zip(seqs, samples)):
        for pos in range(len(p) + len(r) - 1):
            key = (request[prompt_i], pos) if pos < len(p) else (request[prompt_i], sample, pos)
            if key not in index:
                missing += 1
                continue
            r_idx.append(index[key])
            t_idx.append(train_rows[b] + pos)
            r_phase.append(phases[index[key]])
    differs = (rollout[:, r_idx] != training[:, t_idx]).any(dim=-1)  # [layers, tokens]
    out = {}
    for phase in ("prefill", "decode"):
        cols = torch.tensor([ph == phase for ph in r_phase], dtype=torch.bool)
        d = differs[:, cols]
        out[phase] = (float(d.double().mean()), float(d.any(dim=0).double().mean()), int(cols.sum()))
    return out, missing


# -- the peer: transformers' MoE model under FSDP2 ---------------------------------------------------------------


def moe_e2e_fsdp2(ctx: Ctx) -> None:
    """The GRPO step with transformers + FSDP2 + HF generate (module docstring), then the ratio rows."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    from hybridengine.train.advantages import grpo_advantages

    from .peers import hf_model

    w = e2e._work(ctx)
    mesh = init_device_mesh(ctx.device.type, (ctx.world,))
    compute = torch.bfloat16 if ctx.cuda else torch.float32
    mp = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)
    for name in models(ctx):
        model = hf_model(name, dtype=torch.float32, device=ctx.device)
        experts_impl = getattr(model.config, "_experts_implementation", None)  # transformers >= 5 names it
        coef = model.config.router_aux_loss_coef if model.config.output_router_logits else 0.0
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        units = [m for m in model.modules() if isinstance(m, FSDPModule)]
        opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=ctx.cuda)  # fused: no foreach temporaries
        g = torch.Generator().manual_seed(7 + ctx.rank)
        prompts = torch.randint(0, model.config.vocab_size, (w.prompts, w.prompt), generator=g).to(ctx.device)
        prompts = prompts.repeat_interleave(w.n, 0)
        with torch.no_grad():  # FSDP's lazy initialisation (the root, its streams) before the first explicit unshard
            model(input_ids=prompts[:1, :8], output_router_logits=False)

        def generate(new_tokens: int) -> torch.Tensor:
            for u in units:  # gather once for the whole generation (the DeepSpeed loop's GatheredParameters)
                u.unshard()
            for layer in model.model.layers:
                layer.set_reshard_after_forward(False)
            try:
                return model.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts),
                                      max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=True,
                                      temperature=1.0, top_p=1.0, top_k=0, eos_token_id=None, pad_token_id=0,
                                      output_router_logits=False)  # no load-balancing loss per decode step
            finally:
                for layer in model.model.layers:
                    layer.set_reshard_after_forward(True)
                for u in units:
                    u.reshard()

        def step(index: int, new_tokens: int) -> dict[str, float]:
            t = {}
            model.eval()
            ctx.sync()
            t0 = time.perf_counter()
            with torch.no_grad():
                ids = generate(new_tokens)
            ctx.sync()
            t["generate"] = time.perf_counter() - t0
            t1 = time.perf_counter()
            with torch.no_grad():
                olds = [e2e._response_logprobs(model(input_ids=mb, output_router_logits=False).logits, mb, w.prompt)
                        for mb in ids.split(MICRO_BATCH)]
            ctx.sync()
            t["log_probs"] = time.perf_counter() - t1
            adv = grpo_advantages(e2e._rewards(ids.shape[0], index, ctx.rank), w.n).to(ctx.device)
            model.train()
            t2 = time.perf_counter()
            for mb, old, a in zip(ids.split(MICRO_BATCH), olds, adv.split(MICRO_BATCH)):
                out = model(input_ids=mb, output_router_logits=coef > 0)
                logp = e2e._response_logprobs(out.logits, mb, w.prompt)
                ratio = torch.exp(torch.clamp(logp - old, -20, 20))
                pg = torch.maximum(-a[:, None] * ratio, -a[:, None] * torch.clamp(ratio, 0.8, 1.28))
                loss = pg.sum() / (ids.shape[0] * new_tokens)  # token mean over the whole batch
                if coef:  # the load-balancing loss, once per step as hybridengine's (averaged over micro-batches)
                    loss = loss + coef * out.aux_loss * mb.shape[0] / ids.shape[0]
                loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            ctx.sync()
            t["update"] = time.perf_counter() - t2
            return e2e._phase_max(ctx, t)

        step(0, min(8, w.new_tokens))  # warm-up with a short rollout: kernels, allocator, optimizer state
        with ctx.peak() as pm:
            steps = [step(i, w.new_tokens) for i in range(1, 1 + ctx.reps(2))]
        e2e._record(ctx, PEER, name, w, steps, pm, bench=BENCH_E2E, experts_implementation=experts_impl,
                    optimizer="torch AdamW (fused)" if ctx.cuda else "torch AdamW", activation_checkpointing=False)
        _ratio_to_peer(ctx, name, w, steps)
        del model, opt, units
        release_memory()


def _ratio_to_peer(ctx: Ctx, model: str, w: e2e.E2EWork, steps: list[dict]) -> None:
    """`ratio` rows: the peer's step seconds (median) over hybridengine's from this run, whole step and phases."""
    ours = next((r for r in reversed(ctx.rec.rows) if r["bench"] == BENCH_E2E and r["provider"] == "hybridengine"
                 and r["model"] == model and r["metric"] == "seconds" and "phase" not in r["case"]), None)
    if ours is None:
        ctx.rec.not_run(BENCH_E2E, "hybridengine", model, f"no hybridengine step in this run to compare with {PEER}",
                        to=PEER)
        return
    peer = quantiles([sum(s.values()) for s in steps])[1]
    case = {**e2e._case(ctx, w), "to": PEER, "cuda_graphs": ours["case"]["cuda_graphs"]}
    ctx.rec.add(BENCH_E2E, "hybridengine", model, case, "ratio", peer / ours["value"])
    for phase in ("generate", "log_probs", "update"):
        mine = run_value(ctx, BENCH_E2E, "seconds", "hybridengine", model, phase=phase)
        if mine:
            ctx.rec.add(BENCH_E2E, "hybridengine", model, {**case, "phase": phase}, "ratio",
                        quantiles([s[phase] for s in steps])[1] / mine)
    ctx.log(f"  {BENCH_E2E} {model}: {PEER} step / hybridengine step = {peer / ours['value']:.2f} (goal >= 3)")
