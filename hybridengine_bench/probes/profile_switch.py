"""Where the train -> gen switch goes: host page mapping against the NCCL all-gathers on the GPU.

    torchrun --nproc-per-node 2 -m hybridengine_bench.probes.profile_switch --model qwen2-7b --out DIR [--batch-mib N]

One `switch_to_generation()` per variant under torch.profiler, after two warm-up round trips:
"mapped" (the default: each batch's pages are mapped on the host, then its all-gathers start) and
"kept" (pages kept by `switch_to_training(release=False)`: the all-gathers alone). From the trace:
the switch's wall time, host time in `map_unit`, GPU time in NCCL kernels (union), how much of the
mapping ran while an all-gather was on the GPU, and the GPU's idle time inside the switch. If the
mapping overlapped the all-gathers, idle ~ the first batch's mapping; if the driver serialises it
with the GPU's work, idle ~ all of it. With the VMM buffer, the host time of each driver call
(cuMemCreate, cuMemMap, cuMemSetAccess; VmmRange.timings) says which one costs. Writes
DIR/profile_switch.json (rank 0) and a chrome trace per variant and rank. On CPU (gloo) it runs for the
tests: host ranges only.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from .profile_decode import busy


def overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length of (union of a) intersected with (union of b)."""
    return busy(a) + busy(b) - busy(a + b)


def analyse(window: tuple[float, float], maps: list[tuple[float, float]], nccl: list[tuple[float, float]]) -> dict:
    """Milliseconds from [start, end) intervals in microseconds (the profiler's clock)."""
    start, end = window
    inside = [(max(s, start), min(e, end)) for s, e in nccl if e > start and s < end]
    return dict(wall_ms=(end - start) / 1e3, map_ms=busy(maps) / 1e3, nccl_busy_ms=busy(inside) / 1e3,
                map_under_nccl_ms=overlap(maps, inside) / 1e3, gpu_idle_ms=((end - start) - busy(inside)) / 1e3,
                first_nccl_after_ms=(min(s for s, _ in inside) - start) / 1e3 if inside else None,
                maps=len(maps), nccl_kernels=len(inside))


def profile_one(buf, variant: str, cuda: bool, trace: Path | None) -> dict:
    """Profile one switch_to_generation of `buf` (in the training state) and return `analyse`'s numbers."""
    gen = buf.gen
    plain = gen.map_unit

    def traced(u):
        with torch.profiler.record_function("he.map_unit"):
            return plain(u)

    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if gen.vmm is not None:
        gen.vmm.timings(reset=True)
    gen.map_unit = traced
    try:
        with torch.profiler.profile(activities=acts) as prof:
            sync()
            if dist.is_initialized():
                dist.barrier()
            t0 = time.perf_counter()
            with torch.profiler.record_function("he.switch_to_generation"):
                buf.switch_to_generation()
                sync()
            host_s = time.perf_counter() - t0
    finally:
        del gen.map_unit  # back to the class's method
    if trace is not None:
        prof.export_chrome_trace(str(trace))
    events = list(prof.events())
    window = next(e for e in events if e.name == "he.switch_to_generation").time_range
    maps = [(e.time_range.start, e.time_range.end) for e in events if e.name == "he.map_unit"]
    nccl = [(e.time_range.start, e.time_range.end) for e in events
            if e.device_type == torch.autograd.DeviceType.CUDA and "nccl" in e.name.lower()]
    driver = {} if gen.vmm is None else {k: dict(ms=t * 1e3, calls=n) for k, (t, n) in gen.vmm.timings().items()}
    return dict(variant=variant, host_ms=host_s * 1e3, driver=driver, **analyse((window.start, window.end), maps, nccl))


def run(model: str, device: torch.device, out: Path, batch_bytes: int | None) -> dict:
    from hybridengine.sharding.switch import ShardedBuffer

    from ..switch import _specs

    cuda = device.type == "cuda"
    specs, _ = _specs(model)
    buf = ShardedBuffer(specs, dtype=torch.bfloat16 if cuda else torch.float32, device=device,
                        switch_batch_bytes=batch_bytes)
    for s in buf.shard_views():
        s.normal_()
    rank = dist.get_rank() if dist.is_initialized() else 0
    out.mkdir(parents=True, exist_ok=True)
    for _ in range(2):
        buf.switch_to_generation()
        buf.switch_to_training()
        buf.wait_released()
    result = dict(model=model, device=torch.cuda.get_device_name(device) if cuda else "cpu", torch=torch.__version__,
                  world_size=buf.world_size, switch_batch_bytes=buf.switch_batch_bytes, vmm=buf.use_vmm,
                  received_GB=sum(u.shard_numel for u in buf.layout.units) * (buf.layout.num_shards - 1)
                  * buf.layout.element_size / 1e9, variants=[])
    mapped = profile_one(buf, "mapped", cuda, out / f"trace_mapped_rank{rank}.json")
    buf.switch_to_training(release=False)
    kept = profile_one(buf, "kept", cuda, out / f"trace_kept_rank{rank}.json")
    buf.switch_to_training()
    buf.close()
    result["variants"] = [mapped, kept]
    if rank == 0:
        (out / "profile_switch.json").write_text(json.dumps(result, indent=1))
        for v in result["variants"]:
            print(f"{model} switch ({v['variant']}): wall {v['wall_ms']:.2f} ms, host map {v['map_ms']:.2f} ms "
                  f"({v['maps']} calls, {v['map_under_nccl_ms']:.2f} ms of it under an all-gather), NCCL busy "
                  f"{v['nccl_busy_ms']:.2f} ms in {v['nccl_kernels']} kernels, GPU idle {v['gpu_idle_ms']:.2f} ms",
                  flush=True)
            if v["driver"]:
                print("  driver: " + ", ".join(f"{k} {d['ms']:.2f} ms / {d['calls']}" for k, d in v["driver"].items()),
                      flush=True)
    return result


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen2-7b")
    ap.add_argument("--batch-mib", type=int, default=None, help="switch_batch_bytes in MiB (default: automatic)")
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.cpu
    if cuda:
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    try:
        return run(args.model, device, args.out, None if args.batch_mib is None else args.batch_mib << 20)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
