"""Training: the train step against FSDP2 and DeepSpeed, the fused PPO loss, and the whole GRPO step."""

from __future__ import annotations

from .fmt import Notes, dur, dur_spread, fmt, ratio, sig, sig_spread, spread, table
from .roofline import Floors
from .rows import in_run, latest, peer, pick, twin
from .targets import PEER


def checkpointing(r: dict) -> bool:
    """A train_step row's activation checkpointing (peer rows from before the flag ran without)."""
    return bool(r["case"].get("activation_checkpointing", False))


def train_peer(rows: list[dict], r: dict, provider: str, any_setting: bool = False) -> tuple[dict | None, bool]:
    """The peer's dense train-step row on as many GPUs as r, at r's activation-checkpointing setting
    (any setting with `any_setting`, when none matches), same run preferred."""
    cands = [x for x in rows if x["bench"] == "train_step" and x["provider"] == provider and x["model"] == r["model"]
             and x["metric"] == "seconds" and x["case"].get("layout", "dense") == "dense"
             and x["num_gpus"] == r["num_gpus"]]  # data parallelism changes the per-GPU step: same GPU count
    matching = [x for x in cands if checkpointing(x) == checkpointing(r)]
    cands = matching or (cands if any_setting else [])
    same = [x for x in cands if x["run_id"] == r["run_id"]]
    if same:
        return same[0], True
    return (max(cands, key=lambda x: x["time"]), False) if cands else (None, False)


def train_section(rows: list[dict]) -> str:
    sel = latest(rows, "train_step")
    notes = Notes()
    body = []
    for r in sorted(sel, key=lambda r: (r["model"] or "", r["provider"], checkpointing(r))):
        if r["metric"] != "seconds":
            continue
        # 6 x params x tokens at the run's GEMM peak (MFU = floor / time); our rows take the count from a peer's.
        params = r["case"].get("params") or next((x["case"]["params"] for x in rows if x["bench"] == "train_step"
                                                  and x["model"] == r["model"] and "params" in x["case"]), None)
        floor = Floors(rows, r["run_id"]).train_s({**r["case"], "params": params} if params else r["case"])
        tok = twin(rows, r, "tokens_per_s")
        p, _ = train_peer(rows, r, PEER["train_step"])
        # This row's own setting (checkpointing, fused_training, split_master): its case plus the source.
        torch_peak, nvml_peak, buffer_peak = (fmt(p and p["value"], 1) for p in (
            twin(sel, r, "peak_GiB", source="torch"), twin(sel, r, "peak_GiB", source="nvml", scope="device_used"),
            twin(sel, r, "peak_GiB", source="torch+buffer")))
        torch_peak += "" if buffer_peak == "–" else f" (+buffer {buffer_peak})"
        label = r["provider"] + (f" ({r['case']['layout']}"
                                 f"{', fused_training' if r['case'].get('fused_training') else ''}"
                                 f"{', split_master' if r['case'].get('split_master') else ''})"
                                 if "layout" in r["case"] else "")
        body.append([r["model"], label, "on" if checkpointing(r) else "off", spread(r, 1, 3), fmt(tok and tok["value"]),
                     fmt(floor, 3), ratio(floor, r["value"]),
                     ratio(p and p["value"], r["value"]) + notes.other_run(p, r["run_id"]),
                     torch_peak, nvml_peak])
    return ("## Train step (per GPU: 4 x 1024 tokens, fwd + bwd + AdamW)\n\nActivation checkpointing: off keeps every "
            "layer's activations; on recomputes each layer in backward. Speed vs the peer compares rows with the same "
            "setting. Peak torch: the allocator's peak; hybridengine's parameter buffer is driver-mapped pages outside "
            "the allocator, so its rows also give torch + the mapped buffer (\"+buffer\"), the figure to set against "
            "a peer's torch peak (the peers' parameters live in the allocator).\n\n"
            + table(["model", "provider", "act. ckpt", "s (p20–p80)", "tok/s", "floor s (6 N tokens at GEMM peak)",
                     "MFU",
                     f"speed vs {PEER['train_step']}", "peak GiB torch", "peak GiB nvml"], body) + str(notes))


PPO_PROVIDERS = ("hybridengine", "torch_ref", "torch_chunked", "liger")


def ppo_loss_section(rows: list[dict]) -> str:
    sel = latest(rows, "ppo_loss")
    anchors = sorted((r for r in sel if r["provider"] == "hybridengine" and r["metric"] == "seconds"
                      and not r["case"].get("sweep")), key=lambda r: r["case"].get("tokens", 0))
    notes = Notes()
    body = []
    for he in anchors:
        run, tokens = he["run_id"], he["case"].get("tokens")
        gemm = Floors(rows, run).gemm_TFLOPs
        for provider in PPO_PROVIDERS:
            key = dict(bench="ppo_loss", provider=provider, model=he["model"], case_tokens=tokens, case_sweep=None)
            r = he if provider == "hybridengine" else peer(rows, run, **key, metric="seconds")[0]
            if r is None:
                missing = pick(in_run(rows, run), **key, metric="not_run")
                if missing is not None:
                    body.append([fmt(tokens), provider, "–", "not run" + notes.mark(
                        f"{provider}: {missing['case']['reason']}"), "–", "–", "–", "–", "–", "–"])
                continue
            mark = notes.other_run(r, run)
            tflops = twin(rows, r, "TFLOP_per_s")
            extra = twin(rows, r, "peak_GiB", source="torch", scope="extra")
            ref, _ = peer(rows, run, **{**key, "provider": "torch_ref"}, metric="seconds")
            chunked, _ = peer(rows, run, **{**key, "provider": "torch_chunked"}, metric="seconds")
            body.append([fmt(tokens), provider + mark, fmt(r["case"].get("chunk_rows")), sig_spread(r, 1e3),
                         sig(tflops and tflops["value"]), ratio(tflops and tflops["value"], gemm),
                         sig(extra and extra["value"]), ratio(ref and ref["value"], r["value"]),
                         ratio(chunked and chunked["value"], r["value"]), r["run_id"]])
    text = ("## PPO / GRPO loss over the LM head (forward + backward)\n\n"
            "Qwen2-7B's head (H = 3584, V = 152064, bf16), M tokens in sequences of 1024, GRPO-like loss (clip 0.2, "
            "k3 KL 0.04, token-mean). TFLOP/s counts 6 M H V for every provider (torch_chunked recomputes the logits: "
            "8 M H V); of GEMM = TFLOP/s / the run's bf16 GEMM rate. Extra peak GiB: torch's allocator peak during "
            "one call minus what was allocated before it, the gradients of hidden and weight included. Speed vs a "
            "peer = its time / this row's time.\n\n"
            + table(["M", "provider", "chunk rows", "ms (p20–p80)", "TFLOP/s", "of GEMM", "extra peak GiB",
                     "speed vs torch_ref", "speed vs torch_chunked", "run"], body) + str(notes))
    sweep = [r for r in sel if r["provider"] == "hybridengine" and r["metric"] == "seconds" and r["case"].get("sweep")]
    if not sweep:
        return text
    sbody = []
    for tokens in sorted({r["case"].get("tokens") for r in sweep}):
        default = next((a for a in anchors if a["case"].get("tokens") == tokens
                        and a["run_id"] == sweep[0]["run_id"]), None)
        group = sorted([r for r in sweep if r["case"].get("tokens") == tokens] + ([default] if default else []),
                       key=lambda r: r["case"].get("chunk_rows", 0))
        for r in group:
            tflops = twin(rows, r, "TFLOP_per_s")
            extra = twin(rows, r, "peak_GiB", source="torch", scope="extra")
            sbody.append([fmt(tokens), fmt(r["case"].get("chunk_rows")) + (" (default)" if r is default else ""),
                          sig_spread(r, 1e3), sig(tflops and tflops["value"]), sig(extra and extra["value"]),
                          ratio(default and default["value"], r["value"]), r["run_id"]])
    return (text + "\n\n### Chunk-size sweep (hybridengine)\n\n"
            + table(["M", "chunk rows", "ms (p20–p80)", "TFLOP/s", "extra peak GiB", "speed vs default chunk", "run"],
                    sbody))


E2E_PHASES = ("switch_to_generation", "rollout_setup", "generate", "switch_to_training", "log_probs", "update")


def e2e_steps(rows: list[dict]) -> list[dict]:
    return [r for r in latest(rows, "ppo_e2e") if r["metric"] == "seconds" and "phase" not in r["case"]]


def e2e_phases(rows: list[dict], r: dict) -> dict[str, float]:
    return {x["case"]["phase"]: x["value"] for x in in_run(rows, r["run_id"])
            if x["bench"] == "ppo_e2e" and x["provider"] == r["provider"] and x["model"] == r["model"]
            and x["metric"] == "seconds" and "phase" in x["case"]
            and x["case"].get("lazy_cuda_graphs") == r["case"].get("lazy_cuda_graphs")}


def ppo_e2e_section(rows: list[dict]) -> str:
    steps = sorted(e2e_steps(rows), key=lambda r: (r["model"] or "", r["provider"],
                                                     bool(r["case"].get("lazy_cuda_graphs"))))
    if not steps:
        return "## Whole GRPO step (ppo_e2e)\n\nNo rows yet."
    notes = Notes()
    body = []
    for r in steps:
        tok = twin(rows, r, "tokens_per_s", count="all")
        phases = e2e_phases(rows, r)
        split = ", ".join(f"{name.replace('_', ' ')} {dur(phases[name])}" for name in E2E_PHASES if name in phases)
        switch = sum(phases.get(k, 0.0) for k in ("switch_to_generation", "switch_to_training"))
        ds, _ = peer(rows, r["run_id"], bench="ppo_e2e", provider="deepspeed_zero3", model=r["model"], metric="seconds")
        vs = ("–" if r["provider"] != "hybridengine"
              else ratio(ds and ds["value"], r["value"]) + notes.other_run(ds, r["run_id"]))
        label = r["provider"] + (" (lazy CUDA graphs)" if r["case"].get("lazy_cuda_graphs") else "")
        label += " (pages mapped ahead)" if r["case"].get("prepare_rollout") else ""
        body.append([r["model"], label, f"{r['num_gpus']} x {r['gpu']}", dur_spread(r),
                     fmt(tok and tok["value"]), vs,
                     f"{switch / r['value']:.1%}" if r["provider"] == "hybridengine" else "–", split])
    c = steps[0]["case"]
    return (f"## Whole GRPO step (ppo_e2e: per GPU {c.get('prompts_per_gpu')} prompts of {c.get('prompt')} tokens x "
            f"n = {c.get('samples')} x {c.get('new_tokens')} new tokens, log-probs, one update)\n\n"
            "tok/s: prompt + response tokens of all GPUs per second. Speed vs DeepSpeed = the ZeRO-3 loop's step "
            "time / hybridengine's (gather-once HF generate, ZeRO-3 forwards for log-probs, ZeRO-3 update). Switch "
            "share = (switch to generation + switch back) / step, host time of the calls. Rows marked pages mapped "
            "ahead call `engine.prepare_rollout()` after each update: the switch's host time is then the NCCL launch "
            "alone, and the all-gather's GPU time (the switch bench's 'pages mapped ahead' row, ~26 ms for 7B) runs "
            "on into the rollout set-up.\n\n"
            + table(["model", "provider", "GPUs", "s per step", "tok/s", "speed vs DeepSpeed", "switch share",
                     "phases"], body) + str(notes))
