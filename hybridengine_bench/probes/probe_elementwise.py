"""Launch shapes of the rollout's elementwise kernels at decode-step sizes (is the default launch the fast one?).

    python -m hybridengine_bench.probes.probe_elementwise --out DIR

`silu_mul_kernel` over gate/up views of one [B, 2 I] GEMM output (as `DecoderLayer.forward_rollout` calls it)
and `rms_norm_kernel` with the residual add, at B in {64, 128, 256} for Qwen2.5-1.5B (H 1536, I 8960) and
Qwen2-7B (H 3584, I 18944), bf16, over a grid of BLOCK / num_warps; each launch timed in a CUDA graph
(`common.graph_seconds`, 20 launches back to back on the same inputs: hot in L2, as in the step, where the
GEMM before each of them has just written its input). The default launch is marked. Writes DIR/probe_elementwise.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import triton

SHAPES = {"qwen2.5-1.5b": (1536, 8960), "qwen2-7b": (3584, 18944)}


def main(argv=None) -> dict:
    from hybridengine.kernels.elementwise import rms_norm_kernel, silu_mul_kernel
    from hybridengine.ops import rms_norm, silu_mul

    from ..common import graph_seconds, quantiles

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    result = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__, rows=[])
    for model, (H, I) in SHAPES.items():
        for B in (64, 128, 256):
            gu = torch.randn(B, 2 * I, device=dev).to(torch.bfloat16)
            out = torch.empty(B, I, device=dev, dtype=torch.bfloat16)
            default_block = min(silu_mul.MAX_BLOCK, triton.next_power_of_2(I))
            for block in (512, 1024, 2048, 4096):
                for warps in (2, 4, 8):
                    def silu(block=block, warps=warps):
                        silu_mul_kernel[(B, triton.cdiv(I, block))](gu, gu[:, I:], out, gu.stride(0), gu.stride(0),
                                                                     out.stride(0), I, BLOCK=block, num_warps=warps)
                    q = quantiles(graph_seconds(silu, calls=20))
                    default = block == default_block and warps == 4
                    result["rows"].append(dict(op="silu_mul", model=model, batch=B, block=block, num_warps=warps,
                                               default=default, p20=q[0], p50=q[1], p80=q[2]))
                    print(f"silu_mul {model} B={B} block={block} warps={warps}{' (default)' if default else ''}: "
                          f"{q[1] * 1e6:.2f} us")
            x, r = (torch.randn(B, H, device=dev).to(torch.bfloat16) for _ in range(2))
            w = torch.ones(H, device=dev, dtype=torch.bfloat16)
            y, h = torch.empty_like(x), torch.empty_like(x)
            for warps in (1, 2, 4, 8):
                def norm(warps=warps):
                    rms_norm_kernel[(B,)](x, r, w, y, h, y, x.stride(0), r.stride(0), H, H, H, 1e-6,
                                          HAS_RESIDUAL=True, STORE_RSTD=False, BLOCK=triton.next_power_of_2(H),
                                          num_warps=warps)
                q = quantiles(graph_seconds(norm, calls=20))
                default = warps == rms_norm.num_warps(H)
                result["rows"].append(dict(op="rms_norm", model=model, batch=B, num_warps=warps, default=default,
                                           p20=q[0], p50=q[1], p80=q[2]))
                print(f"rms_norm {model} B={B} warps={warps}{' (default)' if default else ''}: {q[1] * 1e6:.2f} us")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "probe_elementwise.json").write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
