"""The resharding copy (`hybridengine.ops.segment_copy`) against `copy_` of the same bytes.

Tables are real: the unpack (slice-major -> natural) and pack tables of one qwen2-7b decoder layer
for N = 2, tg = 2 from `ShardedLayout`, repeated over consecutive layers until the size is reached,
and a worst case of only 1792-element rows (a row-parallel weight's TP slice, the o_proj rows).
GB/s counts bytes read plus bytes written. Providers: `hybridengine` (the op), `torch_copy`
(contiguous `copy_` of the same bytes: the floor) and `torch_ref` (`index_select` with a
precomputed int64 index, the fastest plain-torch gather; it also reads 8 index bytes per element).
"""

from __future__ import annotations

import math

import torch

from .common import GiB, MiB, Ctx, quantiles, release_memory

SIZES_GPU = (64 * MiB, 256 * MiB, GiB, 4 * GiB)
SIZES_CPU = (256 * 1024, 2 * MiB)
TORCH_REF_MAX_BYTES = GiB
"""The gather index is 4x the data (int64 per bf16 element): 1 GiB of data needs 4 GiB of index."""


def layer_table(model: str) -> tuple[torch.Tensor, int, int]:
    """(unpack table, slice-major numel, natural numel) of decoder layer 0 for N = 2, tg = 2."""
    from transformers import AutoModelForCausalLM

    from hybridengine.model.presets import model_config
    from hybridengine.sharding.layout import ShardedLayout, param_specs

    cfg = model_config(model)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(cfg)
    shapes = [(n, tuple(p.shape)) for n, p in meta.named_parameters() if ".layers.0." in n]
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    unit = ShardedLayout(param_specs(shapes, head_dim=head_dim), world_size=2, tp_size=2).units[0]
    return unit.unpack_table(), unit.numel, unit.natural_numel


def tile(table: torch.Tensor, src_numel: int, dst_numel: int, numel: int) -> tuple[torch.Tensor, int, int]:
    """The table over consecutive copies of its unit until `numel` elements are copied (last row cut)."""
    per_unit = int(table[:, 2].sum())
    reps = math.ceil(numel / per_unit)
    shift = torch.arange(reps).repeat_interleave(len(table))
    out = table.repeat(reps, 1)
    out[:, 0] += shift * src_numel
    out[:, 1] += shift * dst_numel
    end = out[:, 2].cumsum(0)
    out = out[end - out[:, 2] < numel].clone()
    out[-1, 2] -= int(out[:, 2].sum()) - numel
    return out, reps * src_numel, reps * dst_numel


def row_slices(numel: int, row: int = 1792) -> tuple[torch.Tensor, int, int]:
    """Unpack of a row-parallel weight, tg = 2: src [slice 0 rows | slice 1 rows] -> natural rows."""
    rows = numel // (2 * row)
    t, i = torch.arange(2).repeat_interleave(rows), torch.arange(rows).repeat(2)
    table = torch.stack([t * rows * row + i * row, i * 2 * row + t * row, torch.full_like(t, row)], 1)
    return table, 2 * rows * row, 2 * rows * row


def gather_index(table: torch.Tensor, device: torch.device) -> torch.Tensor:
    """src index of every written dst element, in dst order (the dst of torch_ref is compact)."""
    table = table[torch.argsort(table[:, 1])].to(device)
    s, n = table[:, 0], table[:, 2]
    row = torch.repeat_interleave(torch.arange(len(table), device=device), n)
    return s[row] + torch.arange(len(row), device=device) - (n.cumsum(0) - n)[row]


def _spot_check(src: torch.Tensor, dst: torch.Tensor, table: torch.Tensor) -> None:
    for s, d, n in table[torch.randperm(len(table))[:256]].tolist():
        if not torch.equal(dst[d:d + n], src[s:s + n]):
            raise RuntimeError(f"segment_copy wrote wrong data for row (src={s}, dst={d}, numel={n})")


def segment_copy(ctx: Ctx) -> None:
    try:
        from hybridengine.ops import EXTENSION_ERROR, extension_has, prepare_table
        from hybridengine.ops import segment_copy as op
        built = extension_has("segment_copy", ctx.device.type)
    except ImportError as e:
        EXTENSION_ERROR, built = f"hybridengine.ops does not import: {e}", False
    reason = None if built else (f"hybridengine._C has no {ctx.device.type} segment_copy "
                                 f"({EXTENSION_ERROR or 'op not registered'})")
    layer = layer_table("qwen2-7b" if ctx.cuda else "tiny-qwen2")
    for nbytes in SIZES_GPU if ctx.cuda else SIZES_CPU:
        numel = nbytes // 2
        unpack = tile(*layer, numel)
        pack = (unpack[0][:, [1, 0, 2]], unpack[2], unpack[1])
        for pattern, (table, src_numel, dst_numel) in (("layer_unpack", unpack), ("layer_pack", pack),
                                                        ("rows1792", row_slices(numel))):
            moved, index, dev_table = int(table[:, 2].sum()), None, None
            case = dict(bytes=2 * moved, pattern=pattern, rows=len(table), dtype="bf16")
            src = torch.randn(src_numel, dtype=torch.bfloat16, device=ctx.device)
            dst = torch.full((dst_numel,), float("nan"), dtype=torch.bfloat16, device=ctx.device)
            flat_src = src[:moved]
            flat_dst = torch.empty(moved, dtype=torch.bfloat16, device=ctx.device)
            runs = {"torch_copy": lambda: flat_dst.copy_(flat_src)}
            if built:
                dev_table = prepare_table(table, 2, src_numel=src_numel, dst_numel=dst_numel, device=ctx.device)
                runs["hybridengine"] = lambda: op(src, dst, dev_table)
            elif pattern == "layer_unpack":
                ctx.rec.not_run("segment_copy", "hybridengine", None, reason, **case)
            if nbytes <= TORCH_REF_MAX_BYTES:
                index = gather_index(table, ctx.device)
                runs["torch_ref"] = lambda: torch.index_select(src, 0, index, out=flat_dst)
            for provider, fn in runs.items():
                times = ctx.measure(fn, warmup=5, repeats=30, desc=f"segment_copy {pattern} {nbytes // MiB} MiB")
                if provider == "hybridengine":
                    _spot_check(src, dst, table)
                ctx.rec.add("segment_copy", provider, None, case, "GB_per_s", [2 * 2 * moved / t / 1e9 for t in times])
                ctx.log(f"segment_copy {pattern} {2 * moved / MiB:.0f} MiB {provider}: "
                        f"{4 * moved / quantiles(times)[1] / 1e9:,.0f} GB/s")
            del src, dst, flat_src, flat_dst, runs, index, dev_table
            release_memory()
