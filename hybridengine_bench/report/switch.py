"""The train -> generate switch (ours against NCCL and the peers) and the training view's unit gather."""

from __future__ import annotations

from .fmt import Notes, dur_spread, fmt, ratio, sig, spread, table
from .roofline import Floors
from .rows import in_run, label, latest, matches, peaks, peer, pick, twin
from .targets import GOAL, PEER


def phase_of(r: dict) -> str | None:
    """gather (train -> generate) or release (generate -> train), whichever way a row names it."""
    return (r["case"].get("phase")
            or {"train_to_gen": "gather", "gen_to_train": "release"}.get(r["case"].get("direction")))


def switch_rows(rows: list[dict]) -> list[dict]:
    """hybridengine's train->gen rows of the latest switch run, by model and tg."""
    sel = latest(rows, "switch")
    ours = (r for r in sel if r["provider"] == "hybridengine" and r["metric"] == "seconds" and phase_of(r) == "gather"
            and "after_idle_s" not in r["case"])
    return sorted(ours, key=lambda r: (r["model"] or "", r["case"].get("tg", 0)))


def after_idle(own: list[dict], g: dict, ahead: bool = False) -> dict | None:
    """The run's train->gen row of g's model and tg timed after an idle gap (bench switch's IDLE_GAP_S);
    `ahead`: the one whose pages were mapped during the gap (prepare_generation)."""
    return next((r for r in own if r["bench"] == "switch" and r["provider"] == "hybridengine"
                 and r["model"] == g["model"] and r["metric"] == "seconds"
                 and r["case"].get("tg") == g["case"].get("tg")
                 and "after_idle_s" in r["case"] and (r["case"].get("pages") == "mapped ahead") == ahead), None)


def gen_to_train(own: list[dict], model: str, tg) -> tuple[dict | None, dict | None]:
    """A run's gen->train rows at tg: the call itself, and until its pages are released (or None)."""
    backs = [r for r in own if matches(r, dict(bench="switch", provider="hybridengine", model=model, metric="seconds",
                                               case_tg=tg, case_direction="gen_to_train"))]
    return (next((r for r in backs if "until" not in r["case"]), None),
            next((r for r in backs if r["case"].get("until") == "pages released"), None))


def unit_gather_nccl(rows: list[dict], run: str, model: str, piped: int) -> dict | None:
    """The NCCL busbw row to hold a unit-gather row against: in its run, as many all-gathers back to back
    as it pipelines layers (0: the single all-gather, else from the latest run that has one)."""
    match = dict(bench="unit_gather", provider="nccl", model=model, metric="busbw_GB_per_s")
    found = next((r for r in in_run(rows, run) if matches(r, match) and r["case"].get("pipelined", 0) == piped), None)
    if found is None and not piped:
        found, _ = peer(rows, run, **match)
    return found


def switch_peer(rows: list[dict], r: dict, provider: str) -> tuple[dict | None, bool]:
    """A peer's gather of every parameter, at r's tg (the peers run tg = 1 only)."""
    return peer(rows, r["run_id"], bench="switch", provider=provider, model=r["model"], metric="seconds",
                case_phase="gather", case_tg=r["case"].get("tg"))


def switch_section(rows: list[dict]) -> str:
    notes = Notes()
    body = []
    for g in switch_rows(rows):
        run, model, tg = g["run_id"], g["model"], g["case"].get("tg")
        own = in_run(rows, run)
        key = dict(bench="switch", provider="hybridengine", model=model, case_tg=tg)
        back, released = gen_to_train(own, model, tg)
        gbps = pick(own, **key, metric="GB_per_s")
        nvml = next((r for r in own if matches(r, dict(**key, metric="peak_GiB", case_source="nvml"))
                     and r["case"].get("scope") != "above_baseline"), None)
        above = pick(own, **key, metric="peak_GiB", case_scope="above_baseline")
        mem = pick(own, bench="switch_memory", provider="hybridengine", model=model, case_tg=tg)
        nccl = pick(own, bench="switch", provider="nccl", model=model, metric="seconds", case_tg=tg)
        received = g["case"].get("received_GB")
        idle, ahead = after_idle(own, g), after_idle(own, g, ahead=True)
        speeds = []
        for provider in ("deepspeed_zero3", "fsdp2"):
            p, _ = switch_peer(rows, g, provider)
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
            "use just before the buffer was created (context, NCCL communicator, kernels). Mapped: GiB of the "
            "generation buffer mapped in training before -> after 100 more round trips. gen->train returns once the "
            "release is queued; the pages go back to the driver on a host thread after the GPU's queued work (\"pages "
            "released\": the call plus that wait, timed on the host). After idle: train->gen when the last release "
            "ended half a second earlier, as when a training step runs between the switches (the rows above switch "
            "back to back, right after the release, when the driver's page calls are slower), and its ratio to NCCL. "
            "Pages mapped ahead: the same, with `prepare_generation()` called at the start of the gap (where a trainer "
            "calls it after launching its last optimizer step before a rollout): the pages are mapped on a host thread "
            "meanwhile and the switch only all-gathers; G then holds model/tg from that call on.\n\n"
            + table(["model", "tg", "train->gen (p20–p80)", "gen->train (p20–p80)", "gen->train, pages released",
                     "GB received/rank", "GB/s received",
                     "NCCL all-gather, same bytes", f"hybridengine / NCCL (goal <= {GOAL['switch_vs_nccl']})",
                     "train->gen after idle, / NCCL", "after idle, pages mapped ahead, / NCCL",
                     f"speed vs DeepSpeed ZeRO-3 gather (goal >= {GOAL['switch_vs_deepspeed']})",
                     "speed vs FSDP2 unshard", "peak NVML GiB (model/tg)", "mapped GiB", "run"], body) + str(notes))
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
             dur_spread(r), r["run_id"]]
            for r in sorted(sel, key=lambda r: (r["model"], r["case"].get("batch_MiB", 0)))]
    return ("### Switch by NCCL group size (tg = 1)\n\n`switch_batch_bytes`: received bytes gathered per NCCL group "
            "call (default: a quarter of the switch's bytes within 256 MiB-2 GiB, marked *); \"pages kept mapped\": "
            "`switch_to_training(release=False)` kept the generation pages between switches, so no mapping is left in "
            "the switch.\n\n"
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
                       case_phase=phase_of(r))
        floor = fl.switch_s(r["case"]) if phase_of(r) == "gather" else None
        torch_peak, nvml_peak = peaks(sel, r) if phase_of(r) == "gather" else ("", "")
        received = r["case"].get("received_bytes_per_rank")
        body.append([r["model"] or "–", label(r), spread(r, 1e3, 1), fmt(received and received / 1e9, 2),
                     fmt(floor and floor * 1e3, 1), ratio(floor, r["value"]),
                     ratio(p and p["value"], r["value"]) + notes.other_run(p, r["run_id"]),
                     torch_peak, nvml_peak, r["run_id"]])
    return ("### Peers (gather every parameter at tg = 1; floor: received bytes / the run's best all-gather busbw)\n\n"
            + table(["model", "provider", "ms (p20–p80)", "GB received/rank", "floor ms", "of floor",
                     f"speed vs {PEER['switch']}", "peak GiB torch", "peak GiB nvml", "run"], body) + str(notes))


def gather_label(r: dict) -> str:
    """" + unpack" for a tg > 1 unit-gather row (the gathered unit unpacked to natural layout), else ""."""
    return " + unpack" if r["case"].get("unpack") else ""


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
            nccl_bw = unit_gather_nccl(rows, run, model, piped)
            nccl_s = twin(rows, nccl_bw, "seconds")
            nccl_mark = notes.other_run(nccl_bw, run)
            for r in (r for r in ours if r["case"].get("pipelined", 0) == piped):
                bw = twin(rows, r, "busbw_GB_per_s")
                what = (f"hybridengine tg={r['case'].get('tg')}" + gather_label(r)
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
            "all-gather of the same bytes and FSDP2's unshard + reshard of the same layer; pipelined: training's "
            "steady state, consecutive layers prefetched back to back (all-gathers on one stream, unpacks on another), "
            "time per layer, against as many raw all-gathers back to back. busbw = layer bytes / time x (n-1)/n. Speed "
            "vs FSDP2 = FSDP2's time / this row's time.\n\n"
            + table(["model", "layer MB", "provider", "time (p20–p80)", "busbw GB/s",
                     f"busbw / NCCL (goal >= {GOAL['unit_gather_vs_nccl']})", "speed vs FSDP2 unshard", "run"], body)
            + str(notes))
