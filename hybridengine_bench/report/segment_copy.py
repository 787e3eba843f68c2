"""The resharding copy (segment copy) against `copy_` and the HBM copy floor."""

from __future__ import annotations

from .fmt import fmt, ratio, size, spread, table
from .roofline import Floors
from .rows import latest, pick
from .targets import PEER


def segment_copy_section(rows: list[dict]) -> str:
    sel = [r for r in latest(rows, "segment_copy") if r["metric"] == "GB_per_s"]
    body = []
    for r in sorted(sel, key=lambda r: (r["case"].get("pattern", ""), r["case"].get("bytes", 0), r["provider"])):
        peer_row = pick(sel, run_id=r["run_id"], provider=PEER["segment_copy"], case_pattern=r["case"].get("pattern"),
                        case_bytes=r["case"].get("bytes"))
        hbm = Floors(rows, r["run_id"]).hbm_GBps
        body.append([r["case"].get("pattern", "–"), size(r["case"].get("bytes", 0)), fmt(r["case"].get("rows")),
                     r["provider"], spread(r), ratio(r["value"], hbm),
                     ratio(r["value"], peer_row and peer_row["value"])])
    runs = ", ".join(sorted({r["run_id"] for r in sel}))
    return (f"## Segment copy (resharding op; GB/s counts read + write; run {runs or '–'})\n\n"
            + table(["pattern", "size", "table rows", "provider", "GB/s (p20–p80)", "of HBM copy",
                     f"speed vs {PEER['segment_copy']}"], body))
