"""Attention kernels: paged decode (with the read floor of its bytes) and packed prefill."""

from __future__ import annotations

from .fmt import Notes, fmt, ratio, sig, sig_spread, size, table
from .roofline import Floors
from .rows import gbps, in_run, latest, peer, pick


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
                     f"{us(r)} ({c.get('num_partitions', '–')})", sig(gbps(rows, r)), us(one), sig(gbps(rows, one)),
                     us(sdpa) + sdpa_mark, sig(gbps(rows, sdpa)), us(flex) + flex_mark, sig(gbps(rows, flex)),
                     ratio(sdpa and sdpa["value"], r["value"]) + sdpa_mark, ratio(gbps(rows, r), hbm)])
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
            + table(["batch", "context", "KV", "hybridengine us (splits)", "GB/s", "one_pass us", "GB/s",
                     "sdpa_dense us", "GB/s", "flex_attention us", "GB/s", "speed vs sdpa_dense", "of HBM copy"], body)
            + str(notes)
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
        best = min(ours, key=lambda r: r["value"], default=None)
        us = lambda x: sig(x and x * 1e6)  # noqa: E731
        best_cfg = (best and f"{best['case'].get('variant')}, {best['case'].get('num_partitions')} part., "
                    f"{best['case'].get('BLOCK_N')}x{best['case'].get('num_warps')}w") or "–"
        body.append([model, str(batch), fmt(context), size(case[0]["case"].get("kv_bytes", 0)), us(floor), us(sdpa),
                     us(best and best["value"]), best_cfg, ratio(floor, best and best["value"]), ratio(floor, sdpa),
                     "yes" if floor and sdpa and sdpa / 2 >= floor else "no"])
    return ("\n\n### Read floor of the same bytes (prefetch sweep, run " + run + ")\n\n"
            "read floor: the fastest of four plain Triton kernels reading the case's K/V bytes once, contiguous, cold "
            "L2 (`hybridengine_bench.paged_attention.cold_read`); hybridengine best: the best of the split counts "
            "around the automatic plan x the default launch and five register-prefetch launches. \"of floor\": floor "
            "time / kernel time (1 = at the floor). \"2x SDPA reachable\": whether half of SDPA's time is at or above "
            "the read floor, i.e. whether any kernel that reads these bytes could be 2x SDPA.\n\n"
            + table(["model heads", "batch", "context", "KV", "read floor us", "sdpa_dense us", "hybridengine best us",
                     "best launch", "hybridengine of floor", "sdpa of floor", "2x SDPA reachable"], body))


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
            "training path's kernel). Launch: the Triton kernel's dot path (dot16-p8: 16-bit dots, P rounded once to "
            "bf16 as in flash-attention), tiles, warps, "
            "stages; sweep rows: every launch on one case, the best few on the others.\n\n"
            + table(["B x L", "provider", "launch", "TFLOP/s (p20–p80)", "of GEMM", "vs torch_varlen"], body))
