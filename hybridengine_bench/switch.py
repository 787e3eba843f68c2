"""The zero-copy switch and the training-view unit gather (hybridengine), next to the NCCL floor
of the same bytes and FSDP2's unshard of the same layer, measured in the same run.

Rows: bench `switch` (train_to_gen / gen_to_train, per tg), `unit_gather` (one decoder layer),
`switch_memory` (peak during the switch, and mapped bytes after 100 round trips).
"""

from __future__ import annotations

import os
import time

import torch

from hybridengine.sharding.switch import _all_gather

from .common import GiB, Ctx, nvml_used_gib, quantiles


def _specs(model: str):
    from transformers import AutoModelForCausalLM

    from hybridengine import model_config
    from hybridengine.sharding.layout import param_specs

    cfg = model_config(model)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(cfg)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return param_specs([(n, tuple(p.shape)) for n, p in hf.named_parameters()], head_dim=head_dim), cfg


def _nccl_floor(ctx: Ctx, numel_out: int, dtype, desc: str) -> list[float]:
    """One all_gather_into_tensor whose output has numel_out elements (the bytes the switch moves)."""
    per_rank = numel_out // ctx.world
    out = torch.empty(per_rank * ctx.world, dtype=dtype, device=ctx.device)
    inp = torch.randn(per_rank, device=ctx.device).to(dtype)
    times = ctx.measure(lambda: _all_gather(out, inp), warmup=3, repeats=10, desc=desc)
    del out, inp
    return times


def _fill(buf) -> None:
    """Random weights in every shard. A helper, not a loop in the bench: a loop variable left holding the
    last shard view would keep a closed buffer's pages mapped into the next case (and raise its pre-buffer
    NVML baseline)."""
    for shard in buf.shard_views():
        shard.normal_()


def _timed_to_gen(ctx: Ctx, buf) -> tuple[float, float | None]:
    """GPU seconds of one train->gen switch, and host seconds of the driver's page calls in it
    (cuMemCreate + cuMemMap + cuMemSetAccess; None without the VMM buffer)."""
    vmm = buf.gen.vmm
    if vmm is not None:
        vmm.timings(reset=True)
    t = ctx.timed(buf.switch_to_generation)
    if vmm is None:
        return t, None
    calls = vmm.timings()
    return t, sum(calls[k][0] for k in ("create", "map", "set_access"))


IDLE_GAP_S = 0.5
"""Idle time before the `after_idle_s` train->gen rows (a training step is longer than that)."""


def _to_gen_after_idle(ctx: Ctx, buf, ahead: bool = False) -> tuple[list[float], list[float]]:
    """Timed train->gen switches, each IDLE_GAP_S after the previous release ended: (seconds, driver
    page-call seconds where the VMM timings exist). `ahead`: `prepare_generation()` at the start of
    the gap (where a trainer calls it after launching its last optimizer step), so the pages are mapped
    on a host thread before the switch."""
    times, driver = [], []
    for _ in range(ctx.reps(10)):
        if ahead:
            buf.prepare_generation()
        time.sleep(IDLE_GAP_S)
        t, pages = _timed_to_gen(ctx, buf)
        times.append(t)
        if pages is not None:
            driver.append(pages)
        buf.switch_to_training()
        buf.wait_released()
    return times, driver


def switch(ctx: Ctx) -> None:
    from hybridengine.sharding.switch import ShardedBuffer

    if ctx.world < 2:
        ctx.rec.not_run("switch", "hybridengine", None, "needs >= 2 ranks")
        return
    dtype = torch.bfloat16
    for model in ctx.models:
        specs, _ = _specs(model)
        for tp in [d for d in (1, 2, 4, 8) if ctx.world % d == 0]:
            case = dict(tg=tp, dtype="bf16")
            baseline = nvml_used_gib(ctx)  # before the buffer exists (NCCL is up: the all_gather bench ran)
            with ctx.peak():
                buf = ShardedBuffer(specs, dtype=dtype, device=ctx.device, tp_size=tp)
                _fill(buf)
            lay = buf.layout
            gen_bytes = lay.gen_numel * lay.element_size
            recv_bytes = gen_bytes * (lay.num_shards - 1) // lay.num_shards
            case.update(gen_GB=round(gen_bytes / 1e9, 3), received_GB=round(recv_bytes / 1e9, 3),
                        vmm=buf.use_vmm, units=len(lay.units))
            for _ in range(2):  # warm-up: NCCL channels, first mappings
                buf.switch_to_generation()
                buf.switch_to_training()
            to_gen, to_train, released, host, driver = [], [], [], [], []
            with ctx.peak() as pm:
                for _ in range(ctx.reps(10)):
                    # Beside the GPU time (events): the host's wall time of the call up to its end event,
                    # and the host time in the driver's page calls inside it.
                    t0 = time.perf_counter()
                    t, pages = _timed_to_gen(ctx, buf)
                    host.append(time.perf_counter() - t0)
                    to_gen.append(t)
                    if pages is not None:
                        driver.append(pages)
                    to_train.append(ctx.timed(buf.switch_to_training))
                    # The pages go back to the driver on a host thread after the call returns; in a
                    # training loop that overlaps the next phase. Waited outside the timed calls, and
                    # timed on its own below.
                    buf.wait_released()
                for _ in range(ctx.reps(10)):
                    buf.switch_to_generation()
                    ctx.sync()
                    t0 = time.perf_counter()
                    buf.switch_to_training()
                    buf.wait_released()
                    released.append(time.perf_counter() - t0)
                # The same train->gen after the pages went back half a second earlier, as in an RL loop where a
                # training step runs between the two switches: back to back (above) the driver's page calls
                # take longer right after a release.
                after_gap, gap_driver = _to_gen_after_idle(ctx, buf)
                # Pages mapped ahead: prepare_generation() at the start of the gap, the switch only gathers.
                ahead, _ = _to_gen_after_idle(ctx, buf, ahead=True)
            to_gen, to_train, released = ctx.slowest(to_gen), ctx.slowest(to_train), ctx.slowest(released)
            after_gap = ctx.slowest(after_gap)
            ctx.rec.add("switch", "hybridengine", model, {**case, "direction": "train_to_gen",
                                                           "after_idle_s": IDLE_GAP_S}, "seconds", after_gap)
            ctx.rec.add("switch", "hybridengine", model, {**case, "direction": "train_to_gen",
                                                           "after_idle_s": IDLE_GAP_S, "pages": "mapped ahead"},
                        "seconds", ctx.slowest(ahead))
            ctx.rec.add("switch", "hybridengine", model, {**case, "direction": "train_to_gen"}, "seconds", to_gen)
            ctx.rec.add("switch", "hybridengine", model, {**case, "direction": "gen_to_train"}, "seconds", to_train)
            ctx.rec.add("switch", "hybridengine", model, {**case, "direction": "gen_to_train",
                                                           "until": "pages released"}, "seconds", released)
            ctx.rec.add("switch_detail", "hybridengine", model, {**case, "direction": "train_to_gen",
                                                                 "what": "host wall incl. barrier"}, "seconds", host)
            if driver:
                ctx.rec.add("switch_detail", "hybridengine", model, {**case, "direction": "train_to_gen",
                                                                     "what": "driver page calls (rank 0 host)"},
                            "seconds", driver)
            ctx.record_peak(pm, "switch", "hybridengine", model, {**case, "model_over_tg_GiB": gen_bytes / GiB})
            if ctx.cuda:  # what the switch adds to the device: its NVML peak over the pre-buffer baseline
                ctx.rec.add("switch", "hybridengine", model,
                            {**case, "model_over_tg_GiB": gen_bytes / GiB, "source": "nvml", "scope": "above_baseline",
                             "baseline_GiB": round(baseline, 3)}, "peak_GiB", pm.nvml_gib - baseline)
            if recv_bytes:
                ctx.rec.add("switch", "hybridengine", model, {**case, "direction": "train_to_gen"}, "GB_per_s",
                            [recv_bytes / t / 1e9 for t in to_gen])
            # Memory stays where it was after 100 round trips (VMM: only the own shards mapped).
            before = buf.gen.mapped_bytes()
            for _ in range(ctx.reps(100)):
                buf.switch_to_generation()
                buf.switch_to_training()
            ctx.sync()
            after = buf.gen.mapped_bytes()
            ctx.rec.add("switch_memory", "hybridengine", model, {**case, "after": "100 round trips",
                                                                 "before_GiB": before / GiB}, "peak_GiB", after / GiB)
            ctx.log(f"  switch {model} tg={tp}: train->gen {quantiles(to_gen)[1] * 1e3:.2f} ms, gen->train "
                    f"{quantiles(to_train)[1] * 1e3:.3f} ms (pages released after "
                    f"{quantiles(released)[1] * 1e3:.2f} ms), {recv_bytes / 1e9:.2f} GB received per rank, "
                    f"peak torch {pm.torch_gib:.2f} / nvml {pm.nvml_gib:.2f} GiB ({pm.nvml_gib - baseline:.2f} "
                    f"over the {baseline:.2f} GiB before the buffer; model/tg {gen_bytes / GiB:.2f} GiB), "
                    f"mapped {before / GiB:.2f} -> {after / GiB:.2f} GiB after 100 trips")
            if driver:
                ctx.log(f"    train->gen per call (ms): GPU {' '.join(f'{t * 1e3:.1f}' for t in to_gen)}; "
                        f"driver {' '.join(f'{t * 1e3:.1f}' for t in driver)}")
                ctx.log(f"    after {IDLE_GAP_S} s idle: train->gen {quantiles(after_gap)[1] * 1e3:.2f} ms; "
                        f"per call GPU {' '.join(f'{t * 1e3:.1f}' for t in after_gap)}; driver "
                        f"{' '.join(f'{t * 1e3:.1f}' for t in gap_driver)}")
                ctx.log(f"    after {IDLE_GAP_S} s idle, pages mapped ahead: train->gen "
                        f"{quantiles(ahead)[1] * 1e3:.2f} ms")
            if tp == 1:
                _batch_sweep(ctx, buf, model, case)
            buf.close()
            del buf
            if tp == 1:  # the floor: the same bytes as one NCCL all-gather
                floor = _nccl_floor(ctx, lay.gen_numel, dtype, "nccl floor")
                ctx.rec.add("switch", "nccl", model, {"tg": 1, "dtype": "bf16", "direction": "train_to_gen",
                                                      "what": "one all_gather_into_tensor of the model"},
                            "seconds", floor)
                ctx.log(f"  nccl all-gather of the same {gen_bytes / 1e9:.2f} GB: {quantiles(floor)[1] * 1e3:.2f} ms")


def _batch_sweep(ctx: Ctx, buf, model: str, case: dict) -> None:
    """train->gen at other NCCL group sizes (bytes received per group call; 0: one all-gather per unit),
    then at the default with the pages kept mapped between switches (switch_to_training(release=False)):
    the switch is the all-gather alone. Each timed switch follows an idle gap of IDLE_GAP_S."""
    default = buf.switch_batch_bytes
    sizes = sorted({0, 256 << 20, 1 << 30, 2 << 30, 8 << 30, default})
    variants = [(batch, True) for batch in sizes] + [(default, False)]
    for batch, release in variants:
        buf.switch_batch_bytes = batch
        times = []
        for i in range(1 + ctx.reps(8)):  # the first switch warms up (and maps the pages to keep)
            time.sleep(IDLE_GAP_S)  # as in an RL loop (see `switch`): the driver's state after a release settles
            t = ctx.timed(buf.switch_to_generation)
            buf.switch_to_training(release=release)
            buf.wait_released()
            if i:
                times.append(t)
        times = ctx.slowest(times)
        if release:
            row = {"batch_MiB": batch >> 20, "default": batch == default, "after_idle_s": IDLE_GAP_S}
        else:
            buf.release_generation_pages()
            buf.wait_released()
            row = {"batch_MiB": batch >> 20, "pages": "kept mapped", "after_idle_s": IDLE_GAP_S}
        ctx.rec.add("switch_batch_sweep", "hybridengine", model, {**case, "direction": "train_to_gen", **row},
                    "seconds", times)
        ctx.log(f"  switch {model} batch {batch >> 20} MiB{'' if release else ', pages kept mapped'}: train->gen "
                f"{quantiles(times)[1] * 1e3:.2f} ms")
    buf.switch_batch_bytes = default


def unit_gather(ctx: Ctx) -> None:
    """One decoder layer: hybridengine gather (+ unpack for tg > 1) vs raw all-gather vs FSDP2 unshard."""
    from hybridengine.sharding.switch import ShardedBuffer

    if ctx.world < 2:
        ctx.rec.not_run("unit_gather", "hybridengine", None, "needs >= 2 ranks")
        return
    dtype = torch.bfloat16
    for model in ctx.models:
        specs, cfg = _specs(model)
        layer = [s for s in specs if s.unit == "layers.0"]
        unit_bytes = None
        for tp in _gather_tgs(ctx.world):
            buf = ShardedBuffer(layer, dtype=dtype, device=ctx.device, tp_size=tp)
            _fill(buf)
            unit = buf.layout.units[0]
            unit_bytes = unit.numel * buf.layout.element_size
            name, variant = _gather_case(tp, ctx.world)
            times = ctx.measure(lambda: buf.gather_unit(0), warmup=3, repeats=20, desc=f"gather {name}")
            case = dict(tg=tp, unit="layers.0", MB=round(unit_bytes / 1e6, 1), unpack=tp > 1) | variant
            ctx.rec.add("unit_gather", "hybridengine", model, case, "seconds", times)
            ctx.rec.add("unit_gather", "hybridengine", model, case, "busbw_GB_per_s",
                        [unit_bytes / t / 1e9 * (ctx.world - 1) / ctx.world for t in times])
            ctx.log(f"  unit gather {model} {name}: {quantiles(times)[1] * 1e3:.3f} ms for {unit_bytes / 1e6:.0f} MB")
            buf.close()
        _pipelined(ctx, model, specs, dtype)
        _pipelined(ctx, model, specs, dtype, layers=8, lookahead=1)
        raw = _nccl_floor(ctx, unit_bytes // 2, dtype, "raw all-gather")
        ctx.rec.add("unit_gather", "nccl", model, dict(unit="layers.0", MB=round(unit_bytes / 1e6, 1)), "seconds", raw)
        ctx.rec.add("unit_gather", "nccl", model, dict(unit="layers.0", MB=round(unit_bytes / 1e6, 1)),
                    "busbw_GB_per_s", [unit_bytes / t / 1e9 * (ctx.world - 1) / ctx.world for t in raw])
        ctx.log(f"  raw all-gather of the same bytes: {quantiles(raw)[1] * 1e3:.3f} ms")
        _fsdp2_layer(ctx, model, cfg)


UNPACK_BLOCKS_SWEEP = (0, 66, 132)
"""With HE_UNPACK_SWEEP=1: grid bounds tried for a prefetched unit's unpack beside the default
(ShardedBuffer.prefetch_unpack_blocks: 3/4 of the SMs; 0: unbounded)."""


def _gather_tgs(world: int) -> list[int]:
    """The tg of the unit gathers run: 1 (the all-gather alone) and, where the world allows it, 2
    (all-gather + unpack kernel)."""
    return [tp for tp in (1, 2) if world % tp == 0]


def _gather_case(tp: int, world: int) -> tuple[str, dict]:
    """Log name and case entries of a unit-gather variant (rows at N == tg name the gather "staged", as
    the stored rows of earlier runs do)."""
    if tp == world > 1:
        return f"tg={tp} staged", {"gather": "staged"}
    return f"tg={tp}", {}


def _pipelined(ctx: Ctx, model: str, specs, dtype, layers: int = 4, lookahead: int | None = None) -> None:
    """Training's steady state: `layers` decoder layers gathered on the side stream (unpacks on their own
    stream) and consumed in order, time per layer; against the same number of raw all-gathers of a
    layer's bytes back to back. lookahead None: every layer prefetched before the first is consumed;
    1: layer u + 1 prefetched just before layer u is consumed, as a training forward does."""
    from hybridengine.sharding.switch import ShardedBuffer

    names = {f"layers.{i}" for i in range(layers)}
    sub = [s for s in specs if s.unit in names]
    for tp in _gather_tgs(ctx.world):
        buf = ShardedBuffer(sub, dtype=dtype, device=ctx.device, tp_size=tp)
        name, variant = _gather_case(tp, ctx.world)
        _fill(buf)
        n = len(buf.layout.units)
        unit_bytes = buf.layout.units[0].numel * buf.layout.element_size

        def run():
            if lookahead is None:
                for u in range(n):
                    buf.prefetch_unit(u)
            else:
                buf.prefetch_unit(0)
            for u in range(n):
                if lookahead is not None:
                    for v in range(u + 1, min(n, u + 1 + lookahead)):
                        buf.prefetch_unit(v)
                buf.gather_unit(u)

        # The staged unpack beside the next all-gather, its grid unbounded and bounded (prefetch_unpack_blocks).
        default = buf.prefetch_unpack_blocks
        sweep = tp > 1 and bool(os.environ.get("HE_UNPACK_SWEEP"))
        for blocks in [default] + (list(UNPACK_BLOCKS_SWEEP) if sweep else []):
            buf.prefetch_unpack_blocks = blocks
            label = name + ("" if blocks == default
                            else f", unpack <= {blocks} blocks" if blocks else ", unpack unbounded")
            times = [t / n for t in ctx.measure(run, warmup=3, repeats=20, desc=f"pipelined {label}")]
            case = dict(tg=tp, unit="layers.0", MB=round(unit_bytes / 1e6, 1), unpack=tp > 1, pipelined=n) | variant
            case |= {"lookahead": lookahead} if lookahead is not None else {}
            case |= {"unpack_blocks": blocks} if blocks != default else {}
            ctx.rec.add("unit_gather", "hybridengine", model, case, "seconds", times)
            ctx.rec.add("unit_gather", "hybridengine", model, case, "busbw_GB_per_s",
                        [unit_bytes / t / 1e9 * (ctx.world - 1) / ctx.world for t in times])
            ahead = "all prefetched" if lookahead is None else f"{lookahead} ahead"
            ctx.log(f"  unit gather {model} {label}, {n} layers pipelined ({ahead}): "
                    f"{quantiles(times)[1] * 1e3:.3f} ms per layer")
        buf.prefetch_unpack_blocks = default
        buf.close()
    layers = n
    per_rank = unit_bytes // ctx.world // 2
    outs = [torch.empty(per_rank * ctx.world, dtype=dtype, device=ctx.device) for _ in range(layers)]
    inp = torch.randn(per_rank, device=ctx.device).to(dtype)

    def raw():
        for out in outs:
            _all_gather(out, inp)

    times = [t / layers for t in ctx.measure(raw, warmup=3, repeats=20, desc="raw back to back")]
    case = dict(unit="layers.0", MB=round(per_rank * ctx.world * 2 / 1e6, 1), pipelined=layers)
    ctx.rec.add("unit_gather", "nccl", model, case, "seconds", times)
    ctx.rec.add("unit_gather", "nccl", model, case, "busbw_GB_per_s",
                [per_rank * ctx.world * 2 / t / 1e9 * (ctx.world - 1) / ctx.world for t in times])
    ctx.log(f"  raw all-gathers, {layers} back to back: {quantiles(times)[1] * 1e3:.3f} ms each")


def _fsdp2_layer(ctx: Ctx, model: str, cfg) -> None:
    """FSDP2 unshard (all-gather + copy-out) of one decoder layer with bf16 sharded parameters."""
    from torch.distributed.fsdp import fully_shard
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer

    with torch.device(ctx.device):
        layer = Qwen2DecoderLayer(cfg, 0).to(torch.bfloat16)
    fully_shard(layer)

    def unshard():
        layer.unshard()
        layer.reshard()

    times = ctx.measure(unshard, warmup=3, repeats=20, desc="fsdp2 unshard")
    ctx.rec.add("unit_gather", "fsdp2", model, dict(unit="layers.0", what="unshard+reshard, bf16 params"),
                "seconds", times)
    ctx.log(f"  fsdp2 unshard+reshard of the layer: {quantiles(times)[1] * 1e3:.3f} ms")
