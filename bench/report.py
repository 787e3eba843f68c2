"""Rows -> `report.md`, PNG plots, and the README's benchmark section (between its markers).

For each bench, model and provider the report shows the latest run that measured it. Every ratio
is taken between rows of one run where that run measured both sides; where a peer was measured
only in another run (the DeepSpeed, FSDP2 and HF peers ran apart from hybridengine), the cell
carries a numbered note that names that run. Speed > 1: faster than the peer; "of floor" 1 = at
the roofline. Floors come from the run's own rows:

- switch: bytes each rank receives / the run's best all-gather bus bandwidth, and the NCCL
  all-gather of the switch's own bytes (provider nccl);
- generate: per decode step, bf16 weights + the KV cache at the mean context / HBM copy bandwidth
  (prefill ignored, so the floor is optimistic); hybridengine's own `decode_step` floor row;
- train step: 6 x params x tokens per GPU / the run's bf16 GEMM rate; PPO loss: 6 M H V / that rate;
- segment copy, paged attention, HBM copy: the run's HBM copy bandwidth; GEMM and all-gather: the datasheet.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path

from hybridengine.model.presets import MODEL_CONFIGS

BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"
DATASHEET = {"hbm_copy": 4800.0, "gemm": 989.0}
"""H200 SXM datasheet: 4.8 TB/s HBM3e, ~989 dense bf16 TFLOP/s; all-gather has no datasheet floor."""
KNOWN_BENCHES = {"hbm_copy", "gemm", "all_gather", "switch", "switch_memory", "switch_batch_sweep", "unit_gather", "generate", "decode_step",
                 "train_step", "segment_copy", "sampler", "paged_attention", "ppo_loss", "ppo_e2e", "decode_gemm",
                 "prefill_attention"}
PEER = {"switch": "fsdp2", "generate": "hf_generate", "train_step": "fsdp2", "segment_copy": "torch_copy"}
VARIANT_KEYS = ("case", "cache", "phase", "direction", "tg", "samples", "timer_sync")
"""Case entries that tell two rows of one provider and model apart."""
GOAL = {"switch_vs_nccl": 1.15, "switch_vs_deepspeed": 1.5, "unit_gather_vs_nccl": 0.9, "decode_step_vs_floor": 1.5,
        "e2e_vs_deepspeed": 3.0, "e2e_switch_share": 0.05}
"""The issues' targets: switch time <= 1.15 x the NCCL all-gather of its bytes and >= 1.5x faster than
DeepSpeed ZeRO-3's gather; unit-gather bus bandwidth >= 0.9 x NCCL's; decode step within 1.5x of its floor."""
HEADLINE_MODEL = "qwen2-7b"
"""The README's model where a bench measured several."""


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


def _default_generate(r: dict) -> bool:
    """A generate/decode_step row of the engine's defaults, not one of the same-run variants (sync scheduling,
    the torch sampler)."""
    c = r["case"]
    return c.get("async_scheduling") is not False and c.get("sampler") != "torch"


def _label(r: dict) -> str:
    """Provider plus the case entries that tell two rows of one provider apart."""
    extra = [f"{k}={r['case'][k]}" for k in VARIANT_KEYS if k in r["case"]]
    return r["provider"] + (f" ({', '.join(extra)})" if extra else "")


def _peaks(rows: list[dict], r: dict) -> tuple[str, str]:
    out = []
    for source in ("torch", "nvml"):
        p = next((x for x in rows if x["metric"] == "peak_GiB" and x["provider"] == r["provider"]
                  and x["model"] == r["model"] and x["run_id"] == r["run_id"] and x["case"].get("source") == source
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


def _switch_rows(rows: list[dict]) -> list[dict]:
    """hybridengine's train->gen rows of the latest switch run, by model and tg."""
    sel = latest(rows, "switch")
    ours = (r for r in sel if r["provider"] == "hybridengine" and r["metric"] == "seconds" and _phase(r) == "gather"
            and "after_idle_s" not in r["case"])
    return sorted(ours, key=lambda r: (r["model"] or "", r["case"].get("tg", 0)))


def _after_idle(own: list[dict], g: dict, ahead: bool = False) -> dict | None:
    """The run's train->gen row of g's model and tg timed after an idle gap (bench switch's IDLE_GAP_S);
    `ahead`: the one whose pages were mapped during the gap (prepare_generation)."""
    return next((r for r in own if r["bench"] == "switch" and r["provider"] == "hybridengine" and r["model"] == g["model"]
                 and r["metric"] == "seconds" and r["case"].get("tg") == g["case"].get("tg")
                 and "after_idle_s" in r["case"] and (r["case"].get("pages") == "mapped ahead") == ahead), None)


def _gen_to_train(own: list[dict], model: str, tg) -> tuple[dict | None, dict | None]:
    """A run's gen->train rows at tg: the call itself, and until its pages are released (or None)."""
    backs = [r for r in own if matches(r, dict(bench="switch", provider="hybridengine", model=model, metric="seconds",
                                               case_tg=tg, case_direction="gen_to_train"))]
    return (next((r for r in backs if "until" not in r["case"]), None),
            next((r for r in backs if r["case"].get("until") == "pages released"), None))


def _unit_gather_nccl(rows: list[dict], run: str, model: str, piped: int) -> dict | None:
    """The NCCL busbw row to hold a unit-gather row against: in its run, as many all-gathers back to back
    as it pipelines layers (0: the single all-gather, else from the latest run that has one)."""
    match = dict(bench="unit_gather", provider="nccl", model=model, metric="busbw_GB_per_s")
    found = next((r for r in in_run(rows, run) if matches(r, match) and r["case"].get("pipelined", 0) == piped), None)
    if found is None and not piped:
        found, _ = peer(rows, run, **match)
    return found


def _switch_peer(rows: list[dict], r: dict, provider: str) -> tuple[dict | None, bool]:
    """A peer's gather of every parameter, at r's tg (the peers run tg = 1 only)."""
    return peer(rows, r["run_id"], bench="switch", provider=provider, model=r["model"], metric="seconds",
                case_phase="gather", case_tg=r["case"].get("tg"))


def switch_section(rows: list[dict]) -> str:
    notes = Notes()
    body = []
    for g in _switch_rows(rows):
        run, model, tg = g["run_id"], g["model"], g["case"].get("tg")
        own = in_run(rows, run)
        key = dict(bench="switch", provider="hybridengine", model=model, case_tg=tg)
        back, released = _gen_to_train(own, model, tg)
        gbps = pick(own, **key, metric="GB_per_s")
        nvml = next((r for r in own if matches(r, dict(**key, metric="peak_GiB", case_source="nvml"))
                     and r["case"].get("scope") != "above_baseline"), None)
        above = pick(own, **key, metric="peak_GiB", case_scope="above_baseline")
        mem = pick(own, bench="switch_memory", provider="hybridengine", model=model, case_tg=tg)
        nccl = pick(own, bench="switch", provider="nccl", model=model, metric="seconds", case_tg=tg)
        received = g["case"].get("received_GB")
        idle, ahead = _after_idle(own, g), _after_idle(own, g, ahead=True)
        speeds = []
        for provider in ("deepspeed_zero3", "fsdp2"):
            p, _ = _switch_peer(rows, g, provider)
            speeds.append("–" if p is None else ratio(p["value"], g["value"]) + notes.other_run(p, run))
        peak = "–" if nvml is None else f"{sig(nvml['value'])} ({sig(nvml['case'].get('model_over_tg_GiB'))})"
        if above is not None:
            peak += f", +{sig(above['value'])} over {sig(above['case'].get('baseline_GiB'))}"
        mapped = "–" if mem is None else f"{sig(mem['case'].get('before_GiB'))} → {sig(mem['value'])}"
        body.append([model or "–", str(tg), dur_spread(g), dur_spread(back), dur_spread(released) if released else "–",
                     sig(received), sig(gbps and gbps["value"]),
                     dur_spread(nccl) if nccl or received != 0 else "no bytes move",
                     ratio(g["value"], nccl and nccl["value"]),
                     "–" if idle is None else f"{dur_spread(idle)}, {ratio(idle['value'], nccl and nccl['value'])}",
                     "–" if ahead is None else f"{dur_spread(ahead)}, {ratio(ahead['value'], nccl and nccl['value'])}",
                     *speeds, peak, mapped, run])
    text = ("## Train -> generate switch\n\n"
            "hybridengine: `switch_to_generation` (train->gen) and `switch_to_training` (gen->train) of the whole "
            "model on 2 GPUs; at tg = 1 each rank receives the half it does not own, at tg = 2 no bytes move (a view "
            "change). NCCL: one `all_gather_into_tensor` of the same bytes in the same run. Speed vs a peer = the "
            "peer's gather of every parameter / hybridengine's train->gen, at tg = 1 (the peers have no tg = 2; they "
            f"receive {_peer_bytes_note(rows)} per rank, without hybridengine's 2 MiB shard padding). Peak NVML: the "
            "device's used memory during the timed switches (CUDA context and NCCL buffers included; torch's allocator "
            "sees none of the VMM-mapped buffer) next to model/tg, and (newer runs) how much it rose over the device's "
            "use just before the buffer was created (context, NCCL communicator, kernels). Mapped: GiB of the generation buffer mapped in "
            "training before -> after 100 more round trips. gen->train returns once the release is queued; the "
            "pages go back to the driver on a host thread after the GPU's queued work (\"pages released\": the "
            "call plus that wait, timed on the host). After idle: train->gen when the last release ended half a "
            "second earlier, as when a training step runs between the switches (the rows above switch back to back, "
            "right after the release, when the driver's page calls are slower), and its ratio to NCCL. Pages mapped "
            "ahead: the same, with `prepare_generation()` called at the start of the gap (where a trainer calls it "
            "after launching its last optimizer step before a rollout): the pages are mapped on a host thread "
            "meanwhile and the switch only all-gathers; G then holds model/tg from that call on.\n\n"
            + table(["model", "tg", "train->gen (p20–p80)", "gen->train (p20–p80)", "gen->train, pages released",
                     "GB received/rank", "GB/s received",
                     "NCCL all-gather, same bytes", f"hybridengine / NCCL (goal <= {GOAL['switch_vs_nccl']})",
                     "train->gen after idle, / NCCL", "after idle, pages mapped ahead, / NCCL",
                     f"speed vs DeepSpeed ZeRO-3 gather (goal >= {GOAL['switch_vs_deepspeed']})", "speed vs FSDP2 unshard",
                     "peak NVML GiB (model/tg)", "mapped GiB", "run"], body) + str(notes))
    return text + "\n\n" + _switch_sweep_table(rows) + _switch_peers_table(rows)


def _switch_sweep_table(rows: list[dict]) -> str:
    """train->gen at several NCCL group sizes (bytes received per group call), tg = 1."""
    sel = [r for r in latest(rows, "switch_batch_sweep") if r["metric"] == "seconds"]
    if not sel:
        return ""
    body = [[r["model"], (str(r["case"].get("batch_MiB")) if r["case"].get("batch_MiB") else "one all-gather per unit")
             + ("*" if r["case"].get("default") else "")
             + (f", pages {r['case']['pages']}" if "pages" in r["case"] else ""),
             f"after {r['case']['after_idle_s']} s idle" if "after_idle_s" in r["case"] else "back to back",
             dur_spread(r), r["run_id"]] for r in sorted(sel, key=lambda r: (r["model"], r["case"].get("batch_MiB", 0)))]
    return ("### Switch by NCCL group size (tg = 1)\n\n`switch_batch_bytes`: received bytes gathered per NCCL group "
            "call (default: a quarter of the switch's bytes within 256 MiB-2 GiB, marked *); \"pages kept mapped\": `switch_to_training(release=False)` kept the generation "
            "pages between switches, so no mapping is left in the switch.\n\n"
            + table(["model", "MiB per group call", "timing", "train->gen (p20–p80)", "run"], body) + "\n\n")


def _peer_bytes_note(rows: list[dict]) -> str:
    got = sorted({r["case"]["received_bytes_per_rank"] for r in latest(rows, "switch")
                  if "received_bytes_per_rank" in r["case"] and r["metric"] == "seconds"})
    return " / ".join(f"{b / 1e9:.2f} GB" for b in got) or "the model's bytes x (n-1)/n"


def _switch_peers_table(rows: list[dict]) -> str:
    """The peers' switch rows (each from its own latest run), their floor and speed vs FSDP2."""
    sel = [r for r in latest(rows, "switch") if r["provider"] not in ("hybridengine", "nccl")]
    notes = Notes()
    body = []
    for r in sel:
        if r["metric"] != "seconds":
            continue
        fl = Floors(rows, r["run_id"])
        p, _ = peer(rows, r["run_id"], bench="switch", provider=PEER["switch"], model=r["model"], metric="seconds",
                       case_phase=_phase(r))
        floor = fl.switch_s(r["case"]) if _phase(r) == "gather" else None
        torch_peak, nvml_peak = _peaks(sel, r) if _phase(r) == "gather" else ("", "")
        received = r["case"].get("received_bytes_per_rank")
        body.append([r["model"] or "–", _label(r), spread(r, 1e3, 1), fmt(received and received / 1e9, 2),
                     fmt(floor and floor * 1e3, 1), ratio(floor, r["value"]),
                     ratio(p and p["value"], r["value"]) + notes.other_run(p, r["run_id"]),
                     torch_peak, nvml_peak, r["run_id"]])
    return ("### Peers (gather every parameter at tg = 1; floor: received bytes / the run's best all-gather busbw)\n\n"
            + table(["model", "provider", "ms (p20–p80)", "GB received/rank", "floor ms", "of floor",
                     f"speed vs {PEER['switch']}", "peak GiB torch", "peak GiB nvml", "run"], body) + str(notes))


def _gather_label(r: dict) -> str:
    """How a tg > 1 unit-gather row unpacked: all of the unit (staged; rows before the direct gather have
    no `gather` key) or only its row-parallel and replicated parameters (direct)."""
    if not r["case"].get("unpack"):
        return ""
    if r["case"].get("gather") == "direct":
        return ", column params in place + unpack of the rest (direct_gather, not the default)"
    if r["case"].get("gather") == "p2p":
        return " + unpack, by send/recv in chunks (p2p_gather)"
    if r["case"].get("reshard_copy") == "copy_engine":
        return " + unpack on the copy engines (reshard_copy='copy_engine')"
    return " + unpack"


def _unpack_blocks_label(r: dict) -> str:
    """A sweep row's bound on the prefetched unpack's grid (rows without it ran the default of their run)."""
    if "unpack_blocks" not in r["case"]:
        return ""
    blocks = r["case"]["unpack_blocks"]
    return f", unpack grid <= {blocks} blocks" if blocks else ", unpack grid unbounded"


def unit_gather_section(rows: list[dict]) -> str:
    sel = latest(rows, "unit_gather")
    notes = Notes()
    body = []
    for model in sorted({r["model"] for r in sel if r["provider"] == "hybridengine"}):
        ours = sorted((r for r in sel if r["provider"] == "hybridengine" and r["model"] == model
                       and r["metric"] == "seconds"), key=lambda r: r["case"].get("tg", 0))
        if not ours:
            continue
        run = ours[0]["run_id"]
        key = dict(bench="unit_gather", model=model)
        fsdp, _ = peer(rows, run, **key, provider="fsdp2", metric="seconds")
        fsdp_mark = notes.other_run(fsdp, run)
        for piped in sorted({r["case"].get("pipelined", 0) for r in ours}):
            nccl_bw = _unit_gather_nccl(rows, run, model, piped)
            nccl_s = twin(rows, nccl_bw, "seconds")
            nccl_mark = notes.other_run(nccl_bw, run)
            for r in (r for r in ours if r["case"].get("pipelined", 0) == piped):
                bw = twin(rows, r, "busbw_GB_per_s")
                what = (f"hybridengine tg={r['case'].get('tg')}" + _gather_label(r)
                        + (f", {piped} layers pipelined (per layer"
                           + (f", {r['case']['lookahead']} prefetched ahead)" if "lookahead" in r["case"] else ")")
                           if piped else "")
                        + _unpack_blocks_label(r))
                body.append([model, sig(r["case"].get("MB")), what, dur_spread(r), sig(bw and bw["value"]),
                             ratio(bw and bw["value"], nccl_bw and nccl_bw["value"]) + nccl_mark,
                             ratio(fsdp and fsdp["value"], r["value"]) + fsdp_mark, run])
            if nccl_bw:
                body.append([model, sig(nccl_bw["case"].get("MB")), "nccl all_gather_into_tensor"
                             + (f", {piped} back to back (per layer)" if piped else ""), dur_spread(nccl_s),
                             sig(nccl_bw["value"]), "1.00", ratio(fsdp and fsdp["value"], nccl_s and nccl_s["value"]),
                             nccl_bw["run_id"]])
        if fsdp:
            body.append([model, "–", "fsdp2 unshard+reshard (bf16 params)", dur_spread(fsdp), "–", "–", "1.00",
                         fsdp["run_id"]])
    return ("## Unit gather (one decoder layer, 2 GPUs)\n\n"
            "The training view's gather of `layers.0` (tg = 2 adds the unpack to natural layout) against one raw NCCL "
            "all-gather of the same bytes and FSDP2's unshard + reshard of the same layer; pipelined: training's steady "
            "state, consecutive layers prefetched back to back (all-gathers on one stream, unpacks on another), time "
            "per layer, against as many raw all-gathers back to back. busbw = layer bytes / time "
            "x (n-1)/n. Speed vs FSDP2 = FSDP2's time / this row's time.\n\n"
            + table(["model", "layer MB", "provider", "time (p20–p80)", "busbw GB/s",
                     f"busbw / NCCL (goal >= {GOAL['unit_gather_vs_nccl']})", "speed vs FSDP2 unshard", "run"], body)
            + str(notes))


def _comparable(a: dict, b: dict) -> bool:
    """Same per-GPU generation workload."""
    return all(a["case"].get(k) == b["case"].get(k) for k in ("batch_per_gpu", "prompt", "new_tokens"))


GENERATE_PEERS = (("hf_generate", {"case_cache": "dynamic"}, "HF generate, dynamic cache"),
                  ("hf_generate", {"case_cache": "static"}, "HF generate, static cache"),
                  ("deepspeed_gather_once", {"case_timer_sync": True}, "DeepSpeed gather-once"))


def _generate_peer(rows: list[dict], r: dict, provider: str, match: dict) -> tuple[dict | None, bool]:
    p, same = peer(rows, r["run_id"], bench="generate", provider=provider, model=r["model"], metric="tokens_per_s",
                   **match)
    return (p, same) if p is not None and _comparable(p, r) else (None, True)


def _same_tg(rows: list[dict], r: dict) -> list[dict]:
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
        own = _same_tg(in_run(rows, run), r)
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
            floor_mark = notes.mark(f"decode-step floor of run {run}: weights ({sig(fc.get('weights_GiB'))} GiB) + the KV "
                       f"of {fc.get('batch_per_gpu')} sequences at mean context "
                       f"{floor['case'].get('mean_context')}, read at {fmt(floor['case']['hbm_GBps'])} GB/s (the run's "
                       f"hbm_copy: {fmt(hbm)} GB/s).")
        per_gpu = r["value"] / max(r["num_gpus"], 1)
        speeds = []
        for provider, match, _ in GENERATE_PEERS:
            p, _ = _generate_peer(rows, r, provider, match)
            speeds.append("–" if p is None else
                          ratio(per_gpu, p["value"] / max(p["num_gpus"], 1)) + notes.other_run(p, run))
        nvml = pick(own, bench="generate", provider="hybridengine", model=model, metric="peak_GiB", case_case=case,
                    case_source="nvml", case_async_scheduling=mode, case_sampler=sampler)
        shape = f"{r['case'].get('batch_per_gpu')} x {r['case'].get('new_tokens')}"
        sync = (", sync" if mode is False else "") + (", torch sampler" if sampler == "torch" else "")
        body.append([model, f"{case} (n={r['case'].get('samples')}, tg={r['case'].get('tg', 1)}{sync})", shape, sig_spread(r), str(r["num_gpus"]),
                     sig(per_gpu),
                     dur(step and step["value"]), dur(floor and floor["value"]) + floor_mark,
                     ratio(step and step["value"], floor and floor["value"]), *speeds, sig(nvml and nvml["value"]), run])
    ours = ("## Rollout generation\n\n### hybridengine\n\n"
            "`HybridEngine.generate` with CUDA graphs and async scheduling, one GPU per sequence batch at tg = 1, two at tg = 2, sampling at temperature 1 (the peers decode "
            "greedily; every call generates the full length either way). Sequences per GPU x new tokens: 64 x 128 is "
            "the peers' workload (64 prompts x 128 random tokens); grpo is 8 prompts x n = 8 samples x 512. Decode "
            "step: the engine's decode time / steps; floor: the run's `decode_step` floor row (weights + KV bytes / HBM "
            "bandwidth). Speed vs a peer: tok/s per GPU / the peer's tok/s per GPU on the same workload (the peers ran "
            "on 2 GPUs, each GPU generating for its own 64 prompts). Peak NVML includes the KV cache the engine "
            "reserves up front (gpu_memory_utilization 0.85). Rows marked sync ran with async scheduling off "
            "(`EngineConfig(async_scheduling=False)`, same engine, same run); rows marked torch sampler drew their "
            "tokens with `sampling.sample` (`EngineConfig(sampler='torch')`) instead of the fused Triton sampler, "
            "the default on CUDA (same engine, same run).\n\n"
            + table(["model", "case", "seqs/GPU x new tokens", "tok/s (p20–p80)", "GPUs", "tok/s per GPU", "decode step",
                     "floor step", f"step / floor (goal <= {GOAL['decode_step_vs_floor']})",
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
        torch_peak, nvml_peak = _peaks(sel, r)
        steps = r["case"].get("new_tokens")
        body.append([r["model"] or "–", _label(r), spread(r), fmt(secs and steps and secs["value"] / steps * 1e3, 1),
                     fmt(floor), ratio(r["value"], floor),
                     ratio(r["value"], p and p["value"]) + notes.other_run(p, r["run_id"]),
                     torch_peak, nvml_peak, r["run_id"]])
    return ("### Peers (per GPU: 64 prompts x 128 random tokens, 128 new tokens, greedy)\n\n"
            "tok/s is the total over all GPUs of the run; ms/step is one generate call / 128.\n\n"
            + table(["model", "provider", "tok/s (p20–p80)", "ms/step", "floor tok/s", "of floor",
                     f"speed vs {PEER['generate']}", "peak GiB torch", "peak GiB nvml", "run"], body) + str(notes))


def _ckpt(r: dict) -> bool:
    """A train_step row's activation checkpointing (peer rows from before the flag ran without)."""
    return bool(r["case"].get("activation_checkpointing", False))


def _train_peer(rows: list[dict], r: dict, provider: str, any_setting: bool = False) -> tuple[dict | None, bool]:
    """The peer's dense train-step row on as many GPUs as r, at r's activation-checkpointing setting
    (any setting with `any_setting`, when none matches), same run preferred."""
    cands = [x for x in rows if x["bench"] == "train_step" and x["provider"] == provider and x["model"] == r["model"]
             and x["metric"] == "seconds" and x["case"].get("layout", "dense") == "dense"
             and x["num_gpus"] == r["num_gpus"]]  # data parallelism changes the per-GPU step: same GPU count
    matching = [x for x in cands if _ckpt(x) == _ckpt(r)]
    cands = matching or (cands if any_setting else [])
    same = [x for x in cands if x["run_id"] == r["run_id"]]
    if same:
        return same[0], True
    return (max(cands, key=lambda x: x["time"]), False) if cands else (None, False)


def train_section(rows: list[dict]) -> str:
    sel = latest(rows, "train_step")
    notes = Notes()
    body = []
    for r in sorted(sel, key=lambda r: (r["model"] or "", r["provider"], _ckpt(r))):
        if r["metric"] != "seconds":
            continue
        # 6 x params x tokens at the run's GEMM peak (MFU = floor / time); our rows take the count from a peer's.
        params = r["case"].get("params") or next((x["case"]["params"] for x in rows if x["bench"] == "train_step"
                                                  and x["model"] == r["model"] and "params" in x["case"]), None)
        floor = Floors(rows, r["run_id"]).train_s({**r["case"], "params": params} if params else r["case"])
        tok = twin(rows, r, "tokens_per_s")
        p, _ = _train_peer(rows, r, PEER["train_step"])
        # This row's own setting (checkpointing, fused_training, split_master): its case plus the source.
        torch_peak, nvml_peak, buffer_peak = (fmt(p and p["value"], 1) for p in (
            twin(sel, r, "peak_GiB", source="torch"), twin(sel, r, "peak_GiB", source="nvml", scope="device_used"),
            twin(sel, r, "peak_GiB", source="torch+buffer")))
        torch_peak += "" if buffer_peak == "–" else f" (+buffer {buffer_peak})"
        label = r["provider"] + (f" ({r['case']['layout']}{', fused_training' if r['case'].get('fused_training') else ''}"
                                 f"{', split_master' if r['case'].get('split_master') else ''})"
                                 if "layout" in r["case"] else "")
        body.append([r["model"], label, "on" if _ckpt(r) else "off", spread(r, 1, 3), fmt(tok and tok["value"]),
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


def segment_copy_section(rows: list[dict]) -> str:
    sel = [r for r in latest(rows, "segment_copy") if r["metric"] == "GB_per_s"]
    body = []
    for r in sorted(sel, key=lambda r: (r["case"].get("pattern", ""), r["case"].get("bytes", 0), r["provider"])):
        peer_row = pick(sel, run_id=r["run_id"], provider=PEER["segment_copy"], case_pattern=r["case"].get("pattern"),
                        case_bytes=r["case"].get("bytes"))
        hbm = Floors(rows, r["run_id"]).hbm_GBps
        body.append([r["case"].get("pattern", "–"), size(r["case"].get("bytes", 0)), fmt(r["case"].get("rows")), r["provider"],
                     spread(r), ratio(r["value"], hbm), ratio(r["value"], peer_row and peer_row["value"])])
    runs = ", ".join(sorted({r["run_id"] for r in sel}))
    return (f"## Segment copy (resharding op; GB/s counts read + write; run {runs or '–'})\n\n"
            + table(["pattern", "size", "table rows", "provider", "GB/s (p20–p80)", "of HBM copy",
                     f"speed vs {PEER['segment_copy']}"], body))


def _gbps(rows: list[dict], r: dict | None) -> float | None:
    g = twin(rows, r, "GB_per_s")
    return g and g["value"]


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
    return (f"## Sampler (one decode step's tokens + log-probs from bf16 logits [B, 152064], T = 1; run {runs or '–'})\n\n"
            "Floor: one read of the logits at the run's HBM copy bandwidth. Speed vs torch_sample: "
            "`sampling.sample`'s time / this row's.\n\n"
            + table(["B", "provider", "splits x block", "time (p20–p80)", "floor", "of floor", "speed vs torch_sample"],
                    body) if body else "## Sampler\n\nNot run yet.")


def paged_attention_section(rows: list[dict]) -> str:
    sel = [r for r in latest(rows, "paged_attention") if r["metric"] == "seconds"]
    ours = sorted((r for r in sel if r["provider"] == "hybridengine" and r["case"].get("split") == "auto"),
                  key=lambda r: (r["case"].get("batch", 0), r["case"].get("context", 0)))
    notes = Notes()
    body = []
    for r in ours:
        run, c = r["run_id"], r["case"]
        key = dict(bench="paged_attention", model=r["model"], metric="seconds", case_batch=c.get("batch"),
                   case_context=c.get("context"))
        one = pick(in_run(rows, run), **key, provider="hybridengine", case_split="one_pass")
        cells = []
        for provider in ("sdpa_dense", "flex_attention"):
            p, _ = peer(rows, run, **key, provider=provider)
            cells.append((p, notes.other_run(p, run)))
        (sdpa, sdpa_mark), (flex, flex_mark) = cells
        us = lambda x: sig(x and x["value"] * 1e6)  # noqa: E731
        hbm = Floors(rows, run).hbm_GBps
        body.append([str(c.get("batch")), fmt(c.get("context")), size(c.get("kv_bytes", 0)),
                     f"{us(r)} ({c.get('num_partitions', '–')})", sig(_gbps(rows, r)), us(one), sig(_gbps(rows, one)),
                     us(sdpa) + sdpa_mark, sig(_gbps(rows, sdpa)), us(flex) + flex_mark, sig(_gbps(rows, flex)),
                     ratio(sdpa and sdpa["value"], r["value"]) + sdpa_mark, ratio(_gbps(rows, r), hbm)])
    if not ours:
        return "## Paged decode attention\n\nNo hybridengine rows yet."
    runs = sorted({r["run_id"] for r in ours})
    hbm_text = "; ".join(f"run {run} ({ours[0]['num_gpus']} x {ours[0]['gpu']}), "
                         f"hbm_copy {fmt(Floors(rows, run).hbm_GBps)} GB/s" for run in runs)
    return ("## Paged decode attention (one Qwen2-7B layer: 28 q heads, 4 kv heads, head_dim 128, bf16)\n\n"
            f"{hbm_text}. One query token per sequence, every sequence at the same context, cold L2. us: median "
            "microseconds per call; GB/s: K + V bytes read / time. hybridengine: the Triton paged kernel over "
            "16-token blocks with the split-K it picks (partitions in parentheses) and, where that splits, forced to "
            "one pass. sdpa_dense: `scaled_dot_product_attention` over contiguous K/V. flex_attention: compiled "
            "FlexAttention paged (128-token pages), three shapes only. Speed vs SDPA = SDPA time / hybridengine time; "
            "of HBM copy = hybridengine GB/s / the run's hbm_copy GB/s.\n\n"
            + table(["batch", "context", "KV", "hybridengine us (splits)", "GB/s", "one_pass us", "GB/s", "sdpa_dense us",
                     "GB/s", "flex_attention us", "GB/s", "speed vs sdpa_dense", "of HBM copy"], body) + str(notes)
            + _paged_read_floor_table(rows))


def _paged_read_floor_table(rows: list[dict]) -> str:
    """The prefetch sweep's cases (case sweep="prefetch", latest such run): the read floor of the same bytes
    beside dense SDPA and the kernel's default and best launch."""
    sweep = [r for r in rows if r["bench"] == "paged_attention" and r["metric"] == "seconds"
             and r["case"].get("sweep") == "prefetch"]
    if not sweep:
        return ""
    run = max(r["run_id"] for r in sweep)
    sweep = [r for r in sweep if r["run_id"] == run]
    body = []
    for model, batch, context in sorted({(r["model"], r["case"]["batch"], r["case"]["context"]) for r in sweep},
                                        key=lambda k: (k[0], k[1], k[2])):
        case = [r for r in sweep if (r["model"], r["case"]["batch"], r["case"]["context"]) == (model, batch, context)]
        floor = min((r["value"] for r in case if r["provider"] == "read_kernel"), default=None)
        sdpa = next((r["value"] for r in case if r["provider"] == "sdpa_dense"), None)
        ours = [r for r in case if r["provider"] == "hybridengine"]
        auto = min((r["value"] for r in ours if r["case"].get("variant") == "default"
                    and r["case"].get("num_partitions") == min(x["case"]["num_partitions"] for x in ours
                                                              if x["case"].get("variant") == "default")), default=None)
        best = min(ours, key=lambda r: r["value"], default=None)
        us = lambda x: sig(x and x * 1e6)  # noqa: E731
        best_cfg = (best and f"{best['case'].get('variant')}, {best['case'].get('num_partitions')} part., "
                    f"{best['case'].get('BLOCK_N')}x{best['case'].get('num_warps')}w") or "–"
        body.append([model, str(batch), fmt(context), size(case[0]["case"].get("kv_bytes", 0)), us(floor), us(sdpa),
                     us(best and best["value"]), best_cfg, ratio(floor, best and best["value"]), ratio(floor, sdpa),
                     "yes" if floor and sdpa and sdpa / 2 >= floor else "no"])
    return ("\n\n### Read floor of the same bytes (prefetch sweep, run " + run + ")\n\n"
            "read floor: the fastest of four plain Triton kernels reading the case's K/V bytes once, contiguous, cold "
            "L2 (`bench.paged_attention.cold_read`); hybridengine best: the best of the split counts around the "
            "automatic plan x the default launch and five register-prefetch launches. \"of floor\": floor time / "
            "kernel time (1 = at the floor). \"2x SDPA reachable\": whether half of SDPA's time is at or above the "
            "read floor, i.e. whether any kernel that reads these bytes could be 2x SDPA.\n\n"
            + table(["model heads", "batch", "context", "KV", "read floor us", "sdpa_dense us", "hybridengine best us",
                     "best launch", "hybridengine of floor", "sdpa of floor", "2x SDPA reachable"], body))


PPO_PROVIDERS = ("hybridengine", "torch_ref", "torch_chunked", "liger")
DECODE_GEMM_ORDER = ("qkv", "o", "gate_up", "down", "lm_head")


def prefill_attention_section(rows: list[dict]) -> str:
    sel = [r for r in latest(rows, "prefill_attention") if r["metric"] == "TFLOP_per_s"]
    if not sel:
        return "## Prefill attention\n\nNot run yet."
    run = sel[0]["run_id"]
    gemm = Floors(rows, run).gemm_TFLOPs
    body = []
    for r in sorted(sel, key=lambda r: (bool(r["case"].get("sweep")), r["case"]["length"], r["provider"],
                                        -r["value"])):
        c = r["case"]
        varlen = next((x for x in sel if x["provider"] == "torch_varlen" and x["case"]["length"] == c["length"]
                       and not x["case"].get("sweep")), None)
        launch = (f"{c['path']} {c['BLOCK_M']}x{c['BLOCK_N']}, {c['num_warps']} warps, {c['num_stages']} stages"
                  if c.get("sweep") else ("default" if r["provider"] == "hybridengine" else "–"))
        body.append([f"{c['batch']} x {fmt(c['length'])}", r["provider"], launch, sig_spread(r),
                     ratio(r["value"], gemm), ratio(r["value"], varlen and varlen["value"])])
    return (f"## Prefill attention (Qwen2-7B heads 28/4, head_dim 128, bf16, causal, packed; run {run})\n\n"
            "TFLOP/s of the causal work (4 x heads x head_dim x sum L(L+1)/2); of GEMM: against the run's bf16 "
            "8192^3 `torch.mm`; vs torch_varlen: this row's TFLOP/s / torch's varlen flash attention's (the "
            "training path's kernel). Launch: the Triton kernel's dot path (dot16: 16-bit dots, P split in two; "
            "dot16-p8: P rounded once to bf16, as flash-attention; upcast: fp32 with TF32 dots), tiles, warps, "
            "stages; sweep rows: every launch on one case, the best few on the others.\n\n"
            + table(["B x L", "provider", "launch", "TFLOP/s (p20–p80)", "of GEMM", "vs torch_varlen"], body))


def decode_gemm_section(rows: list[dict]) -> str:
    """`python -m bench.probe_gemm` rows: each decode GEMM in cuBLAS against its weight-read floor, and the
    Triton split-K GEMM that was tried against it (where the run timed one), all from the latest run."""
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
            f"Run {run} ({head['num_gpus']} x {head['gpu']}, commit {head['commit'][:12]}; `python -m bench.probe_gemm`): "
            "[M, K] @ [N, K]^T in bf16 at decode rows M, each GEMM timed in a CUDA graph over weight copies that do "
            "not fit in L2 (time per GEMM). floor: the weight bytes at the run's hbm_copy bandwidth; \"of floor\" = "
            "floor / cuBLAS time. \"/tg2\": one rank's shard at tg = 2. Triton: the split-K `decode_linear` kernel "
            "tried in session 9 (removed): its automatic plan and the best of its config sweep (M = 128 only); "
            "cuBLAS speed = Triton best / cuBLAS.\n\n"
            + table(["model", "GEMM", "M", "weights", "cuBLAS (p20–p80)", "GB/s", "floor", "of floor", "Triton plan",
                     "Triton best", "cuBLAS speed vs Triton"], body)
            + "\n\nPer decoder layer (qkv + o + gate_up + down):\n\n"
            + table(["model", "M", "cuBLAS", "floor", "of floor"], sums))


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


def _e2e_steps(rows: list[dict]) -> list[dict]:
    return [r for r in latest(rows, "ppo_e2e") if r["metric"] == "seconds" and "phase" not in r["case"]]


def _e2e_phases(rows: list[dict], r: dict) -> dict[str, float]:
    return {x["case"]["phase"]: x["value"] for x in in_run(rows, r["run_id"])
            if x["bench"] == "ppo_e2e" and x["provider"] == r["provider"] and x["model"] == r["model"]
            and x["metric"] == "seconds" and "phase" in x["case"]
            and x["case"].get("lazy_cuda_graphs") == r["case"].get("lazy_cuda_graphs")}


def ppo_e2e_section(rows: list[dict]) -> str:
    steps = sorted(_e2e_steps(rows), key=lambda r: (r["model"] or "", r["provider"],
                                                     bool(r["case"].get("lazy_cuda_graphs"))))
    if not steps:
        return "## Whole GRPO step (ppo_e2e)\n\nNo rows yet."
    notes = Notes()
    body = []
    for r in steps:
        tok = twin(rows, r, "tokens_per_s", count="all")
        phases = _e2e_phases(rows, r)
        split = ", ".join(f"{name.replace('_', ' ')} {dur(phases[name])}" for name in E2E_PHASES if name in phases)
        switch = sum(phases.get(k, 0.0) for k in ("switch_to_generation", "switch_to_training"))
        ds, _ = peer(rows, r["run_id"], bench="ppo_e2e", provider="deepspeed_zero3", model=r["model"], metric="seconds")
        vs = "–" if r["provider"] != "hybridengine" else ratio(ds and ds["value"], r["value"]) + notes.other_run(ds, r["run_id"])
        label = r["provider"] + (" (lazy CUDA graphs)" if r["case"].get("lazy_cuda_graphs") else "")
        label += " (pages mapped ahead)" if r["case"].get("prepare_rollout") else ""
        body.append([r["model"], label, f"{r['num_gpus']} x {r['gpu']}", dur_spread(r),
                     fmt(tok and tok["value"]), vs, f"{switch / r['value']:.1%}" if r["provider"] == "hybridengine" else "–",
                     split])
    c = steps[0]["case"]
    return (f"## Whole GRPO step (ppo_e2e: per GPU {c.get('prompts_per_gpu')} prompts of {c.get('prompt')} tokens x "
            f"n = {c.get('samples')} x {c.get('new_tokens')} new tokens, log-probs, one update)\n\n"
            "tok/s: prompt + response tokens of all GPUs per second. Speed vs DeepSpeed = the ZeRO-3 loop's step time / "
            "hybridengine's (gather-once HF generate, ZeRO-3 forwards for log-probs, ZeRO-3 update). Switch share = "
            "(switch to generation + switch back) / step, host time of the calls. Rows marked pages mapped ahead call "
            "`engine.prepare_rollout()` after each update: the switch's host time is then the NCCL launch alone, and "
            "the all-gather's GPU time (the switch bench's 'pages mapped ahead' row, ~26 ms for 7B) runs on into the "
            "rollout set-up.\n\n"
            + table(["model", "provider", "GPUs", "s per step", "tok/s", "speed vs DeepSpeed", "switch share", "phases"],
                    body) + str(notes))


def other_section(rows: list[dict]) -> str:
    """Benches without a section of their own: every row of their latest run, as is."""
    body = []
    for bench in sorted({r["bench"] for r in rows} - KNOWN_BENCHES):
        for r in latest(rows, bench):
            if r["metric"] == "not_run":
                continue
            case = ", ".join(f"{k}={v}" for k, v in r["case"].items())
            value = dur_spread(r) if r["metric"] == "seconds" else sig_spread(r)
            body.append([bench, r["model"] or "–", r["provider"], case.replace("|", "/"), r["metric"], value, r["run_id"]])
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
        sel = [r for r in latest(rows, bench) if r["metric"] == metric and (bench != "generate" or _default_generate(r))]
        if not sel:
            continue
        models = sorted({r["model"] for r in sel})
        labels = sorted({_label(r) for r in sel})
        fig, axes = plt.subplots(1, len(models), figsize=(4.5 * len(models), 3.6), squeeze=False)
        for ax, model in zip(axes[0], models):
            mine = {_label(r): r for r in sel if r["model"] == model}
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
    return written


def _where(r: dict, *others: dict | None) -> str:
    """GPUs and run of r, plus the run of each other row measured elsewhere."""
    out = f"{r['num_gpus']} x {r['gpu'].replace('NVIDIA ', '')}, {r['run_id']}"
    extra = {(o["provider"], o["run_id"], o["num_gpus"]) for o in others if o is not None and o["run_id"] != r["run_id"]}
    return out + "".join(f"; {p}: other run {rid} ({n} GPUs)" for p, rid, n in sorted(extra))


def _headline_model(candidates: list[dict]) -> str | None:
    models = {r["model"] for r in candidates}
    return HEADLINE_MODEL if HEADLINE_MODEL in models else min(models - {None}, default=None)


def _readme_rows(rows: list[dict]) -> list[list[str]]:
    body = []

    seg = [r for r in latest(rows, "segment_copy") if r["metric"] == "GB_per_s"]
    for target in (64 * 2**20, 4 * 2**30):
        near = [r for r in seg if abs(math.log(max(r["case"].get("bytes", 1), 1) / target)) < 0.01]
        speeds = []
        for r in near:
            if r["provider"] == "hybridengine":
                ref = pick(near, run_id=r["run_id"], provider="torch_copy", case_pattern=r["case"].get("pattern"))
                speeds.append((r["case"].get("pattern"), r, ref))
        speeds = [s for s in speeds if s[2]]
        if not speeds:
            continue
        pattern, r, ref = next((s for s in speeds if s[0] == "layer_unpack"), speeds[0])
        values = [s[1]["value"] / s[2]["value"] for s in speeds]
        plural = "s" if len(speeds) > 1 else ""
        body.append([f"Segment copy GB/s / `copy_` GB/s, {size(target)} ({pattern}; range over {len(speeds)} "
                     f"table pattern{plural})",
                     f"{sig(r['value'])} GB/s", f"{sig(ref['value'])} GB/s",
                     f"{ratio(r['value'], ref['value'])} ({min(values):.2f}–{max(values):.2f})", "–", _where(r)])

    sw = _switch_rows(rows)
    model = _headline_model(sw)
    for g in (r for r in sw if r["model"] == model):
        tg, own = g["case"].get("tg"), in_run(rows, g["run_id"])
        nccl = pick(own, bench="switch", provider="nccl", model=model, metric="seconds", case_tg=tg)
        if nccl is not None:
            body.append([f"Switch train->gen time / NCCL all-gather of the same {sig(g['case'].get('received_GB'))} GB "
                         f"per rank, {model} tg={tg}", dur(g["value"]), dur(nccl["value"]),
                         ratio(g["value"], nccl["value"]),
                         f"<= {GOAL['switch_vs_nccl']}", _where(g)])
            idle = _after_idle(own, g)
            if idle is not None:
                body.append([f"Switch train->gen {idle['case']['after_idle_s']} s after the last release (a training "
                             f"step between the switches) / NCCL all-gather of the same bytes, {model} tg={tg}",
                             dur(idle["value"]), dur(nccl["value"]), ratio(idle["value"], nccl["value"]),
                             f"<= {GOAL['switch_vs_nccl']}", _where(idle)])
            ahead = _after_idle(own, g, ahead=True)
            if ahead is not None and g["case"].get("received_GB"):
                body.append([f"Switch train->gen with its pages mapped ahead (`prepare_generation()` during the training "
                             f"step) / NCCL all-gather of the same bytes, {model} tg={tg}",
                             dur(ahead["value"]), dur(nccl["value"]), ratio(ahead["value"], nccl["value"]),
                             f"<= {GOAL['switch_vs_nccl']}", _where(ahead)])
        ds, _ = _switch_peer(rows, g, "deepspeed_zero3")
        if ds is not None:
            body.append([f"Switch speed vs DeepSpeed ZeRO-3 gather of every parameter, {model} tg={tg}", dur(g["value"]),
                         dur(ds["value"]), f"{ratio(ds['value'], g['value'])}x", f">= {GOAL['switch_vs_deepspeed']}x",
                         _where(g, ds)])
            idle = _after_idle(own, g)
            if idle is not None:
                body.append([f"Switch speed vs DeepSpeed ZeRO-3 gather, train->gen {idle['case']['after_idle_s']} s after "
                             f"the last release, {model} tg={tg}", dur(idle["value"]), dur(ds["value"]),
                             f"{ratio(ds['value'], idle['value'])}x", f">= {GOAL['switch_vs_deepspeed']}x",
                             _where(idle, ds)])
            ahead = _after_idle(own, g, ahead=True)
            if ahead is not None:
                body.append([f"Switch speed vs DeepSpeed ZeRO-3 gather, train->gen with its pages mapped ahead, {model} "
                             f"tg={tg}", dur(ahead["value"]), dur(ds["value"]), f"{ratio(ds['value'], ahead['value'])}x",
                             f">= {GOAL['switch_vs_deepspeed']}x", _where(ahead, ds)])
        back, released = _gen_to_train(own, model, tg)
        if g["case"].get("received_GB") == 0:
            body.append([f"Switch at tg={tg} (no bytes move), {model}: train->gen, gen->train", dur(g["value"]),
                         dur(back and back["value"]), "–", "< 1 ms", _where(g)])
        elif back is not None and released is not None:
            body.append([f"Switch gen->train, {model} tg={tg}: the call, and until its pages are released (host thread)",
                         dur(back["value"]), dur(released["value"]), "–", "< 1 ms", _where(g)])

    ug = [r for r in latest(rows, "unit_gather") if r["provider"] == "hybridengine" and r["metric"] == "busbw_GB_per_s"
          and r["case"].get("gather") in (None, "staged") and "unpack_blocks" not in r["case"]
          and "reshard_copy" not in r["case"]]  # the default gather; the options are in the report's table
    model = _headline_model(ug)
    for r in sorted((r for r in ug if r["model"] == model), key=lambda r: (r["case"].get("pipelined", 0),
                                                                           r["case"].get("tg", 0))):
        piped = r["case"].get("pipelined", 0)
        nccl = _unit_gather_nccl(rows, r["run_id"], model, piped)
        unpack = _gather_label(r)
        ahead = (", one prefetched ahead as in training" if r["case"].get("lookahead") == 1
                 else ", all prefetched first" if piped else "")
        unpack += f", {piped} layers pipelined{ahead} vs {piped} all-gathers back to back" if piped else ""
        body.append([f"Unit gather busbw / NCCL all-gather busbw, {model} layer ({sig(r['case'].get('MB'))} MB), "
                     f"tg={r['case'].get('tg')}{unpack}", f"{sig(r['value'])} GB/s",
                     f"{sig(nccl and nccl['value'])} GB/s", ratio(r["value"], nccl and nccl["value"]),
                     f">= {GOAL['unit_gather_vs_nccl']}", _where(r, nccl)])

    pa = [r for r in latest(rows, "paged_attention") if r["metric"] == "seconds"]
    for batch, context in ((128, 1024), (1, 16384)):
        r = pick(pa, provider="hybridengine", case_split="auto", case_batch=batch, case_context=context)
        if r is None:
            continue
        sdpa, _ = peer(rows, r["run_id"], bench="paged_attention", provider="sdpa_dense", model=r["model"],
                       metric="seconds", case_batch=batch, case_context=context)
        if sdpa is None:
            continue
        body.append([f"Decode attention speed vs dense SDPA (SDPA time / ours), B={batch}, context {context:,}",
                     f"{dur(r['value'])} ({sig(_gbps(rows, r))} GB/s)",
                     f"{dur(sdpa['value'])} ({sig(_gbps(rows, sdpa))} GB/s)",
                     ratio(sdpa["value"], r["value"]), "–", _where(r, sdpa)])

    ppo = [r for r in latest(rows, "ppo_loss") if r["metric"] == "seconds" and not r["case"].get("sweep")]
    he = pick(ppo, provider="hybridengine", case_tokens=32768) or pick(ppo, provider="hybridengine")
    if he is not None:
        tokens = he["case"].get("tokens")
        extra = twin(rows, he, "peak_GiB", source="torch", scope="extra")
        for provider, what in (("torch_ref", "naive torch (full logits)"),
                               ("torch_chunked", "chunked torch (checkpointed)")):
            p, _ = peer(rows, he["run_id"], bench="ppo_loss", provider=provider, model=he["model"], metric="seconds",
                        case_tokens=tokens, case_sweep=None)
            if p is None:
                continue
            p_extra = twin(rows, p, "peak_GiB", source="torch", scope="extra")
            body.append([f"PPO loss fwd+bwd speed vs {what}, M={tokens // 1024}k (extra peak GiB)",
                         f"{dur(he['value'])} ({sig(extra and extra['value'])} GiB)",
                         f"{dur(p['value'])} ({sig(p_extra and p_extra['value'])} GiB)",
                         f"{ratio(p['value'], he['value'])}x",
                         "–", _where(he, p)])

    pf = [r for r in latest(rows, "prefill_attention") if r["metric"] == "TFLOP_per_s" and not r["case"].get("sweep")]
    for r in sorted((x for x in pf if x["provider"] == "hybridengine"), key=lambda x: x["case"]["length"]):
        for provider, label in (("torch_varlen", "torch's varlen flash attention"), ("sdpa", "dense SDPA")):
            if provider == "sdpa" and r["case"]["length"] != 2048:  # one case against SDPA keeps the table short
                continue
            p = pick(pf, provider=provider, case_length=r["case"]["length"], case_batch=r["case"]["batch"])
            if p is not None:
                body.append([f"Prefill attention TFLOP/s / {label}, Qwen2-7B heads, {r['case']['batch']} x "
                             f"{r['case']['length']:,} tokens, causal", f"{sig(r['value'])} TFLOP/s",
                             f"{sig(p['value'])} TFLOP/s", ratio(r["value"], p["value"]), "–", _where(r, p)])

    gen = [r for r in latest(rows, "generate") if r["provider"] == "hybridengine" and r["metric"] == "tokens_per_s"
           and _default_generate(r)]
    r = pick(gen, case_case="rollout") or (gen[0] if gen else None)
    if r is not None:
        per_gpu = r["value"] / max(r["num_gpus"], 1)
        for provider, match, label in (GENERATE_PEERS[1], GENERATE_PEERS[2]):
            p, _ = _generate_peer(rows, r, provider, match)
            if p is None:
                continue
            p_gpu = p["value"] / max(p["num_gpus"], 1)
            body.append([f"Rollout tok/s per GPU / {label}, {r['model']}, {r['case'].get('batch_per_gpu')} prompts x "
                         f"{r['case'].get('new_tokens')} new tokens per GPU", f"{sig(per_gpu)} tok/s",
                         f"{sig(p_gpu)} tok/s", f"{ratio(per_gpu, p_gpu)}x", "–", _where(r, p)])
    # The decode step against its floor, per model and case (the goal is set at B = 128: the grpo case).
    for g in sorted(gen, key=lambda x: (x["model"], x["case"].get("batch_per_gpu", 0))):
        own = _same_tg(in_run(rows, g["run_id"]), g)
        step = pick(own, bench="decode_step", provider="hybridengine", model=g["model"], case_case=g["case"].get("case"),
                    case_async_scheduling=g["case"].get("async_scheduling"), case_sampler=g["case"].get("sampler"))
        floor = pick(own, bench="decode_step", provider="floor", model=g["model"], case_case=g["case"].get("case"))
        if step and floor and floor["case"].get("batch_per_gpu") == g["case"].get("batch_per_gpu"):
            tg = g["case"].get("tg", 1)
            body.append([f"Decode step / its floor (weights + KV bytes at HBM bandwidth), {g['model']}"
                         f"{f' tg={tg}' if tg > 1 else ''}, "
                         f"{floor['case'].get('batch_per_gpu')} sequences at mean context "
                         f"{floor['case'].get('mean_context')}", dur(step["value"]), dur(floor["value"]),
                         ratio(step["value"], floor["value"]), f"<= {GOAL['decode_step_vs_floor']}", _where(g)])

    tr = [r for r in latest(rows, "train_step") if r["metric"] == "seconds"]
    model = _headline_model([r for r in tr if r["provider"] == "hybridengine"]) or _headline_model(tr)
    dense = [r for r in tr if r["case"].get("layout", "dense") == "dense"]
    ours_rows = [r for r in dense if r["provider"] == "hybridengine" and r["model"] == model]
    for ours in sorted(ours_rows, key=lambda r: (_ckpt(r), bool(r["case"].get("fused_training")),
                                                 bool(r["case"].get("split_master")))):
        setting = "on" if _ckpt(ours) else "off"
        fused = f", fused_training {'on' if ours['case'].get('fused_training') else 'off'}" \
            + (", split_master" if ours["case"].get("split_master") else "")
        mem = twin(rows, ours, "peak_GiB", source="torch+buffer") or twin(rows, ours, "peak_GiB", source="torch")
        for provider, label in (("fsdp2", "FSDP2"), ("deepspeed_zero3", "DeepSpeed ZeRO-3")):
            p, _ = _train_peer(rows, ours, provider, any_setting=True)
            if p is not None:
                sides = (f"activation checkpointing {setting} on both sides{fused}" if _ckpt(p) == _ckpt(ours) else
                         f"activation checkpointing: ours {setting}{fused}, peer {'on' if _ckpt(p) else 'off'}")
                p_mem = twin(rows, p, "peak_GiB", source="torch")
                body.append([f"Train step speed vs {label}, {model}, per GPU {ours['case'].get('batch_per_gpu')} x "
                             f"{ours['case'].get('seq')} tokens, {sides} (peak GiB, torch; ours + the mapped buffer where measured)",
                             f"{dur(ours['value'])} ({sig(mem and mem['value'])} GiB)",
                             f"{dur(p['value'])} ({sig(p_mem and p_mem['value'])} GiB)",
                             f"{ratio(p['value'], ours['value'])}x", ">= 1.1x" if provider == "fsdp2" else "–",
                             _where(ours, p)])
    if not ours_rows:
        fsdp = pick(dense, provider="fsdp2", model=model)
        ds = fsdp and _train_peer(rows, fsdp, "deepspeed_zero3")[0]
        if ds is not None:
            body.append([f"Train step, {model}, per GPU {fsdp['case'].get('batch_per_gpu')} x {fsdp['case'].get('seq')} "
                         "tokens (peers only; no hybridengine train-step rows): FSDP2 speed vs DeepSpeed ZeRO-3",
                         f"FSDP2 {dur(fsdp['value'])}", f"ZeRO-3 {dur(ds['value'])}",
                         f"{ratio(ds['value'], fsdp['value'])}x", "–", _where(fsdp, ds)])
    for r in sorted(_e2e_steps(rows), key=lambda r: (r["model"] or "", not r["case"].get("lazy_cuda_graphs"))):
        if r["provider"] != "hybridengine":
            continue
        ds, _ = peer(rows, r["run_id"], bench="ppo_e2e", provider="deepspeed_zero3", model=r["model"], metric="seconds")
        c = r["case"]
        graphs = "lazy CUDA graphs" if c.get("lazy_cuda_graphs") else "CUDA graphs captured at rollout entry"
        work = (f"{r['model']}, per GPU {c.get('prompts_per_gpu')} prompts x n={c.get('samples')} x "
                f"{c.get('new_tokens')} new tokens, {graphs}")
        if ds is not None:
            body.append([f"Whole GRPO step speed vs a DeepSpeed ZeRO-3 loop, {work}", dur(r["value"]), dur(ds["value"]),
                         f"{ratio(ds['value'], r['value'])}x", f">= {GOAL['e2e_vs_deepspeed']}x", _where(r, ds)])
        phases = _e2e_phases(rows, r)
        switch = sum(phases.get(k, 0.0) for k in ("switch_to_generation", "switch_to_training"))
        body.append([f"Switch share of the whole GRPO step, {work}", dur(switch), dur(r["value"]),
                     f"{switch / r['value']:.1%}", f"< {GOAL['e2e_switch_share']:.0%}", _where(r)])
    return body


def readme_section(rows: list[dict]) -> str:
    """The README's headline table: the key ratios, each with its GPUs and run."""
    return (table(["measure", "value", "reference", "ratio", "goal", "GPUs, run"], _readme_rows(rows))
            + "\n\nEach ratio comes from rows of one run unless the last column names another run for the reference. "
              "Full tables, floors, peers, notes and plots: [bench/results/report.md](bench/results/report.md).")


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
    sections = [floors_section(rows), switch_section(rows), unit_gather_section(rows), generate_section(rows),
                train_section(rows), segment_copy_section(rows), sampler_section(rows), paged_attention_section(rows), prefill_attention_section(rows), decode_gemm_section(rows), ppo_loss_section(rows),
                ppo_e2e_section(rows), other_section(rows), not_run_section(rows), runs_section(rows)]
    text = ("# Benchmark report\n\nGenerated by `python -m bench report` from "
            f"`{rows_path.name}` ({len(rows)} rows). " + __doc__.split("\n\n", 1)[1] + "\n"
            + "\n\n".join(sections) + "\n\n" + "\n".join(f"![{p.stem}]({p.name})" for p in images) + "\n")
    out = out_dir / "report.md"
    out.write_text(text)
    update_readme(readme, readme_section(rows))
    print(f"report: wrote {out} and {len(images)} plots")
    return out
