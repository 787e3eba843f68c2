"""Rollout generation (ours against HF generate and DeepSpeed), the sampler, and the decode step's GEMMs."""

from __future__ import annotations

from .fmt import Notes, dur, dur_spread, fmt, ratio, sig, sig_spread, size, spread, table
from .roofline import Floors
from .rows import in_run, label, latest, peaks, peer, pick, same_variant
from .targets import GOAL, PEER


def default_generate(r: dict) -> bool:
    """A generate/decode_step row of the engine's defaults, not one of the same-run variants (sync scheduling,
    the torch sampler)."""
    c = r["case"]
    return c.get("async_scheduling") is not False and c.get("sampler") != "torch"


def _comparable(a: dict, b: dict) -> bool:
    """Same per-GPU generation workload."""
    return all(a["case"].get(k) == b["case"].get(k) for k in ("batch_per_gpu", "prompt", "new_tokens"))


GENERATE_PEERS = (("hf_generate", {"case_cache": "dynamic"}, "HF generate, dynamic cache"),
                  ("hf_generate", {"case_cache": "static"}, "HF generate, static cache"),
                  ("deepspeed_gather_once", {"case_timer_sync": True}, "DeepSpeed gather-once"))


def generate_peer(rows: list[dict], r: dict, provider: str, match: dict) -> tuple[dict | None, bool]:
    p, same = peer(rows, r["run_id"], bench="generate", provider=provider, model=r["model"], metric="tokens_per_s",
                   **match)
    return (p, same) if p is not None and _comparable(p, r) else (None, True)


def same_tg(rows: list[dict], r: dict) -> list[dict]:
    """Rows of r's TP degree (rows without one are tg = 1)."""
    tg = r["case"].get("tg", 1)
    return [x for x in rows if x["case"].get("tg", 1) == tg]


def generate_section(rows: list[dict]) -> str:
    sel = latest(rows, "generate")
    notes = Notes()
    body = []
    for r in sel:
        if r["metric"] != "tokens_per_s" or r["provider"] != "hybridengine":
            continue
        run, model, case = r["run_id"], r["model"], r["case"].get("case")
        own = same_tg(in_run(rows, run), r)
        mode, sampler = r["case"].get("async_scheduling"), r["case"].get("sampler")
        step = pick(own, bench="decode_step", provider="hybridengine", model=model, case_case=case,
                    case_async_scheduling=mode, case_sampler=sampler)
        floor = pick(own, bench="decode_step", provider="floor", model=model, case_case=case)
        if floor is not None and floor["case"].get("batch_per_gpu") != r["case"].get("batch_per_gpu"):
            floor = None
        floor_mark = ""
        if floor is not None and "hbm_GBps" in floor["case"]:
            hbm = Floors(rows, run).hbm_GBps
            fc = floor["case"]
            floor_mark = notes.mark(f"decode-step floor of run {run}: weights ({sig(fc.get('weights_GiB'))} GiB) "
                       f"+ the KV of {fc.get('batch_per_gpu')} sequences at mean context "
                       f"{floor['case'].get('mean_context')}, read at {fmt(floor['case']['hbm_GBps'])} GB/s (the run's "
                       f"hbm_copy: {fmt(hbm)} GB/s).")
        per_gpu = r["value"] / max(r["num_gpus"], 1)
        speeds = []
        for provider, match, _ in GENERATE_PEERS:
            p, _ = generate_peer(rows, r, provider, match)
            speeds.append("–" if p is None else
                          ratio(per_gpu, p["value"] / max(p["num_gpus"], 1)) + notes.other_run(p, run))
        nvml = pick(own, bench="generate", provider="hybridengine", model=model, metric="peak_GiB", case_case=case,
                    case_source="nvml", case_async_scheduling=mode, case_sampler=sampler)
        shape = f"{r['case'].get('batch_per_gpu')} x {r['case'].get('new_tokens')}"
        sync = (", sync" if mode is False else "") + (", torch sampler" if sampler == "torch" else "")
        body.append([model, f"{case} (n={r['case'].get('samples')}, tg={r['case'].get('tg', 1)}{sync})", shape,
                     sig_spread(r), str(r["num_gpus"]), sig(per_gpu),
                     dur(step and step["value"]), dur(floor and floor["value"]) + floor_mark,
                     ratio(step and step["value"], floor and floor["value"]), *speeds,
                     sig(nvml and nvml["value"]), run])
    ours = ("## Rollout generation\n\n### hybridengine\n\n"
            "`HybridEngine.generate` with CUDA graphs and async scheduling, one GPU per sequence batch at tg = 1, "
            "two at tg = 2, sampling at temperature 1 (the peers decode greedily; every call generates the full "
            "length either way). Sequences per GPU x new tokens: 64 x 128 is the peers' workload (64 prompts x 128 "
            "random tokens); grpo is 8 prompts x n = 8 samples x 512. Decode step: the engine's decode time / steps; "
            "floor: the run's `decode_step` floor row (weights + KV bytes / HBM bandwidth). Speed vs a peer: tok/s "
            "per GPU / the peer's tok/s per GPU on the same workload (the peers ran on 2 GPUs, each GPU generating "
            "for its own 64 prompts). Peak NVML includes the KV cache the engine reserves up front "
            "(gpu_memory_utilization 0.85). Rows marked sync ran with async scheduling off "
            "(`EngineTuning(async_scheduling=False)`, same engine, same run); rows marked torch sampler drew their "
            "tokens with `sampling.sample` (`EngineTuning(sampler='torch')`) instead of the fused Triton sampler, "
            "the default on CUDA (same engine, same run).\n\n"
            + table(["model", "case", "seqs/GPU x new tokens", "tok/s (p20–p80)", "GPUs", "tok/s per GPU",
                     "decode step", "floor step", f"step / floor (goal <= {GOAL['decode_step_vs_floor']})",
                     *(f"speed vs {label}" for _, _, label in GENERATE_PEERS), "peak GiB nvml", "run"], body)
            + str(notes)) if body else "## Rollout generation"
    return ours + "\n\n" + _generate_peers_table(rows)


def _generate_peers_table(rows: list[dict]) -> str:
    sel = [r for r in latest(rows, "generate") if r["provider"] != "hybridengine"]
    notes = Notes()
    body = []
    for r in sel:
        if r["metric"] != "tokens_per_s":
            continue
        fl = Floors(rows, r["run_id"])
        secs = next((x for x in sel if x["provider"] == r["provider"] and x["model"] == r["model"]
                     and x["run_id"] == r["run_id"] and x["metric"] == "seconds" and same_variant(x, r)), None)
        p, _ = peer(rows, r["run_id"], bench="generate", provider=PEER["generate"], model=r["model"],
                       metric="tokens_per_s", case_cache="dynamic")
        floor = fl.generate_tok_s(r["model"], r["case"], r["num_gpus"])
        torch_peak, nvml_peak = peaks(sel, r)
        steps = r["case"].get("new_tokens")
        body.append([r["model"] or "–", label(r), spread(r), fmt(secs and steps and secs["value"] / steps * 1e3, 1),
                     fmt(floor), ratio(r["value"], floor),
                     ratio(r["value"], p and p["value"]) + notes.other_run(p, r["run_id"]),
                     torch_peak, nvml_peak, r["run_id"]])
    return ("### Peers (per GPU: 64 prompts x 128 random tokens, 128 new tokens, greedy)\n\n"
            "tok/s is the total over all GPUs of the run; ms/step is one generate call / 128.\n\n"
            + table(["model", "provider", "tok/s (p20–p80)", "ms/step", "floor tok/s", "of floor",
                     f"speed vs {PEER['generate']}", "peak GiB torch", "peak GiB nvml", "run"], body) + str(notes))


def sampler_section(rows: list[dict]) -> str:
    sel = [r for r in latest(rows, "sampler") if r["metric"] == "seconds"]
    body = []
    for r in sorted(sel, key=lambda r: (bool(r["case"].get("sweep")), r["case"].get("batch", 0), r["provider"],
                                        r["case"].get("splits", 0), r["case"].get("block", 0))):
        c = r["case"]
        peer_row = pick(sel, run_id=r["run_id"], provider="torch_sample", case_batch=c.get("batch"))
        hbm = Floors(rows, r["run_id"]).hbm_GBps
        floor = hbm and c.get("logits_bytes", 0) / (hbm * 1e9)
        plan = f"{c['splits']} x {c['block']}" if "splits" in c else "–"
        body.append([fmt(c.get("batch")), r["provider"] + (" (sweep)" if c.get("sweep") else ""), plan, dur_spread(r),
                     dur(floor), ratio(r["value"], floor), ratio(peer_row and peer_row["value"], r["value"])])
    runs = ", ".join(sorted({r["run_id"] for r in sel}))
    return (f"## Sampler (one decode step's tokens + log-probs from bf16 logits [B, 152064], T = 1; "
            f"run {runs or '–'})\n\n"
            "Floor: one read of the logits at the run's HBM copy bandwidth. Speed vs torch_sample: "
            "`sampling.sample`'s time / this row's.\n\n"
            + table(["B", "provider", "splits x block", "time (p20–p80)", "floor", "of floor", "speed vs torch_sample"],
                    body) if body else "## Sampler\n\nNot run yet.")


DECODE_GEMM_ORDER = ("qkv", "o", "gate_up", "down", "lm_head")


def decode_gemm_section(rows: list[dict]) -> str:
    """`python -m hybridengine_bench.probes.probe_gemm` rows: each decode GEMM in cuBLAS against its weight-read
    floor, and the retired split-K Triton GEMM (where the run timed one), all from the latest run."""
    sel = [r for r in rows if r["bench"] == "decode_gemm" and r["metric"] == "seconds"]
    if not sel:
        return "## Decode-step GEMMs\n\nNo rows yet."
    run = max(r["run_id"] for r in sel if r["provider"] == "cublas")
    sel = [r for r in sel if r["run_id"] == run]
    by = {}
    for r in sel:
        key = (r["model"], r["case"]["gemm"], r["case"]["m"])
        by.setdefault(key, {}).setdefault(r["provider"], []).append(r)
    order = {g: i for i, g in enumerate(DECODE_GEMM_ORDER)}
    body, layer = [], {}
    for (model, gemm, m), group in sorted(by.items(), key=lambda kv: (kv[0][0], kv[0][2], order.get(kv[0][1], 9))):
        cublas, floor = group.get("cublas", [None])[0], group.get("floor", [None])[0]
        if cublas is None or floor is None:
            continue
        plan = group.get("triton", [None])[0]
        best = min(group.get("triton_sweep", []) + ([plan] if plan else []), key=lambda r: r["value"], default=None)
        if gemm != "lm_head":
            acc = layer.setdefault((model, m), [0.0, 0.0])
            acc[0] += cublas["value"]
            acc[1] += floor["value"]
        body.append([model, gemm, str(m), size(cublas["case"]["weight_bytes"]), dur_spread(cublas),
                     sig(cublas["case"]["weight_bytes"] / cublas["value"] / 1e9), dur(floor["value"]),
                     ratio(floor["value"], cublas["value"]), dur(plan and plan["value"]), dur(best and best["value"]),
                     ratio(best and best["value"], cublas["value"])])
    sums = [[model, str(m), dur(t), dur(f), ratio(f, t)] for (model, m), (t, f) in sorted(layer.items())]
    head = sel[0]
    return ("## Decode-step GEMMs (cuBLAS against the weight-read floor)\n\n"
            f"Run {run} ({head['num_gpus']} x {head['gpu']}, commit {head['commit'][:12]}; "
            "`python -m hybridengine_bench.probes.probe_gemm`): [M, K] @ [N, K]^T in bf16 at decode rows M, each "
            "GEMM timed in a CUDA graph over weight copies that do not fit in L2 (time per GEMM). floor: the weight "
            "bytes at the run's hbm_copy bandwidth; \"of floor\" = floor / cuBLAS time. \"/tg2\": one rank's shard "
            "at tg = 2. Triton: the split-K `decode_linear` GEMM written for these shapes and retired on these rows "
            "(hybridengine_bench/README.md, \"Retired experiments\"): its automatic plan and the best of its config "
            "sweep (M = 128 only); cuBLAS speed = Triton best / cuBLAS.\n\n"
            + table(["model", "GEMM", "M", "weights", "cuBLAS (p20–p80)", "GB/s", "floor", "of floor", "Triton plan",
                     "Triton best", "cuBLAS speed vs Triton"], body)
            + "\n\nPer decoder layer (qkv + o + gate_up + down):\n\n"
            + table(["model", "M", "cuBLAS", "floor", "of floor"], sums))
