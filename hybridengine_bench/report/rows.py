"""Loading rows and finding the ones a section compares: the latest run per bench, a peer in the same run."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from .fmt import fmt

VARIANT_KEYS = ("case", "cache", "phase", "direction", "tg", "samples", "timer_sync")
"""Case entries that tell two rows of one provider and model apart."""


def load(path: Path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def latest(rows: list[dict], bench: str) -> list[dict]:
    """Rows of `bench` from the latest run that measured each (model, provider, tg); a run of tuning-sweep
    rows alone (case sweep) does not displace the latest regular run."""
    groups = defaultdict(list)
    for r in rows:
        if r["bench"] == bench:
            groups[(r["model"], r["provider"], r["case"].get("tg", 1))].append(r)
    out = []
    for group in groups.values():
        regular = [r for r in group if not r["case"].get("sweep")] or group
        last = max(regular, key=lambda r: r["time"])["run_id"]
        out += [r for r in group if r["run_id"] == last]
    return out


def matches(r: dict, match: dict) -> bool:
    """Fields (and case entries, given as case_<key>; None: absent) equal `match`."""
    return all((r["case"].get(k[5:]) if k.startswith("case_") else r.get(k)) == v for k, v in match.items())


def pick(rows: list[dict], **match) -> dict | None:
    """The first row whose fields (and case entries, given as case_<key>) equal `match`."""
    return next((r for r in rows if matches(r, match)), None)


def in_run(rows: list[dict], run_id: str) -> list[dict]:
    return [r for r in rows if r["run_id"] == run_id]


def peer(rows: list[dict], run_id: str, **match) -> tuple[dict | None, bool]:
    """The row matching `match` in run `run_id`, else in the latest run that has one; and whether it is the same run."""
    same = pick(in_run(rows, run_id), **match)
    if same is not None:
        return same, True
    found = [r for r in rows if matches(r, match)]
    if not found:
        return None, False
    return pick(in_run(found, max(found, key=lambda r: r["time"])["run_id"]), **match), False


def twin(rows: list[dict], r: dict | None, metric: str, **case) -> dict | None:
    """The row of the same run, bench, provider, model and case (plus `case` entries) with another metric."""
    if r is None:
        return None
    want = {**r["case"], **case}
    return next((x for x in rows if x["run_id"] == r["run_id"] and x["bench"] == r["bench"] and x["metric"] == metric
                 and x["provider"] == r["provider"] and x["model"] == r["model"] and x["case"] == want), None)


def same_variant(a: dict, b: dict, keys: tuple[str, ...] = VARIANT_KEYS) -> bool:
    return all(a["case"].get(k) == b["case"].get(k) for k in keys)


def label(r: dict) -> str:
    """Provider plus the case entries that tell two rows of one provider apart."""
    extra = [f"{k}={r['case'][k]}" for k in VARIANT_KEYS if k in r["case"]]
    return r["provider"] + (f" ({', '.join(extra)})" if extra else "")


def peaks(rows: list[dict], r: dict) -> tuple[str, str]:
    """The peak GiB (torch's allocator, NVML) of r's provider, model, run and variant, formatted."""
    out = []
    for source in ("torch", "nvml"):
        p = next((x for x in rows if x["metric"] == "peak_GiB" and x["provider"] == r["provider"]
                  and x["model"] == r["model"] and x["run_id"] == r["run_id"] and x["case"].get("source") == source
                  and same_variant(x, r, ("cache", "timer_sync"))), None)
        out.append(fmt(p and p["value"], 1))
    return out[0], out[1]


def shown_runs(rows: list[dict]) -> list[str]:
    """Runs that some section shows, oldest first."""
    ids = {r["run_id"] for b in {r["bench"] for r in rows} for r in latest(rows, b)}
    first = {}
    for r in rows:
        first.setdefault(r["run_id"], r["time"])
    return sorted(ids, key=first.get)


def gbps(rows: list[dict], r: dict | None) -> float | None:
    """The GB/s twin of a seconds row, or None."""
    g = twin(rows, r, "GB_per_s")
    return g and g["value"]
