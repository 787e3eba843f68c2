"""The key ratios, each with its GPUs and run: all of them head report.md; the headline rows (the whole GRPO
step against DeepSpeed ZeRO-3, the train step against FSDP2, the switch against the NCCL all-gather of its
bytes) are the README's table between its marker comments, the one part of the README the report writes."""

from __future__ import annotations

import math
from pathlib import Path

from .fmt import dur, ratio, sig, size, table
from .rollout import GENERATE_PEERS, default_generate, generate_peer, same_tg
from .rows import gbps, in_run, latest, peer, pick, twin
from .switch import after_idle, gather_label, gen_to_train, switch_peer, switch_rows, unit_gather_nccl
from .targets import GOAL, HEADLINE_MODEL
from .train import checkpointing, e2e_phases, e2e_steps, train_peer

BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"
"""The marker comments around the one README table the report rewrites."""


def _where(r: dict, *others: dict | None) -> str:
    """GPUs and run of r, plus the run of each other row measured elsewhere."""
    out = f"{r['num_gpus']} x {r['gpu'].replace('NVIDIA ', '')}, {r['run_id']}"
    extra = {(o["provider"], o["run_id"], o["num_gpus"]) for o in others
             if o is not None and o["run_id"] != r["run_id"]}
    return out + "".join(f"; {p}: other run {rid} ({n} GPUs)" for p, rid, n in sorted(extra))


def _headline_model(candidates: list[dict]) -> str | None:
    models = {r["model"] for r in candidates}
    return HEADLINE_MODEL if HEADLINE_MODEL in models else min(models - {None}, default=None)


def key_rows(rows: list[dict]) -> list[tuple[list[str], int]]:
    """The key-ratio table's rows, each with its place among the headline rows (1 first; 0: not a headline row)."""
    body = []

    def add(cells: list[str], headline: int = 0) -> None:
        body.append((cells, headline))

    seg = [r for r in latest(rows, "segment_copy") if r["metric"] == "GB_per_s"]
    for target in (64 * 2**20, 4 * 2**30):
        near = [r for r in seg if abs(math.log(max(r["case"].get("bytes", 1), 1) / target)) < 0.01]
        speeds = []
        for r in near:
            if r["provider"] == "hybridengine":
                ref = pick(near, run_id=r["run_id"], provider="torch_copy", case_pattern=r["case"].get("pattern"))
                speeds.append((r["case"].get("pattern"), r, ref))
        speeds = [s for s in speeds if s[2]]
        if not speeds:
            continue
        pattern, r, ref = next((s for s in speeds if s[0] == "layer_unpack"), speeds[0])
        values = [s[1]["value"] / s[2]["value"] for s in speeds]
        plural = "s" if len(speeds) > 1 else ""
        add([f"Segment copy GB/s / `copy_` GB/s, {size(target)} ({pattern}; range over {len(speeds)} "
             f"table pattern{plural})",
             f"{sig(r['value'])} GB/s", f"{sig(ref['value'])} GB/s",
             f"{ratio(r['value'], ref['value'])} ({min(values):.2f}–{max(values):.2f})", "–", _where(r)])

    sw = switch_rows(rows)
    model = _headline_model(sw)
    for g in (r for r in sw if r["model"] == model):
        tg, own = g["case"].get("tg"), in_run(rows, g["run_id"])
        nccl = pick(own, bench="switch", provider="nccl", model=model, metric="seconds", case_tg=tg)
        if nccl is not None:
            add([f"Switch train->gen time / NCCL all-gather of the same {sig(g['case'].get('received_GB'))} GB "
                 f"per rank, {model} tg={tg}", dur(g["value"]), dur(nccl["value"]),
                 ratio(g["value"], nccl["value"]),
                 f"<= {GOAL['switch_vs_nccl']}", _where(g)], headline=3)
            idle = after_idle(own, g)
            if idle is not None:
                add([f"Switch train->gen {idle['case']['after_idle_s']} s after the last release (a training "
                     f"step between the switches) / NCCL all-gather of the same bytes, {model} tg={tg}",
                     dur(idle["value"]), dur(nccl["value"]), ratio(idle["value"], nccl["value"]),
                     f"<= {GOAL['switch_vs_nccl']}", _where(idle)])
            ahead = after_idle(own, g, ahead=True)
            if ahead is not None and g["case"].get("received_GB"):
                add([f"Switch train->gen with its pages mapped ahead (`prepare_generation()` during the training "
                     f"step) / NCCL all-gather of the same bytes, {model} tg={tg}",
                     dur(ahead["value"]), dur(nccl["value"]), ratio(ahead["value"], nccl["value"]),
                     f"<= {GOAL['switch_vs_nccl']}", _where(ahead)], headline=3)
        ds, _ = switch_peer(rows, g, "deepspeed_zero3")
        if ds is not None:
            add([f"Switch speed vs DeepSpeed ZeRO-3 gather of every parameter, {model} tg={tg}", dur(g["value"]),
                 dur(ds["value"]), f"{ratio(ds['value'], g['value'])}x", f">= {GOAL['switch_vs_deepspeed']}x",
                 _where(g, ds)])
            idle = after_idle(own, g)
            if idle is not None:
                add([f"Switch speed vs DeepSpeed ZeRO-3 gather, train->gen {idle['case']['after_idle_s']} s after "
                     f"the last release, {model} tg={tg}", dur(idle["value"]), dur(ds["value"]),
                     f"{ratio(ds['value'], idle['value'])}x", f">= {GOAL['switch_vs_deepspeed']}x",
                     _where(idle, ds)])
            ahead = after_idle(own, g, ahead=True)
            if ahead is not None:
                add([f"Switch speed vs DeepSpeed ZeRO-3 gather, train->gen with its pages mapped ahead, {model} "
                     f"tg={tg}", dur(ahead["value"]), dur(ds["value"]), f"{ratio(ds['value'], ahead['value'])}x",
                     f">= {GOAL['switch_vs_deepspeed']}x", _where(ahead, ds)])
        back, released = gen_to_train(own, model, tg)
        if g["case"].get("received_GB") == 0:
            add([f"Switch at tg={tg} (no bytes move), {model}: train->gen, gen->train", dur(g["value"]),
                 dur(back and back["value"]), "–", "< 1 ms", _where(g)])
        elif back is not None and released is not None:
            add([f"Switch gen->train, {model} tg={tg}: the call, and until its pages are released (host thread)",
                 dur(back["value"]), dur(released["value"]), "–", "< 1 ms", _where(g)])

    ug = [r for r in latest(rows, "unit_gather") if r["provider"] == "hybridengine" and r["metric"] == "busbw_GB_per_s"
          and "unpack_blocks" not in r["case"]]  # the default launch; the unpack-grid sweep is in report.md
    model = _headline_model(ug)
    for r in sorted((r for r in ug if r["model"] == model), key=lambda r: (r["case"].get("pipelined", 0),
                                                                           r["case"].get("tg", 0))):
        piped = r["case"].get("pipelined", 0)
        nccl = unit_gather_nccl(rows, r["run_id"], model, piped)
        unpack = gather_label(r)
        ahead = (", one prefetched ahead as in training" if r["case"].get("lookahead") == 1
                 else ", all prefetched first" if piped else "")
        unpack += f", {piped} layers pipelined{ahead} vs {piped} all-gathers back to back" if piped else ""
        add([f"Unit gather busbw / NCCL all-gather busbw, {model} layer ({sig(r['case'].get('MB'))} MB), "
             f"tg={r['case'].get('tg')}{unpack}", f"{sig(r['value'])} GB/s",
             f"{sig(nccl and nccl['value'])} GB/s", ratio(r["value"], nccl and nccl["value"]),
             f">= {GOAL['unit_gather_vs_nccl']}", _where(r, nccl)])

    pa = [r for r in latest(rows, "paged_attention") if r["metric"] == "seconds"]
    for batch, context in ((128, 1024), (1, 16384)):
        r = pick(pa, provider="hybridengine", case_split="auto", case_batch=batch, case_context=context)
        if r is None:
            continue
        sdpa, _ = peer(rows, r["run_id"], bench="paged_attention", provider="sdpa_dense", model=r["model"],
                       metric="seconds", case_batch=batch, case_context=context)
        if sdpa is None:
            continue
        add([f"Decode attention speed vs dense SDPA (SDPA time / ours), B={batch}, context {context:,}",
             f"{dur(r['value'])} ({sig(gbps(rows, r))} GB/s)",
             f"{dur(sdpa['value'])} ({sig(gbps(rows, sdpa))} GB/s)",
             ratio(sdpa["value"], r["value"]), "–", _where(r, sdpa)])

    ppo = [r for r in latest(rows, "ppo_loss") if r["metric"] == "seconds" and not r["case"].get("sweep")]
    he = pick(ppo, provider="hybridengine", case_tokens=32768) or pick(ppo, provider="hybridengine")
    if he is not None:
        tokens = he["case"].get("tokens")
        extra = twin(rows, he, "peak_GiB", source="torch", scope="extra")
        for provider, what in (("torch_ref", "naive torch (full logits)"),
                               ("torch_chunked", "chunked torch (checkpointed)")):
            p, _ = peer(rows, he["run_id"], bench="ppo_loss", provider=provider, model=he["model"], metric="seconds",
                        case_tokens=tokens, case_sweep=None)
            if p is None:
                continue
            p_extra = twin(rows, p, "peak_GiB", source="torch", scope="extra")
            add([f"PPO loss fwd+bwd speed vs {what}, M={tokens // 1024}k (extra peak GiB)",
                 f"{dur(he['value'])} ({sig(extra and extra['value'])} GiB)",
                 f"{dur(p['value'])} ({sig(p_extra and p_extra['value'])} GiB)",
                 f"{ratio(p['value'], he['value'])}x",
                 "–", _where(he, p)])

    pf = [r for r in latest(rows, "prefill_attention") if r["metric"] == "TFLOP_per_s" and not r["case"].get("sweep")]
    for r in sorted((x for x in pf if x["provider"] == "hybridengine"), key=lambda x: x["case"]["length"]):
        for provider, label in (("torch_varlen", "torch's varlen flash attention"), ("sdpa", "dense SDPA")):
            if provider == "sdpa" and r["case"]["length"] != 2048:  # one case against SDPA keeps the table short
                continue
            p = pick(pf, provider=provider, case_length=r["case"]["length"], case_batch=r["case"]["batch"])
            if p is not None:
                add([f"Prefill attention TFLOP/s / {label}, Qwen2-7B heads, {r['case']['batch']} x "
                     f"{r['case']['length']:,} tokens, causal", f"{sig(r['value'])} TFLOP/s",
                     f"{sig(p['value'])} TFLOP/s", ratio(r["value"], p["value"]), "–", _where(r, p)])

    gen = [r for r in latest(rows, "generate") if r["provider"] == "hybridengine" and r["metric"] == "tokens_per_s"
           and default_generate(r)]
    r = pick(gen, case_case="rollout") or (gen[0] if gen else None)
    if r is not None:
        per_gpu = r["value"] / max(r["num_gpus"], 1)
        for provider, match, label in (GENERATE_PEERS[1], GENERATE_PEERS[2]):
            p, _ = generate_peer(rows, r, provider, match)
            if p is None:
                continue
            p_gpu = p["value"] / max(p["num_gpus"], 1)
            add([f"Rollout tok/s per GPU / {label}, {r['model']}, {r['case'].get('batch_per_gpu')} prompts x "
                 f"{r['case'].get('new_tokens')} new tokens per GPU", f"{sig(per_gpu)} tok/s",
                 f"{sig(p_gpu)} tok/s", f"{ratio(per_gpu, p_gpu)}x", "–", _where(r, p)])
    # The decode step against its floor, per model and case (the goal is set at B = 128: the grpo case).
    for g in sorted(gen, key=lambda x: (x["model"], x["case"].get("batch_per_gpu", 0))):
        own = same_tg(in_run(rows, g["run_id"]), g)
        step = pick(own, bench="decode_step", provider="hybridengine", model=g["model"],
                    case_case=g["case"].get("case"), case_async_scheduling=g["case"].get("async_scheduling"),
                    case_sampler=g["case"].get("sampler"))
        floor = pick(own, bench="decode_step", provider="floor", model=g["model"], case_case=g["case"].get("case"))
        if step and floor and floor["case"].get("batch_per_gpu") == g["case"].get("batch_per_gpu"):
            tg = g["case"].get("tg", 1)
            add([f"Decode step / its floor (weights + KV bytes at HBM bandwidth), {g['model']}"
                 f"{f' tg={tg}' if tg > 1 else ''}, "
                 f"{floor['case'].get('batch_per_gpu')} sequences at mean context "
                 f"{floor['case'].get('mean_context')}", dur(step["value"]), dur(floor["value"]),
                 ratio(step["value"], floor["value"]), f"<= {GOAL['decode_step_vs_floor']}", _where(g)])

    tr = [r for r in latest(rows, "train_step") if r["metric"] == "seconds"]
    model = _headline_model([r for r in tr if r["provider"] == "hybridengine"]) or _headline_model(tr)
    dense = [r for r in tr if r["case"].get("layout", "dense") == "dense"]
    ours_rows = [r for r in dense if r["provider"] == "hybridengine" and r["model"] == model]
    split_rows = any(r["case"].get("split_master") for r in ours_rows)

    def default_train(r: dict) -> bool:  # the engine's defaults: fused training kernels, the split master
        return bool(r["case"].get("fused_training")) and bool(r["case"].get("split_master")) == split_rows

    for ours in sorted(ours_rows, key=lambda r: (checkpointing(r), bool(r["case"].get("fused_training")),
                                                 bool(r["case"].get("split_master")))):
        setting = "on" if checkpointing(ours) else "off"
        fused = f", fused_training {'on' if ours['case'].get('fused_training') else 'off'}" \
            + (", split_master" if ours["case"].get("split_master") else "")
        mem = twin(rows, ours, "peak_GiB", source="torch+buffer") or twin(rows, ours, "peak_GiB", source="torch")
        for provider, label in (("fsdp2", "FSDP2"), ("deepspeed_zero3", "DeepSpeed ZeRO-3")):
            p, _ = train_peer(rows, ours, provider, any_setting=True)
            if p is not None:
                sides = (f"activation checkpointing {setting} on both sides{fused}"
                         if checkpointing(p) == checkpointing(ours) else
                         f"activation checkpointing: ours {setting}{fused}, peer {'on' if checkpointing(p) else 'off'}")
                p_mem = twin(rows, p, "peak_GiB", source="torch")
                add([f"Train step speed vs {label}, {model}, per GPU {ours['case'].get('batch_per_gpu')} x "
                     f"{ours['case'].get('seq')} tokens, {sides} "
                     "(peak GiB, torch; ours + the mapped buffer where measured)",
                     f"{dur(ours['value'])} ({sig(mem and mem['value'])} GiB)",
                     f"{dur(p['value'])} ({sig(p_mem and p_mem['value'])} GiB)",
                     f"{ratio(p['value'], ours['value'])}x", ">= 1.1x" if provider == "fsdp2" else "–",
                     _where(ours, p)], headline=2 if provider == "fsdp2" and default_train(ours) else 0)
    if not ours_rows:
        fsdp = pick(dense, provider="fsdp2", model=model)
        ds = fsdp and train_peer(rows, fsdp, "deepspeed_zero3")[0]
        if ds is not None:
            add([f"Train step, {model}, per GPU {fsdp['case'].get('batch_per_gpu')} x {fsdp['case'].get('seq')} "
                 "tokens (peers only; no hybridengine train-step rows): FSDP2 speed vs DeepSpeed ZeRO-3",
                 f"FSDP2 {dur(fsdp['value'])}", f"ZeRO-3 {dur(ds['value'])}",
                 f"{ratio(ds['value'], fsdp['value'])}x", "–", _where(fsdp, ds)])
    for r in sorted(e2e_steps(rows), key=lambda r: (r["model"] or "", not r["case"].get("lazy_cuda_graphs"))):
        if r["provider"] != "hybridengine":
            continue
        ds, _ = peer(rows, r["run_id"], bench="ppo_e2e", provider="deepspeed_zero3", model=r["model"], metric="seconds")
        c = r["case"]
        graphs = "lazy CUDA graphs" if c.get("lazy_cuda_graphs") else "CUDA graphs captured at rollout entry"
        work = (f"{r['model']}, per GPU {c.get('prompts_per_gpu')} prompts x n={c.get('samples')} x "
                f"{c.get('new_tokens')} new tokens, {graphs}")
        if ds is not None:
            add([f"Whole GRPO step speed vs a DeepSpeed ZeRO-3 loop, {work}", dur(r["value"]), dur(ds["value"]),
                 f"{ratio(ds['value'], r['value'])}x", f">= {GOAL['e2e_vs_deepspeed']}x", _where(r, ds)],
                headline=1 if c.get("lazy_cuda_graphs") else 0)
        phases = e2e_phases(rows, r)
        switch = sum(phases.get(k, 0.0) for k in ("switch_to_generation", "switch_to_training"))
        add([f"Switch share of the whole GRPO step, {work}", dur(switch), dur(r["value"]),
             f"{switch / r['value']:.1%}", f"< {GOAL['e2e_switch_share']:.0%}", _where(r)])
    return body


HEADER = ["measure", "value", "reference", "ratio", "goal", "GPUs, run"]


def key_ratios_section(rows: list[dict]) -> str:
    """report.md's first section: every key ratio."""
    return ("## Key ratios\n\nEach ratio comes from rows of one run unless the last column names another run for "
            "the reference; the sections below give the full tables, floors, peers and notes.\n\n"
            + table(HEADER, [cells for cells, _ in key_rows(rows)]))


def readme_section(rows: list[dict]) -> str:
    """The README's table: the headline rows of the key ratios (GRPO step, train step, switch)."""
    headline = sorted((place, i, cells) for i, (cells, place) in enumerate(key_rows(rows)) if place)
    return (table(HEADER, [cells for _, _, cells in headline])
            + "\n\nEach ratio comes from rows of one run unless the last column names another run for the reference. "
              "All key ratios, full tables, floors, peers and plots: "
              "[hybridengine_bench/results/report.md](hybridengine_bench/results/report.md).")


def update_readme(readme: Path, section: str) -> bool:
    if not readme.exists():
        print(f"report: {readme} does not exist; README section not written")
        return False
    text = readme.read_text()
    if BEGIN not in text or END not in text or text.index(BEGIN) > text.index(END):
        print(f"report: {readme} has no {BEGIN} ... {END} markers; README section not written")
        return False
    head, rest = text.split(BEGIN, 1)
    readme.write_text(head + BEGIN + "\n" + section + "\n" + END + rest.split(END, 1)[1])
    return True
