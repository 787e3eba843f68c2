"""Paged decode attention (`hybridengine.ops.paged_attention.paged_decode_attention`) against dense SDPA and
FlexAttention.

One decoder layer of Qwen2-7B on one GPU (tg = 1): 28 query heads, 4 kv heads, head_dim 128, bf16,
one query token per sequence, every sequence of a case at the same context length. GB/s counts the
K and V bytes read, 2 x B x context x 4 x 128 x 2 bytes (Q and the output are < 1% of it); the
floor is the run's `hbm_copy` bandwidth.

Providers, all on the same shapes in the same run:
- `hybridengine`: the Triton paged kernel over a block_size-16 cache with shuffled blocks; split-K
  chosen by `decode_num_splits` (case `split`: "auto"), and where that splits, also forced to one
  pass (`split`: "one_pass") to show what split-K buys.
- `sdpa_dense`: `F.scaled_dot_product_attention(q, k, v, enable_gqa=True)` over contiguous
  [B, 4, context, 128] K/V: what paging must not lose against.
- `flex_attention`: torch's FlexAttention paged attention (`torch.nn.attention.experimental.
  _paged_attention.PagedAttention`, compiled `flex_attention`); its block mask needs pages as large
  as its KV block, so it runs with 128-token pages (case `block_size`). Compiled for FLEX_CASES only
  (each shape is a fresh compile).
- `torch_ref` (CPU only): the package's plain-torch reference. On CPU (the harness check) the bench
  runs one tiny case with `sdpa_dense`, `torch_ref` and eager `flex_attention`, and no Triton.

Every timed call starts with a cold L2 (a 512 MiB read first, whose GPU time also hides the host's
launch of the timed call), as a layer's KV is cold in a real decode step; B = 1 at 16k is 32 MiB and
would otherwise sit in the H200's 50 MB L2. The flush reads rather than writes (case flush="read"):
in a decode step the L2 before attention holds the weights just read, clean lines; after a 512 MiB
write it would hold ~50 MB of dirty lines whose write-back lands inside the timed call and dominates
the small cases (the sweep's `flush_check` rows time both flushes).
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as F

from .common import MiB, Ctx, quantiles, release_memory

MODEL = "qwen2-7b"
NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 28, 4, 128, 16
BATCHES_GPU, CONTEXTS_GPU = (1, 16, 128), (128, 1024, 4096, 16384)
FLEX_CASES = {(128, 1024), (16, 4096), (1, 16384)}
FLEX_PAGE = 128
CASES_CPU = ((2, 48),)
FLUSH_BYTES = 512 * MiB


def kv_bytes(batch: int, context: int, kv_heads: int = NUM_KV_HEADS) -> int:
    return 2 * batch * context * kv_heads * HEAD_DIM * 2


def paged_cache(batch: int, context: int, device: torch.device, dense_k: torch.Tensor, dense_v: torch.Tensor):
    """The dense K/V [B, kv_heads, context, D] scattered into shuffled blocks of BLOCK_SIZE tokens."""
    kv_heads = dense_k.shape[1]
    per_seq = math.ceil(context / BLOCK_SIZE)
    num_blocks = batch * per_seq
    tables = torch.randperm(num_blocks, device=device).view(batch, per_seq).to(torch.int32)
    shape = (num_blocks, BLOCK_SIZE, kv_heads, HEAD_DIM)
    k_cache = torch.zeros(shape, dtype=dense_k.dtype, device=device)
    v_cache = torch.zeros(shape, dtype=dense_k.dtype, device=device)
    pad = per_seq * BLOCK_SIZE - context
    for dense, cache in ((dense_k, k_cache), (dense_v, v_cache)):
        blocks = F.pad(dense, (0, 0, 0, pad)).transpose(1, 2).reshape(batch, per_seq, BLOCK_SIZE, kv_heads, HEAD_DIM)
        cache[tables.long()] = blocks
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    return k_cache, v_cache, tables, lens


def flex_paged(q: torch.Tensor, dense_k: torch.Tensor, dense_v: torch.Tensor, *, compiled: bool):
    """A call of FlexAttention's paged decode over the same K/V in FLEX_PAGE-token pages."""
    from torch.nn.attention.experimental._paged_attention import PagedAttention
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    batch, _, context, _ = dense_k.shape
    device = q.device
    per_seq = math.ceil(context / FLEX_PAGE)
    paged = PagedAttention(batch * per_seq, FLEX_PAGE, batch, device=device)
    lens = torch.full((batch,), context, dtype=torch.int64, device=device)
    for b in range(batch):
        paged.reserve(torch.tensor(b, device=device), lens[b])
    k_cache = torch.zeros(1, NUM_KV_HEADS, batch * per_seq * FLEX_PAGE, HEAD_DIM, dtype=q.dtype, device=device)
    v_cache = torch.zeros_like(k_cache)
    pos = torch.arange(context, device=device)[None].expand(batch, context)
    paged.assign(torch.arange(batch, device=device), pos, dense_k, dense_v, k_cache, v_cache)

    def visible(b, h, q_idx, kv_idx):
        return kv_idx < lens[b]

    logical = create_block_mask(visible, batch, None, 1, per_seq * FLEX_PAGE, device=device, BLOCK_SIZE=FLEX_PAGE)
    block_mask = paged.convert_logical_block_mask(logical, kv_len=lens)
    if compiled:
        attend = torch.compile(flex_attention, fullgraph=True, dynamic=False)
        return lambda: attend(q[:, :, None], k_cache, v_cache, block_mask=block_mask, enable_gqa=True)[:, :, 0]

    def eager():
        with warnings.catch_warnings():  # "flex_attention called without torch.compile()": intended on CPU
            warnings.simplefilter("ignore", UserWarning)
            return flex_attention(q[:, :, None], k_cache, v_cache, block_mask=block_mask, enable_gqa=True)[:, :, 0]
    return eager


def decode_inputs(ctx: Ctx, batch: int, context: int, g: torch.Generator,
                  heads: tuple[int, int] | None = None) -> tuple:
    """q, dense K/V and the same K/V in a shuffled paged cache: (q, dense_k, dense_v, k_cache, v_cache,
    block_tables, context_lens), one layer's heads in bf16: (q_heads, kv_heads), Qwen2-7B's by default."""
    q_heads, kv_heads = heads or (NUM_Q_HEADS, NUM_KV_HEADS)
    q = torch.randn(batch, q_heads, HEAD_DIM, dtype=torch.bfloat16, device=ctx.device, generator=g)
    dense_k, dense_v = (torch.randn(batch, kv_heads, context, HEAD_DIM, dtype=torch.bfloat16,
                                    device=ctx.device, generator=g) for _ in range(2))
    return (q, dense_k, dense_v, *paged_cache(batch, context, ctx.device, dense_k, dense_v))


def dense_sdpa(q: torch.Tensor, dense_k: torch.Tensor, dense_v: torch.Tensor) -> torch.Tensor:
    """The peer: torch's scaled_dot_product_attention decode over contiguous K/V, [B, q_heads, D]."""
    return F.scaled_dot_product_attention(q[:, :, None], dense_k, dense_v, scale=HEAD_DIM**-0.5,
                                          enable_gqa=True)[:, :, 0]


def _flush_buffer(ctx: Ctx) -> torch.Tensor:
    """FLUSH_BYTES of int32 zeros, read (summed) before every timed call."""
    return torch.zeros(FLUSH_BYTES // 4, dtype=torch.int32, device=ctx.device)


def cold_times(ctx: Ctx, fn, *, warmup: int, repeats: int, flush: torch.Tensor | None,
               write_flush: bool = False) -> list[float]:
    """Seconds per call, each after an L2 flush on GPU (see the module docstring); `write_flush`
    flushes by writing the buffer instead (the sweep compares the two)."""
    if flush is None:
        return ctx.measure(fn, warmup=warmup, repeats=repeats, desc="paged_attention")
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(ctx.reps(repeats)):
        torch.cuda.synchronize(ctx.device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        flush.zero_() if write_flush else flush.sum()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return ctx.slowest(times)


def _check(name: str, out: torch.Tensor, expected: torch.Tensor) -> None:
    err = (out.float() - expected.float()).abs().max().item()
    if not err < 0.05:  # bf16 outputs of magnitude < 1 differ by a few ulps at most
        raise RuntimeError(f"paged_attention: {name} differs from dense SDPA by {err:.3g}")


def _timed_config(ctx: Ctx, name: str, fn, expected: torch.Tensor, case: dict, flush, *, warmup: int,
                  repeats: int, model: str = MODEL) -> list[float] | None:
    """One sweep point: check fn() against the SDPA output, time it cold and record the row; a config
    that fails (to compile: shared memory, or the check) becomes a not_run row, not a lost sweep."""
    try:
        _check(name, fn(), expected)
        times = cold_times(ctx, fn, warmup=warmup, repeats=repeats, flush=flush)
    except Exception as e:  # noqa: BLE001
        ctx.rec.not_run("paged_attention", "hybridengine", model, f"failed: {type(e).__name__}: {str(e)[:200]}", **case)
        return None
    ctx.rec.add("paged_attention", "hybridengine", model, case, "seconds", times)
    return times


def paged_attention(ctx: Ctx) -> None:
    from hybridengine.ops import paged_attention as PA

    cases = [(b, c) for c in CONTEXTS_GPU for b in BATCHES_GPU] if ctx.cuda else list(CASES_CPU)
    flush = _flush_buffer(ctx) if ctx.cuda else None
    scale = HEAD_DIM**-0.5
    g = torch.Generator(device=ctx.device).manual_seed(0)
    for batch, context in cases:
        nbytes = kv_bytes(batch, context)
        base = dict(batch=batch, context=context, q_heads=NUM_Q_HEADS, kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM,
                    dtype="bf16", kv_bytes=nbytes, flush="read")
        q, dense_k, dense_v, k_cache, v_cache, tables, lens = decode_inputs(ctx, batch, context, g)

        def sdpa():
            return dense_sdpa(q, dense_k, dense_v)

        expected = sdpa()
        runs = {("sdpa_dense", "-"): (sdpa, BLOCK_SIZE)}
        if ctx.cuda:
            auto = PA.decode_partition_plan(batch, NUM_KV_HEADS, HEAD_DIM, context, ctx.device)[0]
            splits = {"auto": None} | ({"one_pass": 1} if auto > 1 else {})
            for mode, num_splits in splits.items():
                def ours(num_splits=num_splits):
                    return PA.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale=scale,
                                                     num_splits=num_splits, max_context_len=context)
                runs[("hybridengine", mode)] = (ours, BLOCK_SIZE)
            if (batch, context) in FLEX_CASES:
                try:
                    runs[("flex_attention", "-")] = (flex_paged(q, dense_k, dense_v, compiled=True), FLEX_PAGE)
                except Exception as e:  # noqa: BLE001 - experimental torch API: record why, keep the other rows
                    ctx.rec.not_run("paged_attention", "flex_attention", MODEL, f"failed: {type(e).__name__}: "
                                    f"{str(e)[:300]}", **base)
        else:  # the CPU harness check: the Triton provider needs CUDA; flex runs eager (unfused)
            runs[("torch_ref", "-")] = (lambda: PA.paged_decode_attention_ref(
                q, k_cache, v_cache, tables, lens, scale=scale), BLOCK_SIZE)
            runs[("flex_attention", "-")] = (flex_paged(q, dense_k, dense_v, compiled=False), FLEX_PAGE)
        for (provider, mode), (fn, block_size) in runs.items():
            case = dict(base, block_size=block_size, **({"split": mode} if provider == "hybridengine" else {}))
            if provider == "hybridengine":
                case["num_partitions"] = auto if mode == "auto" else 1
            try:
                _check(f"{provider} {mode}", fn(), expected)
                times = cold_times(ctx, fn, warmup=5, repeats=30, flush=flush)
            except Exception as e:  # noqa: BLE001 - one provider failing must not lose the others' rows
                ctx.rec.not_run("paged_attention", provider, MODEL, f"failed: {type(e).__name__}: {str(e)[:300]}",
                                **case)
                continue
            ctx.rec.add("paged_attention", provider, MODEL, case, "seconds", times)
            ctx.rec.add("paged_attention", provider, MODEL, case, "GB_per_s", [nbytes / t / 1e9 for t in times])
            ctx.log(f"paged_attention B={batch} ctx={context} {provider} {mode}: {quantiles(times)[1] * 1e6:,.1f} us, "
                    f"{nbytes / quantiles(times)[1] / 1e9:,.0f} GB/s")
        del q, dense_k, dense_v, k_cache, v_cache, tables, lens, runs, expected
        release_memory()


SWEEP_CASES = ((1, 16384), (16, 4096), (16, 16384), (128, 1024), (128, 4096), (128, 256), (128, 512), (64, 512))
"""The last three: the contexts of a GRPO decode (prompt 128 + up to 512 new tokens) at decode batch sizes."""
SWEEP_CONFIGS = [dict(BLOCK_N=n, num_warps=w, num_stages=s)
                 for n, w, s in ((64, 4, 2), (64, 4, 3), (32, 4, 4), (128, 4, 3), (128, 8, 4), (64, 8, 3))]
"""The six best of the full 3 x 2 x 3 grid (BLOCK_N 32/64/128, 4/8 warps, 2-4 stages) in the first sweep."""
SWEEP_SPLIT_FACTORS = (1, 2, 4, 8)
"""Multiples of the automatic split count tried where the automatic plan splits."""


def paged_attention_sweep(ctx: Ctx) -> None:
    """Launch-config sweep of the Triton decode kernel (tile BLOCK_N, warps, pipeline stages, split
    count) on the cases that decide the defaults; rows carry case sweep=True (and dot="16bit", the kernel's
    bf16 dot path, as earlier runs' rows). GPU only."""
    from hybridengine.ops import paged_attention as PA

    if not ctx.cuda:
        ctx.rec.not_run("paged_attention", "hybridengine", MODEL, "sweep: GPU only", sweep=True)
        return
    flush = _flush_buffer(ctx)
    scale = HEAD_DIM**-0.5
    g = torch.Generator(device=ctx.device).manual_seed(0)
    for batch, context in SWEEP_CASES:
        nbytes = kv_bytes(batch, context)
        q, dense_k, dense_v, k_cache, v_cache, tables, lens = decode_inputs(ctx, batch, context, g)
        expected = dense_sdpa(q, dense_k, dense_v)
        auto = PA.decode_num_splits(batch, NUM_KV_HEADS, context, PA.num_sms(ctx.device))
        base = dict(batch=batch, context=context, q_heads=NUM_Q_HEADS, kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM,
                    dtype="bf16", kv_bytes=nbytes, block_size=BLOCK_SIZE, sweep=True)
        flush_runs = {"sdpa_dense": lambda: dense_sdpa(q, dense_k, dense_v),
                      "hybridengine": lambda: PA.paged_decode_attention(q, k_cache, v_cache, tables, lens,
                                                                        scale=scale, max_context_len=context)}
        for provider, fn in flush_runs.items():  # what the flush's write-back adds to a call
            for write in (False, True):
                times = cold_times(ctx, fn, warmup=3, repeats=20, flush=flush, write_flush=write)
                ctx.rec.add("paged_attention", provider, MODEL, {**base, "split": "flush_check",
                            "flush": "write" if write else "read"}, "seconds", times)
                ctx.log(f"paged_attention sweep B={batch} ctx={context} {provider} after a "
                        f"{'write' if write else 'read'} flush: {quantiles(times)[1] * 1e6:.1f} us")
        factors = SWEEP_SPLIT_FACTORS if auto > 1 else (1,)
        best = None
        for config in SWEEP_CONFIGS:
            for factor in factors:
                splits = min(auto * factor, PA.DECODE_MAX_SPLITS, max(1, context // config["BLOCK_N"]))
                parts = PA.decode_partitions(context, splits, config["BLOCK_N"])[0]
                case = dict(base, flush="read", split=f"{factor}x_auto", num_partitions=parts, dot="16bit", **config)

                def fn(splits=splits, config=config):
                    return PA.paged_decode_attention_triton(q, k_cache, v_cache, tables, lens, scale=scale,
                                                            num_splits=splits, max_context_len=context,
                                                            config=config)
                times = _timed_config(ctx, f"sweep {config}", fn, expected, case, flush, warmup=3, repeats=20)
                if times is None:
                    continue
                median = quantiles(times)[1]
                if best is None or median < best[0]:
                    best = (median, config, parts)
        if best is not None:
            median, config, parts = best
            ctx.log(f"paged_attention sweep B={batch} ctx={context}: best {median * 1e6:.1f} us "
                    f"({nbytes / median / 1e9:,.0f} GB/s) with {config}, {parts} partitions")
        del q, dense_k, dense_v, k_cache, v_cache, tables, lens, expected
        release_memory()


SPLIT_CASES = {(1, 4096): (8, 16, 24, 33, 48, 64, 99, 128), (1, 16384): (16, 24, 33, 48, 64, 99, 128, 256),
               (16, 4096): (2, 3, 4, 6, 9), (16, 16384): (2, 3, 4, 6, 9, 16)}
"""Split counts tried per (batch, context): at B = 1 from a third of a wave (4 kv heads x 33 = 132 programs,
one per SM) to the automatic plan's 128 and beyond; at B = 16 (64 programs per split) around its 9."""
SPLIT_CONFIGS = [dict(BLOCK_N=n, num_warps=w, num_stages=s) for n, w, s in ((32, 4, 4), (64, 4, 3), (128, 4, 3))]


def paged_attention_splits(ctx: Ctx) -> None:
    """Split count x tile config where split-K decides the time (small batches, long contexts), beside
    dense SDPA in the same run. Rows carry case sweep="splits". GPU only."""
    from hybridengine.ops import paged_attention as PA

    if not ctx.cuda:
        ctx.rec.not_run("paged_attention", "hybridengine", MODEL, "split sweep: GPU only", sweep="splits")
        return
    flush = _flush_buffer(ctx)
    scale = HEAD_DIM**-0.5
    g = torch.Generator(device=ctx.device).manual_seed(0)
    for (batch, context), split_counts in SPLIT_CASES.items():
        nbytes = kv_bytes(batch, context)
        q, dense_k, dense_v, k_cache, v_cache, tables, lens = decode_inputs(ctx, batch, context, g)

        def sdpa():
            return dense_sdpa(q, dense_k, dense_v)

        expected = sdpa()
        base = dict(batch=batch, context=context, q_heads=NUM_Q_HEADS, kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM,
                    dtype="bf16", kv_bytes=nbytes, block_size=BLOCK_SIZE, flush="read", sweep="splits")
        times = cold_times(ctx, sdpa, warmup=5, repeats=30, flush=flush)
        ctx.rec.add("paged_attention", "sdpa_dense", MODEL, base, "seconds", times)
        sdpa_s = quantiles(times)[1]
        best = (float("inf"), None)
        for config in SPLIT_CONFIGS:
            for splits in split_counts:
                parts, size = PA.decode_partitions(context, splits, config["BLOCK_N"])
                case = dict(base, split="forced", num_partitions=parts, partition_size=size, **config)

                def fn(splits=splits, config=config):
                    return PA.paged_decode_attention_triton(q, k_cache, v_cache, tables, lens, scale=scale,
                                                            num_splits=splits, max_context_len=context,
                                                            config=config)
                times = _timed_config(ctx, f"splits {splits} {config}", fn, expected, case, flush,
                                      warmup=5, repeats=30)
                if times is None:
                    continue
                median = quantiles(times)[1]
                best = min(best, (median, f"{parts} partitions of {size}, {config}"), key=lambda x: x[0])
        ctx.log(f"paged_attention splits B={batch} ctx={context}: sdpa {sdpa_s * 1e6:.1f} us; best "
                f"{best[0] * 1e6:.1f} us ({nbytes / best[0] / 1e9:,.0f} GB/s, {sdpa_s / best[0]:.2f}x sdpa) "
                f"with {best[1]}")
        del q, dense_k, dense_v, k_cache, v_cache, tables, lens, expected
        release_memory()


PREFETCH_CASES = (("qwen2-7b", (28, 4), 1, 16384), ("qwen2-7b", (28, 4), 1, 4096), ("qwen2-7b", (28, 4), 16, 4096),
                  ("qwen2-7b", (28, 4), 128, 256), ("qwen2-7b", (28, 4), 128, 1024),
                  ("qwen2.5-1.5b", (12, 2), 128, 256), ("qwen2.5-1.5b", (12, 2), 128, 512),
                  ("qwen2.5-1.5b", (12, 2), 64, 512))
"""(model, (q_heads, kv_heads), B, context): the split-K cases of the issue's goal and the decode shapes of
both generate models (GRPO contexts 128 .. 640 at decode batch sizes)."""
PREFETCH_CONFIGS = [dict(BLOCK_N=n, num_warps=w, num_stages=1, PREFETCH=True)
                    for n, w in ((32, 4), (64, 4), (64, 8), (128, 4), (128, 8))]
"""Register prefetch at several tiles; num_stages=1: the loop is not software-pipelined by Triton anyway."""


READ_CONFIGS = [dict(block=b, iters=i, num_warps=w)
                for b, i, w in ((4096, 1, 4), (4096, 4, 8), (8192, 2, 8), (2048, 8, 4))]
"""Launch shapes of the read-floor kernel (elements per load, loads per program, warps)."""


def cold_read(flat: torch.Tensor, *, block: int, iters: int, num_warps: int) -> torch.Tensor:
    """Reads every element of `flat` once (a Triton kernel: each program sums `iters` tiles of `block`
    elements into one fp32); returns the per-program sums."""
    import triton

    from .read_kernel import read_sum_kernel

    programs = triton.cdiv(flat.numel(), block * iters)
    out = torch.empty(programs, dtype=torch.float32, device=flat.device)
    read_sum_kernel[(programs,)](flat, out, flat.numel(), BLOCK=block, ITERS=iters, num_warps=num_warps)
    return out


def paged_attention_prefetch(ctx: Ctx) -> None:
    """The decode kernel's register prefetch (config PREFETCH) against the default launch, the split counts
    around the automatic plan, dense SDPA and a cold read of the same bytes (provider `hbm_read`: one
    `torch.sum` over a contiguous buffer of the case's K/V bytes, the floor for a kernel that reads them
    once; it is not a floor: dense SDPA beats it at the 1.5B shapes) and `read_kernel` (a plain Triton
    read of the same bytes, the fastest of READ_CONFIGS: the floor). Rows carry case sweep="prefetch" and
    the model whose heads they use. GPU only."""
    from hybridengine.ops import paged_attention as PA

    if not ctx.cuda:
        ctx.rec.not_run("paged_attention", "hybridengine", MODEL, "prefetch sweep: GPU only", sweep="prefetch")
        return
    flush = _flush_buffer(ctx)
    scale = HEAD_DIM**-0.5
    g = torch.Generator(device=ctx.device).manual_seed(0)
    sms = PA.num_sms(ctx.device)
    for model, heads, batch, context in PREFETCH_CASES:
        nbytes = kv_bytes(batch, context, heads[1])
        q, dense_k, dense_v, k_cache, v_cache, tables, lens = decode_inputs(ctx, batch, context, g, heads)
        expected = dense_sdpa(q, dense_k, dense_v)
        base = dict(batch=batch, context=context, q_heads=heads[0], kv_heads=heads[1], head_dim=HEAD_DIM,
                    dtype="bf16", kv_bytes=nbytes, block_size=BLOCK_SIZE, flush="read", sweep="prefetch")
        flat = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=ctx.device).normal_()
        peers = {"sdpa_dense": lambda: dense_sdpa(q, dense_k, dense_v),
                 "hbm_read": lambda: flat.sum(dtype=torch.float32)}
        summary = {}
        for provider, fn in peers.items():
            times = cold_times(ctx, fn, warmup=5, repeats=30, flush=flush)
            ctx.rec.add("paged_attention", provider, model, base, "seconds", times)
            summary[provider] = quantiles(times)[1]
        for config in READ_CONFIGS:  # the read floor: the fastest of a few plain read kernels over the same bytes
            times = cold_times(ctx, lambda config=config: cold_read(flat, **config), warmup=5, repeats=30, flush=flush)
            ctx.rec.add("paged_attention", "read_kernel", model, dict(base, **config), "seconds", times)
            summary["read_kernel"] = min(summary.get("read_kernel", float("inf")), quantiles(times)[1])
        auto = PA.decode_num_splits(batch, heads[1], context, sms)
        split_counts = sorted({auto, max(1, auto // 2), auto * 2} if auto > 1 else {1, 2, 4})
        best = (float("inf"), "")
        for splits in split_counts:
            configs = [None] + PREFETCH_CONFIGS
            for config in configs:
                block_n = (config or PA._decode_config(ctx.device, HEAD_DIM, splits > 1))["BLOCK_N"]
                if splits > 1 and context // splits < block_n:
                    continue
                parts = PA.decode_partitions(context, splits, block_n)[0]
                label = "default" if config is None else "prefetch"
                case = dict(base, split=f"{splits}", num_partitions=parts, variant=label,
                            **(config or PA._decode_config(ctx.device, HEAD_DIM, splits > 1)))

                def fn(splits=splits, config=config):
                    return PA.paged_decode_attention_triton(q, k_cache, v_cache, tables, lens, scale=scale,
                                                            num_splits=splits, max_context_len=context,
                                                            config=config)
                times = _timed_config(ctx, f"prefetch {model} B={batch} {splits} {config}", fn, expected, case,
                                      flush, warmup=3, repeats=20, model=model)
                if times is None:
                    continue
                median = quantiles(times)[1]
                if config is None and splits == auto:
                    summary["auto"] = median
                best = min(best, (median, f"{label} {parts} partitions {config or ''}"), key=lambda x: x[0])
        ctx.log(f"paged_attention prefetch {model} B={batch} ctx={context}: "
                f"read kernel {summary['read_kernel'] * 1e6:.1f} us, torch.sum {summary['hbm_read'] * 1e6:.1f}, "
                f"sdpa {summary['sdpa_dense'] * 1e6:.1f}, auto {summary.get('auto', float('nan')) * 1e6:.1f}, best "
                f"{best[0] * 1e6:.1f} us ({nbytes / best[0] / 1e9:,.0f} GB/s) with {best[1]}")
        del q, dense_k, dense_v, k_cache, v_cache, tables, lens, expected, flat
        release_memory()
