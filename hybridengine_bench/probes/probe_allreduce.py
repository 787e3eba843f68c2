"""Probe: the decode all-reduce of TP generation, NCCL against torch's symmetric-memory one-shot kernels.

    torchrun --standalone --nproc-per-node 2 -m hybridengine_bench.probes.probe_allreduce

Each case captures 50 back-to-back all-reduces of a [B, H] bf16 tensor in one CUDA graph (as the
decode step runs them) and times replays; prints us per all-reduce (median, p20-p80) and checks each
variant's result against NCCL's bit for bit. Rank 0 prints; results also go to $OUT/probe_allreduce.json.
"""

from __future__ import annotations

import json
import os
import statistics

import torch
import torch.distributed as dist

from ..common import graph_seconds


def timed_graph(fn, reps: int = 50, replays: int = 15) -> list[float]:
    """Microseconds per call: `reps` calls in one CUDA graph, ranks lined up by a barrier before each replay."""
    return [t * 1e6 for t in graph_seconds(fn, calls=reps, warmup=3, replays=replays, before_replay=dist.barrier)]


def main():
    import torch.distributed._symmetric_memory as symm_mem

    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dev = torch.device("cuda", torch.cuda.current_device())
    group = dist.group.WORLD
    name = group.group_name
    try:
        symm_mem.enable_symm_mem_for_group(name)
    except Exception as e:  # noqa: BLE001
        print("enable_symm_mem_for_group:", e)
    cap = 256 * 8192
    bufs = [symm_mem.empty(cap, dtype=torch.bfloat16, device=dev) for _ in range(2)]
    for b in bufs:
        symm_mem.rendezvous(b, group=name)
    results = []
    for B, H in [(8, 3584), (128, 1536), (256, 1536), (128, 3584), (256, 3584), (256, 8192)]:
        gen = torch.Generator(device=dev).manual_seed(rank + 1)
        x0 = torch.randn(B, H, device=dev, generator=gen).to(torch.bfloat16)
        ref = x0.clone()
        dist.all_reduce(ref)
        row = dict(B=B, H=H, MB=B * H * 2 / 1e6)
        x = x0.clone()
        out = torch.empty_like(x0)

        def nccl():
            dist.all_reduce(x)

        row["nccl"] = timed_graph(nccl)
        n = B * H
        state = {"i": 0}

        def one_shot_copy():
            buf = bufs[state["i"] % 2][:n].view(B, H)
            state["i"] += 1
            torch.ops.symm_mem.one_shot_all_reduce_copy_out(buf, x0, "sum", name, out)

        def two_shot():
            buf = bufs[0][:n].view(B, H)
            buf.copy_(x0)
            torch.ops.symm_mem.two_shot_all_reduce_(buf, "sum", name)

        for label, fn, result in [("one_shot_copy", one_shot_copy, lambda: out),
                                  ("two_shot", two_shot, lambda: bufs[0][:n].view(B, H))]:
            try:
                fn()
                torch.cuda.synchronize()
                row[label + "_equal"] = bool(torch.equal(result(), ref))
                row[label] = timed_graph(fn)
                row[label + "_equal_after_graph"] = bool(torch.equal(result(), ref)) if label != "two_shot" else None
            except Exception as e:  # noqa: BLE001
                row[label] = None
                row[label + "_error"] = f"{type(e).__name__}: {e}"[:300]
        results.append(row)
        if rank == 0:
            parts = [f"B={B} H={H} ({row['MB']:.2f} MB)"]
            for k in ("nccl", "one_shot_copy", "two_shot"):
                v = row.get(k)
                if v:
                    q = statistics.quantiles(v, n=5)
                    parts.append(f"{k} {statistics.median(v):.1f} us ({q[0]:.1f}-{q[3]:.1f})")
                else:
                    parts.append(f"{k} error {row.get(k + '_error')}")
            parts.append(f"equal {row.get('one_shot_copy_equal')}/{row.get('one_shot_copy_equal_after_graph')}/"
                         f"{row.get('two_shot_equal')}")
            print(" | ".join(parts), flush=True)
    if rank == 0 and os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "probe_allreduce.json"), "w") as f:
            json.dump(dict(torch=torch.__version__, nccl=".".join(map(str, torch.cuda.nccl.version())),
                           device=torch.cuda.get_device_name(), rows=results), f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
