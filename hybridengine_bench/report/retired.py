"""Rows of retired variants: options and kernel paths that were measured, lost, and left the package.

Their rows stay in results.jsonl (the evidence); the report's sections leave them out and one short
section counts them. hybridengine_bench/README.md ("Retired experiments") gives, for each, the commit that last had
it and the measurement that retired it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .fmt import table


@dataclass(frozen=True)
class Retired:
    name: str
    """The option or kernel path, as the package spelled it."""
    matches: Callable[[dict], bool]
    """Whether a row measured it."""


def _case(bench: str, key: str, *values) -> Callable[[dict], bool]:
    return lambda r: r["bench"] == bench and r["case"].get(key) in values


def _page_calls(r: dict) -> bool:
    # The batched page calls' timings, and the not_run row of their first form (one cuMemCreate for several
    # pieces, mapped at offsets into it: the driver refused).
    return (r["bench"] == "switch_detail" and bool(r["case"].get("batch_page_calls"))) or (
        r["metric"] == "not_run" and "for pieces at offsets" in r["case"].get("reason", ""))


RETIRED = (
    Retired("ShardedBuffer(direct_gather=True)", _case("unit_gather", "gather", "direct")),
    Retired("ShardedBuffer(p2p_gather=True)", _case("unit_gather", "gather", "p2p")),
    Retired("ShardedBuffer(reshard_copy='copy_engine') and the copy_2d op", _case("unit_gather", "reshard_copy",
                                                                                   "copy_engine")),
    Retired("ShardedBuffer(batch_page_calls=True)", _page_calls),
    Retired("prefill attention P_SPLIT=True (P split in two 16-bit parts)", _case("prefill_attention", "path",
                                                                                  "dot16")),
    Retired("prefill attention DOT_16BIT=False (fp32 upcast, TF32 dots)", _case("prefill_attention", "path", "upcast")),
    Retired("paged decode attention DOT_16BIT=False (fp32 upcast, TF32 dots)", _case("paged_attention", "dot",
                                                                                      "upcast_tf32")),
    Retired("paged decode split-K FUSED_REDUCE (the last partition's program merges)",
            _case("paged_attention", "fused_reduce", True)),
)


def split_retired(rows: list[dict]) -> tuple[list[dict], dict[str, list[dict]]]:
    """The rows of current variants, and the retired ones by variant name."""
    kept, retired = [], {}
    for r in rows:
        hit = next((x.name for x in RETIRED if x.matches(r)), None)
        if hit is None:
            kept.append(r)
        else:
            retired.setdefault(hit, []).append(r)
    return kept, retired


def retired_section(retired: dict[str, list[dict]]) -> str:
    if not retired:
        return "## Retired variants\n\nNone among these rows."
    body = [[x.name, str(len(retired[x.name])), ", ".join(sorted({r["run_id"] for r in retired[x.name]}))]
            for x in RETIRED if x.name in retired]
    return ("## Retired variants\n\nRows of options and kernel paths that lost their measurement and were removed "
            "from the package. They stay in the rows file and no other section shows them; "
            "hybridengine_bench/README.md (\"Retired experiments\") gives for each the commit that last had it and "
            "the measurement that retired it.\n\n" + table(["variant", "rows", "runs"], body))
