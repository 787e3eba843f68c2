"""Probe: the decode step's GEMMs (M = decode batch rows): cuBLAS against the split-K Triton `decode_linear`.

    python -m bench.probe_gemm [--out DIR]

Each shape is one projection of Qwen2.5-1.5B or Qwen2-7B at tg = 1 ([M, K] @ [N, K]^T, bf16, the
qkv projection with its bias as the model runs it). Weights as in a decode step: each of L distinct
copies (L x weight bytes > 200 MB, so L2 holds none of them) is read once per pass, L back-to-back
`F.linear`s captured in one CUDA graph, replayed; the time per GEMM is the replay time / L. GB/s counts
the weight bytes (activations are < 5% of them at M <= 256); the floor column is those bytes at the
`hbm_copy` bandwidth of the same run.

Variants: "cublas" (torch's default heuristics, `F.linear`), "triton" (`hybridengine.linear.
decode_linear_triton` with its automatic plan) and "triton_sweep" (the same kernel over SWEEP configs; the
best per shape is printed). The Triton output is checked against cuBLAS's (max |diff| relative to the
output's scale). Run 1 (20261130, session 9 call 2) also timed "tunableop" (torch.cuda.tunable): on this
torch build its only candidate was cuBLAS's default ("Default" for every shape), same times; dropped.
Results print and go to $OUT/probe_gemm.json (median and p20/p80 per GEMM in us).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

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
SWEEP = [dict(SPLIT_K=s, BLOCK_N=n) for s in (1, 2, 4, 8) for n in (32, 64, 128)] + \
        [dict(BLOCK_K=64, num_stages=6), dict(BLOCK_M=64), dict(num_warps=8)]
"""Timed at M = 128 only; each overrides the automatic plan's keys (the last three: the plan with that change)."""
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


def per_gemm_seconds(fn, weights: list[torch.Tensor], replays: int = 20) -> list[float]:
    """Seconds per GEMM: `fn(w)` for each of the distinct weights back to back in one CUDA graph."""
    outs = [None] * len(weights)

    def chain():
        for i, w in enumerate(weights):
            outs[i] = fn(w)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            chain()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        chain()
    times = []
    for i in range(replays + 3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        if i >= 3:
            times.append(a.elapsed_time(b) / 1e3 / len(weights))
    g.reset()
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    args = ap.parse_args()
    torch.manual_seed(0)
    bw = hbm_bandwidth()
    print(f"hbm_copy {bw / 1e9:,.0f} GB/s ({torch.cuda.get_device_name()}, torch {torch.__version__})")
    results = {"hbm_copy_GB_per_s": bw / 1e9, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "rows": []}
    from hybridengine.linear import decode_linear_plan, decode_linear_triton

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for model, shapes in SHAPES.items():
        for name, (n, k, has_bias) in shapes.items():
            wbytes = n * k * 2
            copies = max(2, math.ceil(200e6 / wbytes))
            weights = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02 for _ in range(copies)]
            bias = torch.randn(n, dtype=torch.bfloat16, device="cuda") if has_bias else None
            for m in ROWS:
                x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
                expected = F.linear(x, weights[0], bias).float()
                scale = expected.abs().max().item()
                plan = decode_linear_plan(m, n, k, sms)
                variants = [("cublas", None, lambda w: F.linear(x, w, bias)),
                            ("triton", plan, lambda w: decode_linear_triton(x, w, bias))]
                if name != "lm_head" and m == 128:
                    variants += [("triton_sweep", c, lambda w, c=c: decode_linear_triton(x, w, bias, config=c))
                                 for c in SWEEP]
                best = {}
                for variant, config, fn in variants:
                    try:
                        diff = (fn(weights[0]).float() - expected).abs().max().item() / scale
                        if diff > 2**-6:
                            raise RuntimeError(f"differs from cuBLAS by {diff:.3g} of the output's scale")
                        times = per_gemm_seconds(fn, weights)
                    except Exception as e:  # noqa: BLE001 - record why, keep the other shapes
                        print(f"{variant} {model} {name} M={m} {config}: failed {type(e).__name__}: {str(e)[:200]}")
                        continue
                    q = statistics.quantiles(times, n=10)
                    med = statistics.median(times)
                    row = dict(variant=variant, config=config, model=model, gemm=name, m=m, n=n, k=k,
                               weight_bytes=wbytes, us=med * 1e6, p20_us=q[1] * 1e6, p80_us=q[7] * 1e6,
                               GB_per_s=wbytes / med / 1e9, floor_us=wbytes / bw * 1e6, rel_diff=diff)
                    results["rows"].append(row)
                    kind = "sweep" if variant == "triton_sweep" else variant
                    if kind not in best or med < best[kind][0]:
                        best[kind] = (med, config)
                line = "  ".join(f"{kind} {t * 1e6:6.1f}" for kind, (t, _) in best.items())
                print(f"{model:16s} {name:7s} M={m:3d} floor {wbytes / bw * 1e6:6.1f} us | {line} | "
                      f"best sweep {best.get('sweep', (0, None))[1]}")
            del weights, bias
            torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "probe_gemm.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
