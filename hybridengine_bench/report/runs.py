"""The catch-all sections: benches without a section, rows that did not run, and the runs shown."""

from __future__ import annotations

from .fmt import dur_spread, sig_spread, table
from .rows import latest, shown_runs

KNOWN_BENCHES = {"hbm_copy", "gemm", "all_gather", "switch", "switch_memory", "switch_batch_sweep", "unit_gather",
                 "generate", "decode_step", "train_step", "segment_copy", "sampler", "paged_attention", "ppo_loss",
                 "ppo_e2e", "decode_gemm", "prefill_attention", "soak", "moe_e2e", "moe_decode", "moe_routing",
                 "grouped_gemm"}
"""Benches with a section of their own; the rest go to "Other benches"."""


def other_section(rows: list[dict]) -> str:
    """Benches without a section of their own: every row of their latest run, as is."""
    body = []
    for bench in sorted({r["bench"] for r in rows} - KNOWN_BENCHES):
        for r in latest(rows, bench):
            if r["metric"] == "not_run":
                continue
            case = ", ".join(f"{k}={v}" for k, v in r["case"].items())
            value = dur_spread(r) if r["metric"] == "seconds" else sig_spread(r)
            body.append([bench, r["model"] or "–", r["provider"], case.replace("|", "/"), r["metric"],
                         value, r["run_id"]])
    header = ["bench", "model", "provider", "case", "metric", "median (p20–p80)", "run"]
    return "## Other benches\n\n" + (table(header, body) if body else "None yet.")


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
