"""Number and table formatting shared by every section, and the numbered notes of a section."""

from __future__ import annotations

import math


def fmt(x: float | None, digits: int = 0) -> str:
    return "–" if x is None else f"{x:,.{digits}f}"


def sig(x: float | None, n: int = 3) -> str:
    """`n` significant digits (all integer digits from 10^n up), thousands separated."""
    if x is None:
        return "–"
    if x == 0 or abs(x) >= 10**n:
        return f"{x:,.0f}"
    x = float(f"{x:.{n}g}")
    return f"{x:,.{max(0, n - 1 - math.floor(math.log10(abs(x))))}f}"


def spread(r: dict, scale: float = 1.0, digits: int = 0) -> str:
    """Median with its p20-p80 range."""
    if r["p20"] is None:
        return fmt(r["value"] * scale, digits)
    return f"{fmt(r['value'] * scale, digits)} ({fmt(r['p20'] * scale, digits)}–{fmt(r['p80'] * scale, digits)})"


def sig_spread(r: dict | None, scale: float = 1.0) -> str:
    """Median with its p20-p80 range, 3 significant digits."""
    if r is None:
        return "–"
    if r["p20"] is None:
        return sig(r["value"] * scale)
    return f"{sig(r['value'] * scale)} ({sig(r['p20'] * scale)}–{sig(r['p80'] * scale)})"


def _unit(seconds: float) -> tuple[str, float]:
    return next(((u, k) for u, k in (("s", 1.0), ("ms", 1e-3)) if seconds >= k), ("us", 1e-6))


def dur(seconds: float | None) -> str:
    """Seconds as s, ms or us, 3 significant digits."""
    if seconds is None:
        return "–"
    unit, k = _unit(seconds)
    return f"{sig(seconds / k)} {unit}"


def dur_spread(r: dict | None) -> str:
    """A seconds row as median (p20–p80) in the unit of its median."""
    if r is None:
        return "–"
    unit, k = _unit(r["value"])
    if r["p20"] is None:
        return f"{sig(r['value'] / k)} {unit}"
    return sig_spread(r, 1 / k).replace(" (", f" {unit} (", 1)


def ratio(a: float | None, b: float | None) -> str:
    if not a or not b:
        return "–"
    return f"{a / b:.2f}" if a / b < 100 else sig(a / b)


def size(nbytes: int) -> str:
    for unit, k in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= k:
            return f"{nbytes / k:.4g} {unit}"
    return f"{nbytes} B"


def table(header: list[str], body: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in body])


def run_label(r: dict) -> str:
    return f"run {r['run_id']} ({r['num_gpus']} x {r['gpu']})"


class Notes:
    """Numbered notes of one section: `mark` gives a text's marker, str() the list."""

    def __init__(self):
        self.texts: list[str] = []

    def mark(self, text: str) -> str:
        if text not in self.texts:
            self.texts.append(text)
        return f" [{self.texts.index(text) + 1}]"

    def other_run(self, row: dict | None, own_run: str) -> str:
        """The marker saying `row` (a peer) comes from another run than `own_run`; "" for the same run or no row."""
        if row is None or row["run_id"] == own_run:
            return ""
        model = f" {row['model']}" if row["model"] else ""
        return self.mark(f"other run: {row['provider']}{model} from {run_label(row)}, not from run {own_run}.")

    def __str__(self) -> str:
        return "".join(f"\n\n[{i}] {t}" for i, t in enumerate(self.texts, 1))
