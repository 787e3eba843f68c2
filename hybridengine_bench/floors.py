"""Hardware floors, measured in every run: HBM copy, bf16 GEMM, NCCL all-gather bus bandwidth."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .common import GiB, MiB, Ctx, quantiles

ALL_GATHER_BYTES_GPU = (64 * MiB, 256 * MiB, GiB, 4 * GiB)
ALL_GATHER_BYTES_CPU = (MiB, 4 * MiB)


def hbm_copy(ctx: Ctx) -> None:
    """`dst.copy_(src)` of 4 GiB (far past L2); GB/s counts bytes read plus bytes written."""
    nbytes = 4 * GiB if ctx.cuda else 64 * MiB
    src = torch.randn(nbytes // 2, dtype=torch.bfloat16, device=ctx.device)
    dst = torch.empty_like(src)
    times = ctx.measure(lambda: dst.copy_(src), warmup=5, repeats=30, desc="hbm_copy")
    ctx.rec.add("hbm_copy", "torch_copy", None, {"bytes": nbytes}, "GB_per_s", [2 * nbytes / t / 1e9 for t in times])
    ctx.log(f"hbm_copy {nbytes / GiB:g} GiB: {2 * nbytes / quantiles(times)[1] / 1e9:,.0f} GB/s")


def gemm(ctx: Ctx) -> None:
    """bf16 `a @ b` on random data (all-zero inputs run faster than real ones), n^3 with n = 8192 on GPU."""
    n = 8192 if ctx.cuda else 256
    a, b = (torch.randn(n, n, dtype=torch.bfloat16, device=ctx.device) for _ in range(2))
    c = torch.empty_like(a)
    times = ctx.measure(lambda: torch.mm(a, b, out=c), warmup=5, repeats=30, desc="gemm")
    ctx.rec.add("gemm", "torch_matmul", None, {"m": n, "n": n, "k": n, "dtype": "bf16"}, "TFLOP_per_s",
                [2 * n**3 / t / 1e12 for t in times])
    ctx.log(f"gemm {n}^3 bf16: {2 * n**3 / quantiles(times)[1] / 1e12:,.0f} TFLOP/s")


def all_gather(ctx: Ctx) -> None:
    """`all_gather_into_tensor`; size = output bytes; busbw = algbw * (n-1)/n (nccl-tests convention)."""
    if ctx.world < 2:
        ctx.rec.not_run("all_gather", "nccl" if ctx.cuda else "gloo", None, "needs 2 or more ranks", world=ctx.world)
        return
    provider = "nccl" if ctx.cuda else "gloo"
    for nbytes in ALL_GATHER_BYTES_GPU if ctx.cuda else ALL_GATHER_BYTES_CPU:
        out = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=ctx.device)
        shard = torch.randn(out.numel() // ctx.world, dtype=torch.bfloat16, device=ctx.device)
        times = ctx.measure(lambda: dist.all_gather_into_tensor(out, shard), warmup=5, repeats=20,
                            desc=f"all_gather {nbytes // MiB} MiB")
        busbw = [nbytes / t / 1e9 * (ctx.world - 1) / ctx.world for t in times]
        case = {"bytes": nbytes, "world": ctx.world}
        ctx.rec.add("all_gather", provider, None, case, "busbw_GB_per_s", busbw)
        ctx.rec.add("all_gather", provider, None, case, "seconds", times)
        ctx.log(f"all_gather {nbytes // MiB} MiB: busbw {quantiles(busbw)[1]:,.0f} GB/s")
        del out, shard
