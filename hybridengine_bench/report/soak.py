"""The GRPO soak (bench `soak`, hybridengine_bench/soak.py): memory swing and step-time drift over minutes of steps, per
allocator setting; its table and its plot (memory and step time against the step)."""

from __future__ import annotations

import math
import statistics
from collections import defaultdict

from .fmt import Notes, dur_spread, fmt, table

BENCH = "soak"
WARMUP_FRACTION = 0.1
"""The first 10% of a run's steps (at least one: Triton compilation, the optimizer's first allocation) are
left out of its swing and drift."""
SWING_KEYS = ("nvml_peak", "max_reserved", "nvml_used", "reserved")
"""Readings of a step row's case.memory_GiB whose swing the summary gives (peaks over the step, values at its end)."""


def summarize(steps: list[dict]) -> dict | None:
    """Swing and drift of one run's step rows (any order), over the steps after the warm-up: swing_GiB =
    half the range (max - min) of each reading (None where never measured), range_GiB = [min, max];
    drift = median step time of the last fifth of those steps / of the first fifth; drift_per_token the
    same of seconds per token (the drawn lengths move it less); step_seconds = their step times. None
    when no step follows the warm-up."""
    steps = sorted(steps, key=lambda r: r["case"]["step"])
    warmup = max(1, math.ceil(WARMUP_FRACTION * len(steps)))
    after = steps[warmup:]
    if not after:
        return None
    swing, span = {}, {}
    for key in SWING_KEYS:
        values = [v for v in (r["case"]["memory_GiB"].get(key) for r in after) if v is not None]
        swing[key] = (max(values) - min(values)) / 2 if values else None
        span[key] = [min(values), max(values)] if values else None
    times = [r["value"] for r in after]
    per_token = [r["value"] / r["case"]["tokens"] for r in after]
    return dict(steps=len(steps), warmup_steps=warmup, swing_GiB=swing, range_GiB=span, drift=_drift(times),
                drift_per_token=_drift(per_token), step_seconds=times)


def _drift(xs: list[float]) -> float:
    fifth = max(1, len(xs) // 5)
    return statistics.median(xs[-fifth:]) / statistics.median(xs[:fifth])


def soak_runs(rows: list[dict]) -> list[tuple[list[dict], dict | None]]:
    """Per (model, alloc_conf, fixed_shapes): the latest run's step rows (in step order) and its summary row
    (None when the run was cut off before writing it)."""
    groups = defaultdict(list)
    for r in rows:
        if r["bench"] == BENCH and r["metric"] == "seconds":
            key = (r["model"] or "", r["case"].get("alloc_conf", "default"), bool(r["case"].get("fixed_shapes")))
            groups[key].append(r)
    out = []
    for _, group in sorted(groups.items()):
        last = max(group, key=lambda r: r["time"])["run_id"]
        mine = [r for r in group if r["run_id"] == last]
        steps = sorted((r for r in mine if not r["case"].get("summary")), key=lambda r: r["case"]["step"])
        out.append((steps, next((r for r in mine if r["case"].get("summary")), None)))
    return out


def _label(r: dict) -> str:
    fixed = " fixed shapes" if r["case"].get("fixed_shapes") else ""
    return f"{r['model']} {r['case'].get('alloc_conf', 'default')}{fixed}"


def _swing(c: dict, key: str) -> str:
    span, half = (c.get("range_GiB") or {}).get(key), (c.get("swing_GiB") or {}).get(key)
    return "–" if span is None else f"{(span[0] + span[1]) / 2:.2f} ± {half:.2f}"


def _range(span: list[int] | None) -> str:
    return "–" if not span else f"{span[0]}-{span[1]}"


def _spread(xs: list[float]) -> dict:
    q = statistics.quantiles(xs, n=5, method="inclusive") if len(xs) > 1 else [xs[0]] * 4
    return dict(value=statistics.median(xs), p20=q[0], p80=q[3])


def soak_section(rows: list[dict]) -> str:
    runs = [(steps, summary) for steps, summary in soak_runs(rows) if steps]
    title = "## GRPO soak (soak: steps with shapes drawn anew each iteration, memory and step time over minutes)"
    if not runs:
        return f"{title}\n\nNo rows yet."
    notes = Notes()
    body = []
    for steps, summary in runs:
        if summary is not None:
            c, timing, mark = summary["case"], summary, ""
        else:
            c = summarize(steps)
            if c is None:
                continue
            timing = _spread(c["step_seconds"])
            mark = notes.mark("cut off before its summary row: swing and drift computed here from its step rows.")
        r = steps[0]
        body.append([r["model"], f"{r['num_gpus']} x {r['gpu']}", r["case"].get("alloc_conf", "default"),
                     "yes" if r["case"].get("fixed_shapes") else "no", f"{c['steps']} ({c['warmup_steps']})" + mark,
                     dur_spread(timing), _swing(c, "nvml_peak"), _swing(c, "max_reserved"), _swing(c, "nvml_used"),
                     _swing(c, "reserved"), fmt(c["drift"], 3), fmt(c["drift_per_token"], 3), r["run_id"]])
    c = runs[0][0][0]["case"]
    return (f"{title}\n\nPer step: {c.get('prompts')} prompts of {_range(c.get('prompt_len'))} tokens x n = "
            f"{c.get('samples')}, max_tokens drawn from {_range(c.get('max_tokens_range'))}; rollout, log-probs, one "
            f"update. After the warm-up (the first {WARMUP_FRACTION:.0%} of the steps), memory is the midpoint ± half "
            "the range over the steps, in GiB, of the peak over each step (NVML device used, torch reserved) and of "
            "the value at its end; drift = median step time of the last fifth / the first fifth (per token: of seconds "
            "per token). Fixed shapes: the training batch padded to one length at every step. The plot soak.png shows "
            "every step.\n\n"
            + table(["model", "GPUs", "PYTORCH_CUDA_ALLOC_CONF", "fixed shapes", "steps (warm-up)", "s per step",
                     "NVML peak", "reserved peak", "NVML at end", "reserved at end", "drift", "drift per token", "run"],
                    body) + str(notes))


def soak_figure(rows: list[dict], plt):
    """Memory (NVML peak, torch reserved peak) and step time against the step, one colour per latest run of
    each variant; None without soak step rows."""
    runs = [steps for steps, _ in soak_runs(rows) if steps]
    if not runs:
        return None
    fig, (mem, sec) = plt.subplots(1, 2, figsize=(10, 3.6))
    for i, steps in enumerate(runs):
        color, x = f"C{i}", [r["case"]["step"] for r in steps]
        for key, style, what in (("nvml_peak", "-", "NVML used"), ("max_reserved", "--", "torch reserved")):
            y = [r["case"]["memory_GiB"].get(key) for r in steps]
            if any(v is not None for v in y):
                mem.plot(x, [math.nan if v is None else v for v in y], style, color=color, lw=1,
                         label=f"{_label(steps[0])}: {what}")
        sec.plot(x, [r["value"] for r in steps], "-", color=color, lw=1, label=_label(steps[0]))
        warmup = max(1, math.ceil(WARMUP_FRACTION * len(steps)))
        for ax in (mem, sec):
            ax.axvline(warmup - 0.5, color=color, ls=":", lw=0.8)
    mem.set(xlabel="step", ylabel="GiB (peak over the step)", title="device memory")
    sec.set(xlabel="step", ylabel="seconds", title="step time")
    for ax in (mem, sec):
        if ax.lines and any(not line.get_label().startswith("_") for line in ax.lines):
            ax.legend(fontsize=6)
        ax.grid(alpha=0.3)
    fig.suptitle(f"GRPO soak, {runs[0][0]['gpu']} (dotted: end of warm-up)", fontsize=8)
    return fig
