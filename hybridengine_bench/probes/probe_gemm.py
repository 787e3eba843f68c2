"""Probe: the decode step's GEMMs (M = decode batch rows) with cuBLAS's default choice and with TunableOp.

    python -m hybridengine_bench.probes.probe_gemm [--out DIR]

Each shape is one projection of Qwen2.5-1.5B or Qwen2-7B at tg = 1 ([M, K] @ [N, K]^T, bf16, the
qkv projection with its bias as the model runs it). Weights as in a decode step: each of L distinct
copies (L x weight bytes > 200 MB, so L2 holds none of them) is read once per pass, L back-to-back
`F.linear`s captured in one CUDA graph, replayed; the time per GEMM is the replay time / L. GB/s counts
the weight bytes (activations are < 5% of them at M <= 256); the floor column is those bytes at the
`hbm_copy` bandwidth of the same run.

Variants: "cublas" (torch's default heuristics) and, with --tunableop, "tunableop" (torch.cuda.tunable:
every cuBLASLt algorithm for the shape timed once before the capture, the fastest kept). Results print,
go to $OUT/probe_gemm.json (median and p20/p80 per GEMM in us) and, as bench rows (bench "decode_gemm":
provider = variant, model = the shape's model (with "/tg2" for a rank's shard), case = gemm, m, n, k,
weight_bytes; metric seconds per GEMM; plus provider "floor": the weight bytes at the run's hbm_copy
bandwidth), to $OUT/results.jsonl; `python -m hybridengine_bench report` tables them. `to_rows` converts a
probe_gemm.json of an earlier run.

Findings on an H200 (the rows are in hybridengine_bench/results/results.jsonl, bench decode_gemm):
- TunableOp's only candidate on this torch build is cuBLAS's default ("Default" for every shape): same times.
- cuBLAS at M = 128 reads the 1.5B qkv / o weights at 0.8-1.0 TB/s, gate_up / down at 2.0-2.7 TB/s; a
  1.5B decode step's GEMMs alone take 1.41 ms (its weights at HBM bandwidth: 0.75 ms); with its KV read at
  HBM bandwidth (GRPO case, 128 sequences at mean context 384: 0.33 ms) that is 1.6x the step's floor (1.09 ms).
- A split-K Triton GEMM written for these shapes (one launch, the last split of a tile merging the fp32
  partials; commit 9908d11, removed since) was slower than cuBLAS at every shape, 1.06-2.7x its time with its plan
  and 1.10-1.8x at the best of 15 configs (M = 128).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

from ..common import commit, graph_seconds, versions

SHAPES = {  # name: (N, K, bias)
    "qwen2.5-1.5b": {"qkv": (2048, 1536, True), "o": (1536, 1536, False), "gate_up": (17920, 1536, False),
                     "down": (1536, 8960, False), "lm_head": (151936, 1536, False)},
    "qwen2-7b": {"qkv": (4608, 3584, True), "o": (3584, 3584, False), "gate_up": (37888, 3584, False),
                 "down": (3584, 18944, False)},
    # one rank's shards at tg = 2: column-parallel qkv / gate_up halve N, row-parallel o / down halve K
    "qwen2.5-1.5b/tg2": {"qkv": (1024, 1536, True), "o": (1536, 768, False), "gate_up": (8960, 1536, False),
                         "down": (1536, 4480, False)},
    "qwen2-7b/tg2": {"qkv": (2304, 3584, True), "o": (3584, 1792, False), "gate_up": (18944, 3584, False),
                     "down": (3584, 9472, False)},
}
BENCH = "decode_gemm"
ROWS = (64, 128, 256)


def hbm_bandwidth() -> float:
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for i in range(13):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        if i >= 3:
            times.append(a.elapsed_time(b) / 1e3)
    return 2 * src.numel() / statistics.median(times)


def per_gemm_seconds(x: torch.Tensor, weights: list[torch.Tensor], bias: torch.Tensor | None,
                     replays: int = 20) -> list[float]:
    """Seconds per GEMM: `F.linear(x, w, bias)` for each of the distinct weights back to back in one CUDA graph."""
    outs = [None] * len(weights)

    def chain():
        for i, w in enumerate(weights):
            outs[i] = F.linear(x, w, bias)
    return [t / len(weights) for t in graph_seconds(chain, warmup=2, replays=replays)]


def to_rows(probe: dict, *, run_id: str, time: str, commit: str, versions: dict) -> list[dict]:
    """Bench rows (hybridengine_bench.common.FIELDS) from a probe_gemm.json: one per timed GEMM (the variant as
    provider; a config, where the variant had one, in the case) and one "floor" row per shape."""
    base = dict(run_id=run_id, time=time, commit=commit, gpu=probe["device"], num_gpus=1, torch=probe["torch"],
                bench=BENCH)
    rows, floors = [], {}
    for r in probe["rows"]:
        case = dict(gemm=r["gemm"], m=r["m"], n=r["n"], k=r["k"], weight_bytes=r["weight_bytes"])
        if r.get("config") is not None and r["variant"] != "cublas":
            case["config"] = r["config"]
        rows.append(dict(base, provider=r["variant"], model=r["model"], case=case, metric="seconds",
                         value=r["us"] / 1e6, p20=r["p20_us"] / 1e6, p80=r["p80_us"] / 1e6, versions=versions))
        floors[(r["model"], r["gemm"], r["m"])] = dict(
            base, provider="floor", model=r["model"], case=dict(case, hbm_GBps=probe["hbm_copy_GB_per_s"]),
            metric="seconds", value=r["floor_us"] / 1e6, p20=None, p80=None, versions=versions)
    for row in floors.values():
        row["case"].pop("config", None)
    return rows + list(floors.values())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    ap.add_argument("--tunableop", action="store_true", help="also time every shape with torch.cuda.tunable")
    args = ap.parse_args()
    torch.manual_seed(0)
    bw = hbm_bandwidth()
    print(f"hbm_copy {bw / 1e9:,.0f} GB/s ({torch.cuda.get_device_name()}, torch {torch.__version__})")
    results = {"hbm_copy_GB_per_s": bw / 1e9, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "rows": []}
    from torch.cuda import tunable
    if hasattr(tunable, "write_file_on_exit"):
        tunable.write_file_on_exit(False)
    for variant in ("cublas", "tunableop") if args.tunableop else ("cublas",):
        tunable.enable(variant == "tunableop")
        tunable.tuning_enable(variant == "tunableop")
        if variant == "tunableop":
            tunable.set_max_tuning_iterations(30)
            tunable.set_max_tuning_duration(30)
        for model, shapes in SHAPES.items():
            for name, (n, k, has_bias) in shapes.items():
                wbytes = n * k * 2
                copies = max(2, math.ceil(200e6 / wbytes))
                weights = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02 for _ in range(copies)]
                bias = torch.randn(n, dtype=torch.bfloat16, device="cuda") if has_bias else None
                for m in ROWS:
                    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
                    try:
                        if variant == "tunableop":
                            F.linear(x, weights[0], bias)  # tunes this shape outside the capture
                            torch.cuda.synchronize()
                        times = per_gemm_seconds(x, weights, bias)
                    except Exception as e:  # noqa: BLE001 - record why, keep the other shapes
                        print(f"{variant} {model} {name} M={m}: failed {type(e).__name__}: {str(e)[:200]}")
                        continue
                    q = statistics.quantiles(times, n=10)
                    med = statistics.median(times)
                    row = dict(variant=variant, model=model, gemm=name, m=m, n=n, k=k, weight_bytes=wbytes,
                               us=med * 1e6, p20_us=q[1] * 1e6, p80_us=q[7] * 1e6, GB_per_s=wbytes / med / 1e9,
                               floor_us=wbytes / bw * 1e6)
                    results["rows"].append(row)
                    print(f"{variant:9s} {model:12s} {name:7s} M={m:3d}: {med * 1e6:7.1f} us  "
                          f"{wbytes / med / 1e9:6,.0f} GB/s  floor {wbytes / bw * 1e6:6.1f} us")
                del weights, bias
                torch.cuda.empty_cache()
    if args.tunableop:
        results["tunableop_results"] = [list(map(str, r)) for r in tunable.get_results() or []]  # (op, shape, algo, ms)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "probe_gemm.json").write_text(json.dumps(results, indent=1))

    stamp = datetime.datetime.now(datetime.timezone.utc)
    rows = to_rows(results, run_id=stamp.strftime("%Y%m%dT%H%M%SZ") + "-pgemm",
                   time=stamp.isoformat(timespec="seconds"), commit=commit(), versions=versions())
    with open(args.out / "results.jsonl", "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
