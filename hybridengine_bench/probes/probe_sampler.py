"""Where the fused sampler's partial kernel spends its time.

    python -m hybridengine_bench.probes.probe_sampler --out DIR

`kernels.sampling.sample_partial_kernel` at the decode step's shapes (bf16 logits [B, 151936], temperature 1,
unseeded rows, the launcher's split plan) against the same kernel on greedy rows (keys < 0: the two passes,
exp and argmax, no noise): what the noise costs. Each timed in a CUDA graph (`common.graph_seconds`), 10
launches back to back. Writes DIR/probe_sampler.json.

A variant that loaded [BLOCK / 4, 4] tiles and picked each column's Philox word with `tl.where` instead of
`tl.join` + `tl.reshape` was no faster and is removed (commit 57d3793 has it; hybridengine_bench/README.md).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import triton

VOCAB = 151936


def main(argv=None) -> dict:
    from hybridengine.kernels.sampling import sample_partial_kernel
    from hybridengine.ops.sample_fused import fused_chunks, fused_splits

    from ..common import graph_seconds, quantiles

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
            chunk, splits = fused_chunks(VOCAB, fused_splits(B, VOCAB, block, dev), block)
            part = torch.empty(5, B, splits, dtype=torch.float32, device=dev)
            for name, k in (("sampled", keys), ("greedy", -keys)):
                def launch(k=k):
                    sample_partial_kernel[(B, splits)](logits, logits.stride(0), inv, k, draws, part, VOCAB, chunk, 0,
                                                       SPLITS=splits, BLOCK=block, num_warps=4)
                q = quantiles(graph_seconds(launch, calls=10))
                result["rows"].append(dict(batch=B, block=block, splits=splits, variant=name,
                                           p20=q[0], p50=q[1], p80=q[2]))
                print(f"B={B} block={block} splits={splits} {name}: {q[1] * 1e6:.1f} us")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "probe_sampler.json").write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
