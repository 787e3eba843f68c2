"""Where the fused sampler's partial kernel spends its time, and a variant without the noise interleave.

    python -m bench.probe_sampler --out DIR

`sampling.sample_partial_kernel` at the decode step's shapes (bf16 logits [B, 151936], temperature 1,
unseeded rows, the launcher's split plan) against:
- the same kernel on greedy rows (keys < 0: the two passes, exp and argmax, no noise): what the noise costs;
- `tile_kernel` below: the same race with the logits loaded as [BLOCK / 4, 4] tiles, so column c0 + 4n + j
  meets Philox word j of counter n by a select (`tl.where` on j) instead of `tl.join` + `tl.reshape` (which
  may move every element through shared memory). Same noise per column, same tokens (up to ties within
  fp32 rounding); the lanes' sums run in another order.
Each timed in a CUDA graph (`common.graph_seconds`), 10 launches back to back. Writes DIR/probe_sampler.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import triton
import triton.language as tl

VOCAB = 151936


@triton.jit
def _race_exp_tile(key, draw, c0, BLOCK: tl.constexpr):
    """E ~ Exp(1) for columns c0 + 4n + j as a [BLOCK // 4, 4] tile: word j of Philox at counter (c0 / 4 + n, draw),
    `kernels.sampling.race_exp`'s numbers."""
    n = (c0 // 4 + tl.arange(0, BLOCK // 4)).to(tl.int64) + (draw.to(tl.int64) << 32)
    r0, r1, r2, r3 = tl.randint4x(key, n)
    j = tl.arange(0, 4)[None, :]
    x = tl.where(j == 0, r0[:, None], tl.where(j == 1, r1[:, None], tl.where(j == 2, r2[:, None], r3[:, None])))
    xf = x.to(tl.uint32, bitcast=True).to(tl.float32)
    v = (xf + 0.5) * 2.3283064365386963e-10
    return tl.where(v < 0.000244140625, v + 0.5 * v * v, -tl.log(1.0 - v))


@triton.jit
def tile_kernel(Logits, stride_l, InvTemp, Keys, Draws, Out, n_cols, chunk, col_offset,
                SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    """`sample_partial_kernel`'s sampled-row path on [BLOCK / 4, 4] tiles (see the module docstring)."""
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    inv_t = tl.load(InvTemp + row)
    key = tl.load(Keys + row)
    draw = tl.load(Draws + row)
    lanes = 4 * tl.arange(0, BLOCK // 4)[:, None] + tl.arange(0, 4)[None, :]
    start = split * chunk
    end = tl.minimum(start + chunk, n_cols)
    base = Logits + row * stride_l
    mx = tl.full([BLOCK // 4, 4], float("-inf"), tl.float32)
    for c0 in range(start, end, BLOCK):
        cols = c0 + lanes
        mx = tl.maximum(mx, tl.load(base + cols, mask=cols < end, other=float("-inf")).to(tl.float32) * inv_t)
    M = tl.max(tl.max(mx, 1), 0)
    M_safe = tl.where(M == float("-inf"), 0.0, M)
    l = tl.zeros([BLOCK // 4, 4], tl.float32)
    best_idx = tl.full([BLOCK // 4, 4], 2147483647, tl.int32)
    best_val = tl.full([BLOCK // 4, 4], float("-inf"), tl.float32)
    best_e = tl.zeros([BLOCK // 4, 4], tl.float32)
    best_E = tl.full([BLOCK // 4, 4], 1.0, tl.float32)
    for c0 in range(start, end, BLOCK):
        cols = c0 + lanes
        s = tl.load(base + cols, mask=cols < end, other=float("-inf")).to(tl.float32) * inv_t
        e = tl.exp(s - M_safe)
        l += e
        E = _race_exp_tile(key, draw, col_offset + c0, BLOCK)
        win = e * best_E > best_e * E
        best_e = tl.where(win, e, best_e)
        best_E = tl.where(win, E, best_E)
        best_idx = tl.where(win, col_offset + cols, best_idx)
        best_val = tl.where(win, s, best_val)
    score = tl.where(best_e > 0, tl.log(tl.maximum(best_e, 1e-30)) - tl.log(best_E) + M_safe, float("-inf"))
    top = tl.max(tl.max(score, 1), 0)
    first = tl.min(tl.min(tl.where(score == top, best_idx, 2147483647), 1), 0)
    val = tl.sum(tl.sum(tl.where(best_idx == first, best_val, 0.0), 1), 0)
    out = row * SPLITS + split
    plane = tl.num_programs(0).to(tl.int64) * SPLITS
    tl.store(Out + out, M)
    tl.store(Out + plane + out, tl.sum(tl.sum(l, 1), 0))
    tl.store(Out + 2 * plane + out, top)
    tl.store(Out + 3 * plane + out, first.to(tl.float32))
    tl.store(Out + 4 * plane + out, val)


def main(argv=None) -> dict:
    from hybridengine.kernels.sampling import sample_partial_kernel
    from hybridengine.sampling import fused_splits

    from .common import graph_seconds, quantiles

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    result = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__, vocab=VOCAB,
                  rows=[])
    for B in (1, 64, 128, 256):
        g = torch.Generator(device=dev).manual_seed(B)
        logits = (torch.randn(B, VOCAB, device=dev, generator=g) * 3).to(torch.bfloat16)
        inv = torch.ones(B, device=dev)
        keys = torch.arange(B, dtype=torch.int64, device=dev) * 7919 + 1
        draws = torch.zeros(B, dtype=torch.int32, device=dev)
        for block in (1024, 2048):
            splits = fused_splits(B, VOCAB, block, dev)
            chunk = -(-(-(-VOCAB // splits)) // block) * block
            splits = -(-VOCAB // chunk)
            parts = {}
            variants = {"sampled": (sample_partial_kernel, keys), "greedy": (sample_partial_kernel, -keys),
                        "tile": (tile_kernel, keys)}
            for name, (kernel, k) in variants.items():
                part = torch.empty(5, B, splits, dtype=torch.float32, device=dev)

                def launch(kernel=kernel, k=k, part=part):
                    kernel[(B, splits)](logits, logits.stride(0), inv, k, draws, part, VOCAB, chunk, 0,
                                        SPLITS=splits, BLOCK=block, num_warps=4)
                times = graph_seconds(launch, calls=10)
                parts[name] = part
                q = quantiles(times)
                result["rows"].append(dict(batch=B, block=block, splits=splits, variant=name, p20=q[0], p50=q[1], p80=q[2]))
                print(f"B={B} block={block} splits={splits} {name}: {q[1] * 1e6:.1f} us")
            same = bool(torch.equal(parts["tile"][3], parts["sampled"][3]))
            lse_err = float((parts["tile"][1].log() + parts["tile"][0] - parts["sampled"][1].log()
                             - parts["sampled"][0]).abs().max())
            result["rows"].append(dict(batch=B, block=block, check="tile vs sampled", same_columns=same, lse_err=lse_err))
            print(f"  tile = sampled columns: {same}, max |lse diff| {lse_err:.2e}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "probe_sampler.json").write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
