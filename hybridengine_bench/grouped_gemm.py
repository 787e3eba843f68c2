"""The grouped GEMM of the MoE layers (bench `grouped_gemm`) against its floor and a dense GEMM of the same FLOPs.

Shapes from the model's config (`qwen3-moe-7b`: H 2048, I 1024, 64 experts, top-8; CPU: `tiny-qwen3-moe`), two
projections (gate_up: N = 2I, K = H; down: N = H, K = I) at two batch sizes: a training micro-batch of 16,384
tokens and a decode step of 128 tokens (x top-k rows, grouped by expert). Routing: the top-k of seeded random
router logits (about uniform group sizes; min and max in the case).

Providers, same inputs, same run (bf16 on GPU, fp32 on CPU):
- `hybridengine`, case.impl `grouped_gemm` (`ops.grouped_gemm.grouped_gemm(x, weight, group_sizes, exact=False)`,
  where the tree has it; a not_run row where it does not) and `grouped_gemm_ref` (one `F.linear` per expert);
- `torch_grouped_mm`: torch's grouped GEMM (`torch.nn.functional.grouped_mm` or `torch._grouped_mm`), what
  transformers' MoE layers call on CUDA;
- `torch_matmul`: a dense `F.linear` with the same M, N, K (the same FLOPs, one expert's weight);
- `floor`: max(FLOPs / this run's bf16 GEMM rate, bytes / this run's HBM copy bandwidth), bytes = x + the
  weights of the experts with rows + the output (DESIGN.md's figures when the run measured none).
Rows: `seconds` and `TFLOP_per_s` per provider; `ratio` rows of each hybridengine impl and of torch_grouped_mm,
case.to floor (time / floor) and torch_matmul (time / dense time).
"""

from __future__ import annotations

import torch

from .common import Ctx, quantiles
from .moe import hbm_gbps, models, run_value

BENCH = "grouped_gemm"
GEMM_TFLOPS_DESIGN = 789.0
"""DESIGN.md's bf16 GEMM rate on an H200 (8192^3): the floor's compute rate when this run measured none."""
GPU_TOKENS = {"train": 16384, "decode": 128}
CPU_TOKENS = {"train": 64, "decode": 4}


def gemm_tflops(ctx: Ctx) -> tuple[float, str]:
    """(TFLOP/s, source): this run's `gemm` floor row, else DESIGN.md's figure."""
    value = run_value(ctx, "gemm", "TFLOP_per_s")
    return (value, "gemm row of this run") if value is not None else (GEMM_TFLOPS_DESIGN, "DESIGN.md")


def _routed_rows(ctx: Ctx, tokens: int, num_experts: int, top_k: int, hidden: int, dtype) -> tuple:
    """x [tokens * k, K] grouped by expert and the group sizes, from the top-k of random router logits."""
    g = torch.Generator().manual_seed(tokens)
    experts = torch.randn(tokens, num_experts, generator=g).topk(top_k, dim=-1).indices
    sizes = torch.bincount(experts.reshape(-1), minlength=num_experts).tolist()
    x = torch.randn(tokens * top_k, hidden, generator=g).to(ctx.device, dtype)
    return x, sizes


def _torch_grouped_mm():
    fn = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
    if fn is None:
        return None
    return lambda x, w, offs: fn(x, w.transpose(-2, -1), offs=offs)


def grouped_gemm(ctx: Ctx) -> None:
    import hybridengine as he
    from hybridengine.ops import grouped_gemm as gg

    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    elem = torch.finfo(dtype).bits // 8
    peak, peak_source = gemm_tflops(ctx)
    bw, bw_source = hbm_gbps(ctx)
    impls = {"grouped_gemm_ref": gg.grouped_gemm_ref}
    if hasattr(gg, "grouped_gemm"):
        impls = {"grouped_gemm": lambda x, w, sizes: gg.grouped_gemm(x, w, sizes, exact=False), **impls}
    for model in models(ctx):
        if "grouped_gemm" not in impls:
            ctx.rec.not_run(BENCH, "hybridengine", model, "hybridengine.ops.grouped_gemm.grouped_gemm is not in this "
                            "tree; grouped_gemm_ref measured", impl="grouped_gemm")
        cfg = he.model_config(model)
        E, k, H, inter = cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size
        g = torch.Generator().manual_seed(1)
        weights = {"gate_up": torch.randn(E, 2 * inter, H, generator=g).to(ctx.device, dtype) * H ** -0.5,
                   "down": torch.randn(E, H, inter, generator=g).to(ctx.device, dtype) * inter ** -0.5}
        for batch, tokens in (GPU_TOKENS if ctx.cuda else CPU_TOKENS).items():
            for proj, w in weights.items():
                N, K = w.shape[1], w.shape[2]
                x, sizes = _routed_rows(ctx, tokens, E, k, K, dtype)
                M = x.shape[0]
                flops = 2 * M * N * K
                touched = sum(1 for s in sizes if s)
                nbytes = (M * K + touched * N * K + M * N) * elem
                floor_s = max(flops / (peak * 1e12), nbytes / (bw * 1e9))
                case = dict(batch=batch, proj=proj, tokens=tokens, top_k=k, experts=E, m=M, n=N, k=K,
                            group_min=min(sizes), group_max=max(sizes), touched_experts=touched,
                            dtype=str(dtype).removeprefix("torch."))
                ctx.rec.add(BENCH, "floor", model, {**case, "gemm_TFLOPs": peak, "gemm_source": peak_source,
                                                    "hbm_GBps": bw, "hbm_source": bw_source, "bytes": nbytes,
                                                    "bound": "compute" if flops / (peak * 1e12) >= nbytes / (bw * 1e9)
                                                    else "memory"}, "seconds", floor_s)
                dense_w = w[0].contiguous()
                dense = ctx.measure(lambda: torch.nn.functional.linear(x, dense_w), warmup=3, repeats=20,
                                    desc=f"dense {batch} {proj}")
                _rows(ctx, model, "torch_matmul", {**case, "what": "dense_same_flops"}, dense, flops)
                dense_s = quantiles(dense)[1]
                ref = gg.grouped_gemm_ref(x, w, sizes)
                for impl, fn in impls.items():
                    try:
                        call, arg = _bound(fn, x, w, sizes)
                    except Exception as e:  # noqa: BLE001 - an op in flight on another branch: recorded, the rest runs
                        ctx.rec.not_run(BENCH, "hybridengine", model, f"{type(e).__name__}: {str(e)[:300]}",
                                        **case, impl=impl)
                        continue
                    err = float((call().float() - ref.float()).abs().max())
                    times = ctx.measure(call, warmup=3, repeats=20, desc=f"{impl} {batch} {proj}")
                    c = {**case, "impl": impl, "group_sizes_arg": arg, "max_abs_diff_vs_ref": err}
                    _rows(ctx, model, "hybridengine", c, times, flops)
                    _ratios(ctx, model, "hybridengine", c, quantiles(times)[1], floor_s, dense_s)
                _peer(ctx, model, case, x, w, sizes, flops, floor_s, dense_s)


def _bound(fn, x, w, sizes: list[int]):
    """(a call of fn on these inputs, how it takes the group sizes): a list of ints as `grouped_gemm_ref`, else
    an int64 tensor on x's device (an op that reads them on the device)."""
    try:
        fn(x, w, sizes)
        return (lambda: fn(x, w, sizes)), "list"
    except (TypeError, ValueError, AttributeError):
        on_device = torch.tensor(sizes, device=x.device)
        fn(x, w, on_device)
        return (lambda: fn(x, w, on_device)), "tensor"


def _peer(ctx: Ctx, model: str, case: dict, x, w, sizes, flops: int, floor_s: float, dense_s: float) -> None:
    fn = _torch_grouped_mm()
    if fn is None:
        ctx.rec.not_run(BENCH, "torch_grouped_mm", model, "torch has no grouped_mm", **case)
        return
    offs = torch.tensor(sizes, device=x.device).cumsum(0).to(torch.int32)
    try:
        fn(x, w, offs)
    except Exception as e:  # noqa: BLE001 - a device or dtype torch's grouped GEMM does not support (the CPU)
        ctx.rec.not_run(BENCH, "torch_grouped_mm", model, f"{type(e).__name__}: {str(e)[:200]}", **case)
        return
    times = ctx.measure(lambda: fn(x, w, offs), warmup=3, repeats=20, desc=f"torch grouped_mm {case['proj']}")
    _rows(ctx, model, "torch_grouped_mm", case, times, flops)
    _ratios(ctx, model, "torch_grouped_mm", case, quantiles(times)[1], floor_s, dense_s)


def _rows(ctx: Ctx, model: str, provider: str, case: dict, times: list[float], flops: int) -> None:
    ctx.rec.add(BENCH, provider, model, case, "seconds", times)
    ctx.rec.add(BENCH, provider, model, case, "TFLOP_per_s", [flops / t / 1e12 for t in times])


def _ratios(ctx: Ctx, model: str, provider: str, case: dict, seconds: float, floor_s: float, dense_s: float) -> None:
    ctx.rec.add(BENCH, provider, model, {**case, "to": "floor"}, "ratio", seconds / floor_s)
    ctx.rec.add(BENCH, provider, model, {**case, "to": "torch_matmul"}, "ratio", seconds / dense_s)
    ctx.log(f"  {BENCH} {provider} {case.get('impl', '')} {case['batch']} {case['proj']}: {seconds * 1e6:.1f} us, "
            f"{seconds / floor_s:.2f}x floor, {seconds / dense_s:.2f}x dense")
