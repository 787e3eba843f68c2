"""PNG plots of the latest run per provider (matplotlib, optional)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from .roofline import Floors
from .rollout import default_generate
from .rows import label, latest
from .soak import soak_figure
from .train import PPO_PROVIDERS


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

    ag = latest([r for r in rows if r["metric"] == "busbw_GB_per_s"], "all_gather")  # runs with > 1 GPU
    if ag:
        fig, ax = plt.subplots(figsize=(5, 3.2))
        ag.sort(key=lambda r: r["case"]["bytes"])
        ax.plot([r["case"]["bytes"] / 2**20 for r in ag], [r["value"] for r in ag], "o-")
        ax.set(xscale="log", xlabel="all_gather output (MiB)", ylabel="bus bandwidth (GB/s)",
               title=f"all_gather_into_tensor, {ag[0]['case']['world']} x {ag[0]['gpu']}")
        save(fig, "all_gather.png")

    for bench, metric, ylabel, name, per_gpu in (
            ("generate", "tokens_per_s", "tokens/s per GPU", "generate.png", True),
            ("train_step", "seconds", "seconds per step", "train_step.png", False),
            ("switch", "seconds", "seconds", "switch.png", False)):
        sel = [r for r in latest(rows, bench) if r["metric"] == metric and (bench != "generate" or default_generate(r))]
        if not sel:
            continue
        models = sorted({r["model"] for r in sel})
        labels = sorted({label(r) for r in sel})
        fig, axes = plt.subplots(1, len(models), figsize=(4.5 * len(models), 3.6), squeeze=False)
        for ax, model in zip(axes[0], models):
            mine = {label(r): r for r in sel if r["model"] == model}
            names = [lab for lab in labels if lab in mine]
            div = [max(mine[n]["num_gpus"], 1) if per_gpu else 1 for n in names]
            ax.bar(range(len(names)), [mine[n]["value"] / d for n, d in zip(names, div)],
                   yerr=[[(mine[n]["value"] - (mine[n]["p20"] or mine[n]["value"])) / d for n, d in zip(names, div)],
                         [((mine[n]["p80"] or mine[n]["value"]) - mine[n]["value"]) / d for n, d in zip(names, div)]])
            ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=7)
            ax.set(title=f"{bench} {model}", ylabel=ylabel)
        fig.suptitle("latest run per provider", fontsize=8)
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

    pa = [r for r in latest(rows, "paged_attention") if r["metric"] == "GB_per_s" and "context" in r["case"]]
    if pa:
        batches = sorted({r["case"].get("batch") for r in pa})
        fig, axes = plt.subplots(1, len(batches), figsize=(4.2 * len(batches), 3.4), squeeze=False)
        hbm = {Floors(rows, r["run_id"]).hbm_GBps for r in pa} - {None}

        def name(r: dict) -> str:
            return r["provider"] + (f" {r['case']['split']}" if "split" in r["case"] else "")

        colors = {n: f"C{i}" for i, n in enumerate(sorted({name(r) for r in pa}))}
        for ax, batch in zip(axes[0], batches):
            lines = defaultdict(list)
            for r in pa:
                if r["case"].get("batch") == batch:
                    lines[name(r)].append((r["case"]["context"], r["value"]))
            for n, pts in sorted(lines.items()):
                ax.plot(*zip(*sorted(pts)), "o-", label=n, color=colors[n])
            for i, h in enumerate(sorted(hbm)):
                ax.axhline(h, color="grey", ls="--", lw=0.8, label="hbm_copy" if i == 0 else None)
            ax.set(xscale="log", xlabel="context (tokens)", ylabel="GB/s (K + V read)",
                   title=f"decode attention, batch {batch}")
            ax.legend(fontsize=7)
        save(fig, "paged_attention.png")

    ppo = [r for r in latest(rows, "ppo_loss") if r["metric"] == "seconds" and not r["case"].get("sweep")]
    if ppo:
        fig, ax = plt.subplots(figsize=(5, 3.4))
        for provider in [p for p in PPO_PROVIDERS if any(r["provider"] == p for r in ppo)]:
            pts = sorted((r["case"]["tokens"], r["value"] * 1e3) for r in ppo if r["provider"] == provider)
            ax.plot(*zip(*pts), "o-", label=provider)
        ax.set(xscale="log", yscale="log", xlabel="M (tokens)", ylabel="ms (fwd + bwd)",
               title=f"PPO loss over the LM head, {ppo[0]['gpu']}")
        ax.legend(fontsize=7)
        save(fig, "ppo_loss.png")

    fig = soak_figure(rows, plt)
    if fig is not None:
        save(fig, "soak.png")
    return written
