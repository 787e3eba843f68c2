"""Probe: which launch configs of `exact_decode_attention` keep the varlen kernel's bits, and what each costs.

    python -m hybridengine_bench.probes.probe_exact_decode [--out FILE]
    (CUDA; --cpu: the harness under the interpreter)

The decode kernel must give each sequence's last token the bits that `exact_attention` (the training kernel)
gives that row. `forward_tile` makes both kernels share BLOCK_M, BLOCK_N and num_warps (64, 64, 4 on CUDA),
so a decode program computes a 64-row tile for a GQA group of 6 or 7 query heads. The row sum of the online
softmax is a register reduction whose order follows the tile's layout, which is why the tiles are shared;
this probe measures whether smaller row tiles (less MMA work per decode program) keep the bits anyway. For
each config: whether every row of a batch of mixed lengths equals the varlen kernel's, at the Qwen2.5-1.5B and
Qwen2-7B head shapes (bf16), and the decode time at 256 sequences of 256-token context (`graph_seconds`: 20
launches in a CUDA graph, median and p20/p80 of 50 replays; a launch timed alone measures the host's launch
overhead, not the kernel). Rows (JSONL): hybridengine_bench/results/probe_exact_decode.jsonl.
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path

import torch

from hybridengine_bench.common import append_jsonl, graph_seconds

SHAPES = {"qwen2.5-1.5b": (12, 2, 128), "qwen2-7b": (28, 4, 128)}
"""Query heads, KV heads, head_dim."""
CONFIGS = (None, dict(BLOCK_M=16), dict(BLOCK_M=32), dict(BLOCK_M=16, num_warps=1), dict(BLOCK_M=16, num_stages=2),
           dict(BLOCK_M=16, num_warps=1, num_stages=2), dict(BLOCK_M=16, num_warps=1, num_stages=4),
           dict(BLOCK_M=32, num_warps=2))
"""None: the shared forward tile (the engine's launch). The others override it in the decode alone. Why one
warp per 16 rows (16/1, 32/2) may keep the bits: in the forward tile's 64 x 64 MMA each of the 4 warps owns
16 whole rows, so a row's max and sum run within one warp's fragment in both; the probe checks it."""
LENS = [1, 63, 64, 65, 200, 257, 511, 700] + [int(x) for x in torch.randint(
    2, 2049, (24,), generator=torch.Generator().manual_seed(5))]
"""Context lengths: the tile edges, then 24 drawn up to 2,048."""
PAGE = 16


def _packed(lens, hq, hk, d, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    total = sum(lens)
    q, k, v = (torch.randn(total, h, d, generator=g).to(dtype).to(device) for h in (hq, hk, hk))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return q, k, v, cu


def _paged(k, v, lens, page):
    """The sequences' K/V in a paged cache (blocks in a shuffled order): (k_cache, v_cache, block_tables)."""
    blocks = [-(-n // page) for n in lens]
    order = torch.randperm(sum(blocks), generator=torch.Generator().manual_seed(1)).tolist()
    k_cache = torch.zeros(sum(blocks), page, *k.shape[1:], dtype=k.dtype, device=k.device)
    v_cache = torch.zeros_like(k_cache)
    tables, start, used = [], 0, 0
    for n, nb in zip(lens, blocks):
        ids = order[used:used + nb]
        used += nb
        for j, b in enumerate(ids):
            rows = slice(start + j * page, start + min((j + 1) * page, n))
            k_cache[b, :rows.stop - rows.start] = k[rows]
            v_cache[b, :rows.stop - rows.start] = v[rows]
        tables.append(ids + [-1] * (max(blocks) - nb))
        start += n
    return k_cache, v_cache, torch.tensor(tables, dtype=torch.int32, device=k.device)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def main(argv: list[str] | None = None) -> None:
    from hybridengine.ops import _launch
    from hybridengine.ops import exact_attention as EA

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "probe_exact_decode.jsonl"))
    parser.add_argument("--cpu", action="store_true", help="the harness under the Triton interpreter")
    args = parser.parse_args(argv)
    cuda = not args.cpu
    if cuda and not torch.cuda.is_available():
        raise SystemExit("probe_exact_decode: needs CUDA (or --cpu)")
    device = torch.device("cuda" if cuda else "cpu")
    if not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        _launch.use_kernel = lambda t: True  # noqa: E731 - the launchers on CPU tensors
    configs = CONFIGS if cuda else (None, dict(BLOCK_M=16, BLOCK_N=16, num_warps=4))
    lens = LENS if cuda else [1, 5, 17, 33]
    meta = dict(gpu=torch.cuda.get_device_name() if cuda else "cpu", torch=torch.__version__,
                commit=os.environ.get("HE_COMMIT", "unknown"), run_id=os.environ.get("HE_BENCH_RUN_ID", "probe"))
    rows = []
    for model, (hq, hk, d) in SHAPES.items():
        if not cuda:
            hq, hk, d = 6, 2, 32
        q, k, v, cu = _packed(lens, hq, hk, d, torch.bfloat16, device)
        scale = d ** -0.5
        varlen = EA.exact_attention(q, k, v, cu, scale=scale, max_seqlen=max(lens))
        k_cache, v_cache, tables = _paged(k, v, lens, PAGE)
        last = (cu[1:] - 1).long()
        context = torch.tensor(lens, dtype=torch.int32, device=device)
        # the timed batch: 256 sequences of 256 tokens (8 on CPU)
        batch, ctx = (256, 256) if cuda else (8, 16)
        tq, tk, tv, _ = _packed([ctx] * batch, hq, hk, d, torch.bfloat16, device, seed=2)
        tk_cache, tv_cache, ttables = _paged(tk, tv, [ctx] * batch, PAGE)
        tq = tq.view(batch, ctx, hq, d)[:, -1].contiguous()
        tlens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
        for config in configs:
            try:
                out = EA.exact_decode_attention_triton(q[last], k_cache, v_cache, tables, context, scale=scale,
                                                       config=config)
            except Exception as err:  # noqa: BLE001 - a config the compiler refuses is a finding too
                rows.append(dict(meta, model=model, config=config, error=repr(err)[:300]))
                print(f"{model} {config}: {err!r}"[:200])
                continue
            equal = (_bits(out) == _bits(varlen[last])).all(-1).all(-1)  # per sequence
            row = dict(meta, model=model, config=config or "forward_tile", lens=lens,
                       sequences_equal=int(equal.sum()), sequences=len(lens))
            if cuda:
                def launch(config=config):
                    EA.exact_decode_attention_triton(tq, tk_cache, tv_cache, ttables, tlens, scale=scale, config=config)

                times = graph_seconds(launch, calls=20, warmup=10, replays=50)
                qs = statistics.quantiles(times, n=10)
                row.update(batch=batch, context=ctx, seconds=statistics.median(times), p20=qs[1], p80=qs[7])
            rows.append(row)
            print(f"{model} {config or 'forward_tile'}: {row['sequences_equal']}/{len(lens)} sequences bitwise equal"
                  + (f", {row['seconds'] * 1e6:.1f} us at {batch} x {ctx}" if cuda else ""))
    if cuda:
        append_jsonl(args.out, rows)


if __name__ == "__main__":
    main()
