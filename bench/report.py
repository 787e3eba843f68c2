"""Rows -> `report.md`, PNG plots, and the README's benchmark section (between its markers).

For each bench and model the report shows the latest run that measured it, and every ratio is
taken inside that run: speed relative to the named peer (> 1: faster than it) and the fraction of
the floor reached (1 = at the roofline). Floors come from the run's own floor rows:

- switch: bytes each rank receives / the run's best all-gather bus bandwidth;
- generate: per decode step, bf16 weights + the KV cache at the mean context / HBM copy bandwidth
  (prefill ignored, so the floor is optimistic);
- train step: 6 x params x tokens per GPU / the run's bf16 GEMM rate;
- segment copy, HBM copy: the run's HBM copy bandwidth; GEMM and all-gather: the datasheet.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from hybridengine.configs import MODEL_CONFIGS

BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"
DATASHEET = {"hbm_copy": 4800.0, "gemm": 989.0}
"""H200 SXM datasheet: 4.8 TB/s HBM3e, ~989 dense bf16 TFLOP/s; all-gather has no datasheet floor."""
KNOWN_BENCHES = {"hbm_copy", "gemm", "all_gather", "switch", "generate", "train_step", "segment_copy"}
PEER = {"switch": "fsdp2", "generate": "hf_generate", "train_step": "fsdp2", "segment_copy": "torch_copy"}
VARIANT_KEYS = ("case", "cache", "phase", "direction", "tg", "samples", "timer_sync")
"""Case entries that tell two rows of one provider and model apart."""


def load(path: Path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def latest(rows: list[dict], bench: str) -> list[dict]:
    """Rows of `bench` from the latest run that measured each model (None for model-less benches)."""
    by_model = defaultdict(list)
    for r in rows:
        if r["bench"] == bench:
            by_model[r["model"]].append(r)
    out = []
    for group in by_model.values():
        last = max(group, key=lambda r: r["time"])["run_id"]
        out += [r for r in group if r["run_id"] == last]
    return out


def pick(rows: list[dict], **match) -> dict | None:
    """The first row whose fields (and case entries, given as case_<key>) equal `match`."""
    for r in rows:
        if all((r["case"].get(k[5:]) if k.startswith("case_") else r.get(k)) == v for k, v in match.items()):
            return r
    return None


def fmt(x: float | None, digits: int = 0) -> str:
    return "–" if x is None else f"{x:,.{digits}f}"


def spread(r: dict, scale: float = 1.0, digits: int = 0) -> str:
    """Median with its p20-p80 range."""
    if r["p20"] is None:
        return fmt(r["value"] * scale, digits)
    return f"{fmt(r['value'] * scale, digits)} ({fmt(r['p20'] * scale, digits)}–{fmt(r['p80'] * scale, digits)})"


def ratio(a: float | None, b: float | None) -> str:
    return "–" if not a or not b else f"{a / b:.2f}"


def table(header: list[str], body: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in body])


class Floors:
    """The floor rows of one run."""

    def __init__(self, rows: list[dict], run_id: str):
        run = [r for r in rows if r["run_id"] == run_id]
        hbm, gemm = pick(run, bench="hbm_copy", metric="GB_per_s"), pick(run, bench="gemm", metric="TFLOP_per_s")
        busbw = [r["value"] for r in run if r["bench"] == "all_gather" and r["metric"] == "busbw_GB_per_s"]
        self.hbm_GBps = hbm and hbm["value"]
        self.gemm_TFLOPs = gemm and gemm["value"]
        self.busbw_GBps = max(busbw, default=None)

    def switch_s(self, case: dict) -> float | None:
        if "received_bytes_per_rank" not in case:
            return None
        return self.busbw_GBps and case["received_bytes_per_rank"] / (self.busbw_GBps * 1e9)

    def train_s(self, case: dict) -> float | None:
        if any(k not in case for k in ("params", "batch_per_gpu", "seq")):
            return None
        return self.gemm_TFLOPs and 6 * case["params"] * case["batch_per_gpu"] * case["seq"] / (self.gemm_TFLOPs * 1e12)

    def generate_tok_s(self, model: str, case: dict, num_gpus: int) -> float | None:
        needed = ("params", "prompt", "new_tokens", "batch_per_gpu")
        if not self.hbm_GBps or model not in MODEL_CONFIGS or any(k not in case for k in needed):
            return None
        cfg = MODEL_CONFIGS[model]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        context = case["prompt"] + case["new_tokens"] / 2
        kv = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 2 * context * case["batch_per_gpu"]
        step = (2 * case["params"] + kv) / (self.hbm_GBps * 1e9)
        return max(num_gpus, 1) * case["batch_per_gpu"] / step


def same_variant(a: dict, b: dict, keys: tuple[str, ...] = VARIANT_KEYS) -> bool:
    return all(a["case"].get(k) == b["case"].get(k) for k in keys)


def _label(r: dict) -> str:
    """Provider plus the case entries that tell two rows of one provider apart."""
    extra = [f"{k}={r['case'][k]}" for k in VARIANT_KEYS if k in r["case"]]
    return r["provider"] + (f" ({', '.join(extra)})" if extra else "")


def _peaks(rows: list[dict], r: dict) -> tuple[str, str]:
    out = []
    for source in ("torch", "nvml"):
        p = next((x for x in rows if x["metric"] == "peak_GiB" and x["provider"] == r["provider"]
                  and x["model"] == r["model"] and x["case"].get("source") == source
                  and same_variant(x, r, ("cache", "timer_sync"))), None)
        out.append(fmt(p and p["value"], 1))
    return out[0], out[1]


def size(nbytes: int) -> str:
    for unit, k in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= k:
            return f"{nbytes / k:.4g} {unit}"
    return f"{nbytes} B"


def shown_runs(rows: list[dict]) -> list[str]:
    """Runs that some section shows, oldest first."""
    ids = {r["run_id"] for b in {r["bench"] for r in rows} for r in latest(rows, b)}
    first = {}
    for r in rows:
        first.setdefault(r["run_id"], r["time"])
    return sorted(ids, key=first.get)


def floors_section(rows: list[dict]) -> str:
    body = []
    for run_id in shown_runs(rows):
        for r in rows:
            if r["run_id"] != run_id:
                continue
            if r["bench"] in DATASHEET and r["metric"] in ("GB_per_s", "TFLOP_per_s"):
                unit = "GB/s" if r["metric"] == "GB_per_s" else "TFLOP/s"
                what = size(r["case"]["bytes"]) if "bytes" in r["case"] else f"{r['case']['m']}^3 bf16"
                body.append([r["bench"], what, f"{spread(r)} {unit}", fmt(DATASHEET[r["bench"]]),
                             ratio(r["value"], DATASHEET[r["bench"]]), run_id])
            elif r["bench"] == "all_gather" and r["metric"] == "busbw_GB_per_s":
                body.append([f"all_gather busbw ({r['provider']}, {r['case']['world']} ranks)", size(r["case"]["bytes"]),
                             f"{spread(r)} GB/s", "–", "–", run_id])
    return "## Floors\n\n" + table(["quantity", "size", "median (p20–p80)", "datasheet", "of datasheet", "run"], body)


def _phase(r: dict) -> str | None:
    """gather (train -> generate) or release (generate -> train), whichever way a row names it."""
    return r["case"].get("phase") or {"train_to_gen": "gather", "gen_to_train": "release"}.get(r["case"].get("direction"))


def switch_section(rows: list[dict]) -> str:
    sel = latest(rows, "switch")
    body = []
    for r in sel:
        if r["metric"] != "seconds":
            continue
        fl = Floors(rows, r["run_id"])
        peer = pick(sel, provider=PEER["switch"], model=r["model"], metric="seconds", case_phase=_phase(r))
        floor = fl.switch_s(r["case"]) if _phase(r) == "gather" else None
        torch_peak, nvml_peak = _peaks(sel, r) if _phase(r) == "gather" else ("", "")
        received = r["case"].get("received_bytes_per_rank")
        body.append([r["model"] or "–", _label(r), spread(r, 1e3, 1), fmt(received and received / 1e9, 2),
                     fmt(floor and floor * 1e3, 1), ratio(floor, r["value"]), ratio(peer and peer["value"], r["value"]),
                     torch_peak, nvml_peak])
    return ("## Train -> generate switch (the peers at tg = 1: gather every parameter)\n\n"
            + table(["model", "provider", "ms (p20–p80)", "GB received/rank", "floor ms", "of floor",
                     f"speed vs {PEER['switch']}", "peak GiB torch", "peak GiB nvml"], body))


def generate_section(rows: list[dict]) -> str:
    sel = latest(rows, "generate")
    body = []
    for r in sel:
        if r["metric"] != "tokens_per_s":
            continue
        fl = Floors(rows, r["run_id"])
        secs = next((x for x in sel if x["provider"] == r["provider"] and x["model"] == r["model"]
                     and x["metric"] == "seconds" and same_variant(x, r)), None)
        peer = pick(sel, provider=PEER["generate"], model=r["model"], metric="tokens_per_s", case_cache="dynamic")
        floor = fl.generate_tok_s(r["model"], r["case"], r["num_gpus"])
        torch_peak, nvml_peak = _peaks(sel, r)
        steps = r["case"].get("new_tokens")
        body.append([r["model"] or "–", _label(r), spread(r), fmt(secs and steps and secs["value"] / steps * 1e3, 1),
                     fmt(floor), ratio(r["value"], floor), ratio(r["value"], peer and peer["value"]),
                     torch_peak, nvml_peak])
    return ("## Rollout generation (per GPU: 64 prompts x 128 random tokens, 128 new tokens, greedy)\n\n"
            "tok/s is the total over all GPUs of the run; ms/step is one generate call / 128.\n\n"
            + table(["model", "provider", "tok/s (p20–p80)", "ms/step", "floor tok/s", "of floor",
                     f"speed vs {PEER['generate']}", "peak GiB torch", "peak GiB nvml"], body))


def train_section(rows: list[dict]) -> str:
    sel = latest(rows, "train_step")
    body = []
    for r in sel:
        if r["metric"] != "seconds":
            continue
        floor = Floors(rows, r["run_id"]).train_s(r["case"])
        tok = pick(sel, provider=r["provider"], model=r["model"], metric="tokens_per_s")
        peer = pick(sel, provider=PEER["train_step"], model=r["model"], metric="seconds")
        torch_peak, nvml_peak = _peaks(sel, r)
        body.append([r["model"], r["provider"], spread(r, 1, 3), fmt(tok and tok["value"]), fmt(floor, 3),
                     ratio(floor, r["value"]), ratio(peer and peer["value"], r["value"]), torch_peak, nvml_peak])
    return ("## Train step (per GPU: 4 x 1024 tokens, fwd + bwd + AdamW, no activation checkpointing)\n\n"
            + table(["model", "provider", "s (p20–p80)", "tok/s", "floor s", "of floor", f"speed vs {PEER['train_step']}",
                     "peak GiB torch", "peak GiB nvml"], body))


def segment_copy_section(rows: list[dict]) -> str:
    sel = [r for r in latest(rows, "segment_copy") if r["metric"] == "GB_per_s"]
    body = []
    for r in sorted(sel, key=lambda r: (r["case"].get("pattern", ""), r["case"].get("bytes", 0), r["provider"])):
        peer = pick(sel, run_id=r["run_id"], provider=PEER["segment_copy"], case_pattern=r["case"].get("pattern"),
                    case_bytes=r["case"].get("bytes"))
        hbm = Floors(rows, r["run_id"]).hbm_GBps
        body.append([r["case"].get("pattern", "–"), size(r["case"].get("bytes", 0)), fmt(r["case"].get("rows")), r["provider"],
                     spread(r), ratio(r["value"], hbm), ratio(r["value"], peer and peer["value"])])
    return ("## Segment copy (resharding op; GB/s counts read + write)\n\n"
            + table(["pattern", "size", "table rows", "provider", "GB/s (p20–p80)", "of HBM copy",
                     f"speed vs {PEER['segment_copy']}"], body))


def other_section(rows: list[dict]) -> str:
    """Benches without a section of their own: every row of their latest run, as is."""
    body = []
    for bench in sorted({r["bench"] for r in rows} - KNOWN_BENCHES):
        for r in latest(rows, bench):
            if r["metric"] == "not_run":
                continue
            case = ", ".join(f"{k}={v}" for k, v in r["case"].items())
            body.append([bench, r["model"] or "–", r["provider"], case.replace("|", "/"), r["metric"],
                         spread(r, 1, 4 if abs(r["value"]) < 10 else 1), r["run_id"]])
    return "## Other benches\n\n" + (table(["bench", "model", "provider", "case", "metric", "median (p20–p80)", "run"], body)
                                      if body else "None yet.")


def not_run_section(rows: list[dict]) -> str:
    shown = set(shown_runs(rows))
    body = [[r["bench"], r["provider"], r["model"] or "–", r["case"]["reason"].replace("|", "/"), r["run_id"]]
            for r in rows if r["metric"] == "not_run" and r["run_id"] in shown]
    return "## Not run\n\n" + (table(["bench", "provider", "model", "reason", "run"], body) if body else "Nothing.")


def runs_section(rows: list[dict]) -> str:
    runs = {}
    for r in rows:
        runs.setdefault(r["run_id"], r)
    runs = {rid: runs[rid] for rid in shown_runs(rows)}
    body = [[rid, r["time"], r["commit"][:12], f"{r['num_gpus']} x {r['gpu']}", r["torch"],
             ", ".join(f"{k} {v}" for k, v in r.get("versions", {}).items() if v)] for rid, r in runs.items()]
    return "## Runs\n\n" + table(["run", "time", "commit", "GPUs", "torch", "versions"], body)


def plots(rows: list[dict], out_dir: Path) -> list[Path]:
    try:
        import matplotlib
    except ImportError:
        print("report: matplotlib is not installed (pip install .[bench]); no plots")
        return []

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []

    def save(fig, name: str) -> None:
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=110)
        plt.close(fig)
        written.append(out_dir / name)

    ag = [r for r in latest(rows, "all_gather") if r["metric"] == "busbw_GB_per_s"]
    if ag:
        fig, ax = plt.subplots(figsize=(5, 3.2))
        ag.sort(key=lambda r: r["case"]["bytes"])
        ax.plot([r["case"]["bytes"] / 2**20 for r in ag], [r["value"] for r in ag], "o-")
        ax.set(xscale="log", xlabel="all_gather output (MiB)", ylabel="bus bandwidth (GB/s)",
               title=f"all_gather_into_tensor, {ag[0]['case']['world']} x {ag[0]['gpu']}")
        save(fig, "all_gather.png")

    for bench, metric, ylabel, name in (("generate", "tokens_per_s", "tokens/s (all GPUs)", "generate.png"),
                                        ("train_step", "seconds", "seconds per step", "train_step.png"),
                                        ("switch", "seconds", "seconds", "switch.png")):
        sel = [r for r in latest(rows, bench) if r["metric"] == metric]
        if not sel:
            continue
        models = sorted({r["model"] for r in sel})
        labels = sorted({_label(r) for r in sel})
        fig, axes = plt.subplots(1, len(models), figsize=(4.5 * len(models), 3.6), squeeze=False)
        for ax, model in zip(axes[0], models):
            mine = {_label(r): r for r in sel if r["model"] == model}
            names = [lab for lab in labels if lab in mine]
            ax.bar(range(len(names)), [mine[n]["value"] for n in names],
                   yerr=[[mine[n]["value"] - (mine[n]["p20"] or mine[n]["value"]) for n in names],
                         [(mine[n]["p80"] or mine[n]["value"]) - mine[n]["value"] for n in names]])
            ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=7)
            ax.set(title=f"{bench} {model}", ylabel=ylabel)
        save(fig, name)

    seg = [r for r in latest(rows, "segment_copy") if r["metric"] == "GB_per_s"]
    if seg:
        patterns = sorted({r["case"]["pattern"] for r in seg})
        fig, axes = plt.subplots(1, len(patterns), figsize=(4.5 * len(patterns), 3.4), squeeze=False)
        for ax, pattern in zip(axes[0], patterns):
            for provider in sorted({r["provider"] for r in seg}):
                pts = sorted((r["case"]["bytes"] / 2**20, r["value"]) for r in seg
                             if r["provider"] == provider and r["case"]["pattern"] == pattern)
                if pts:
                    ax.plot(*zip(*pts), "o-", label=provider)
            ax.set(xscale="log", xlabel="bytes copied (MiB)", ylabel="GB/s (read + write)", title=pattern)
            ax.legend(fontsize=7)
        save(fig, "segment_copy.png")
    return written


def readme_section(rows: list[dict]) -> str:
    """The short table for the README: one line per (model, bench, provider)."""
    body = []
    for bench, metric, scale, unit, digits in (("switch", "seconds", 1e3, "ms", 1), ("generate", "tokens_per_s", 1, "tok/s", 0),
                                               ("train_step", "seconds", 1, "s", 3)):
        sel = latest(rows, bench)
        for r in sel:
            if r["metric"] != metric or _phase(r) == "release":
                continue
            match = {"case_cache": "dynamic"} if bench == "generate" else {}
            if bench == "switch":
                match = {"case_phase": "gather"}
            peer = pick(sel, provider=PEER[bench], model=r["model"], metric=metric, **match)
            speed = ratio(peer and peer["value"], r["value"]) if metric == "seconds" else ratio(r["value"], peer and peer["value"])
            body.append([r["model"], bench, _label(r), f"{fmt(r['value'] * scale, digits)} {unit}", speed,
                         f"{r['num_gpus']} x {r['gpu']}"])
    return (table(["model", "bench", "provider", "median", "speed vs peer", "GPUs"], body)
            + "\n\nPeers: switch and train step vs fsdp2, generate vs hf_generate (dynamic cache). "
              "Full tables, floors and plots: [bench/results/report.md](bench/results/report.md).")


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


def report(rows_path: Path, out_dir: Path, readme: Path) -> Path:
    rows = load(rows_path)
    out_dir.mkdir(parents=True, exist_ok=True)
    images = plots(rows, out_dir)
    sections = [floors_section(rows), switch_section(rows), generate_section(rows), train_section(rows),
                segment_copy_section(rows), other_section(rows), not_run_section(rows), runs_section(rows)]
    text = ("# Benchmark report\n\nGenerated by `python -m bench report` from "
            f"`{rows_path.name}` ({len(rows)} rows). " + __doc__.split("\n\n", 1)[1] + "\n"
            + "\n\n".join(sections) + "\n\n" + "\n".join(f"![{p.stem}]({p.name})" for p in images) + "\n")
    out = out_dir / "report.md"
    out.write_text(text)
    update_readme(readme, readme_section(rows))
    print(f"report: wrote {out} and {len(images)} plots")
    return out
