"""Probe: what offload "rollout"'s round trip costs on this machine, part by part.

    python -m hybridengine_bench.probes.probe_offload_transfers [--gib 32]
    (CUDA; on CPU a harness check with a few MiB)

bench offload found the GRPO step 38% slower with offload "rollout" at Qwen2-7B (71 GiB of state each way),
the way back not hidden behind `log_probs`. This probe measures, with state laid out as the optimizer's
(3 kinds x 30 units in one registered host allocation, `train.offload.HostBuffer`), under the engine's
allocator setting (expandable segments):
- alloc: host seconds to allocate the state on the device after `torch.cuda.empty_cache()` (what the
  first training call after a rollout does before it can queue its own work), and the empty_cache itself;
- copy: device seconds and GB/s of the chunked copies on a side stream, device to host and host to device;
- overlap: a bf16 GEMM loop of about a second on the compute stream alone, then with the copy back running
  on the side stream: both durations, so whether the copy hides behind compute and what it costs it;
- decode: seconds per step of a host-bound loop shaped like a decode step (small GEMMs, the tokens to
  pinned memory, a wait for them), alone and while the copy out runs queued whole or windowed
  (`WindowedCopier`);
- off_copy_engine: the same loop with its tokens written to mapped pinned memory by a kernel, beside the
  windowed copy out; and the copy out done by kernels writing mapped host memory: its bandwidth alone and
  the loop beside it.
Rows (JSONL): hybridengine_bench/results/probe_offload_transfers.jsonl.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

from hybridengine_bench.common import append_jsonl

UNITS = 30
KINDS = ("exp_avg", "exp_avg_sq", "master_lo")


def _elapsed(fn, stream=None) -> float:
    """Device seconds of what fn queues on `stream` (the current one by default), waited for."""
    stream = stream or torch.cuda.current_stream()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record(stream)
    with torch.cuda.stream(stream):
        fn()
    end.record(stream)
    end.synchronize()
    return begin.elapsed_time(end) / 1e3


def main(argv: list[str] | None = None) -> None:
    from hybridengine.train import offload as off

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=32.0, help="state size (fp32), split over kinds and units")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "probe_offload_transfers.jsonl"))
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")  # as the engine does
    device = torch.device("cuda" if cuda else "cpu")
    gib = args.gib if cuda else 8 / 1024
    numel = int(gib * 2**30 / 4 / (len(KINDS) * UNITS))
    shapes = {kind: (torch.float32, [numel] * UNITS) for kind in KINDS}
    nbytes = numel * 4 * len(KINDS) * UNITS
    meta = dict(gpu=torch.cuda.get_device_name() if cuda else "cpu", torch=torch.__version__,
                commit=os.environ.get("HE_COMMIT", "unknown"), run_id=os.environ.get("HE_BENCH_RUN_ID", "probe"),
                state_GiB=nbytes / 2**30, tensors=len(KINDS) * UNITS, chunk_MiB=off.CHUNK_BYTES / 2**20)
    host = off.HostBuffer(shapes, device=device)
    views = [host.views[kind, u] for kind in KINDS for u in range(UNITS)]
    rows = []

    def record(part: str, what: str, values: list[float], **extra) -> None:
        row = dict(meta, part=part, what=what, seconds=statistics.median(values), values=values, **extra)
        rows.append(row)
        rate = f", {nbytes / row['seconds'] / 1e9:.1f} GB/s" if part == "copy" or what.startswith("copy") else ""
        print(f"{part} {what}: {row['seconds'] * 1e3:.1f} ms{rate}")

    def allocate() -> list[torch.Tensor]:
        return [torch.empty(numel, dtype=torch.float32, device=device) for _ in views]

    # alloc: after empty_cache, as after a rollout's exit
    alloc, empty = [], []
    for _ in range(args.repeats):
        if cuda:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            torch.cuda.empty_cache()
            empty.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        state = allocate()
        alloc.append(time.perf_counter() - t0)
        del state
    record("alloc", "allocate_state", alloc)
    if cuda:
        record("alloc", "empty_cache_before", empty)

    state = allocate()
    for t in state:
        t.fill_(1.0)
    h2d, d2h = off._Streams.of(device)

    def copy(dst, src) -> None:
        for d, s in zip(dst, src):
            for a, b in off._chunks(s, off.CHUNK_BYTES):
                off.copy_chunk(d[a:b], s[a:b], non_blocking=cuda)

    if not cuda:  # the harness: the copies are synchronous, nothing overlaps
        for what, dst, src in (("copy_out", views, state), ("copy_back", state, views)):
            t0 = time.perf_counter()
            copy(dst, src)
            record("copy", what, [time.perf_counter() - t0])
        return
    torch.cuda.synchronize()
    out = [_elapsed(lambda: copy(views, state), d2h) for _ in range(args.repeats)]
    back = [_elapsed(lambda: copy(state, views), h2d) for _ in range(args.repeats)]
    record("copy", "copy_out", out)
    record("copy", "copy_back", back)

    # overlap: a GEMM loop alone, then with the copy back on the side stream
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    one = _elapsed(lambda: [a @ b for _ in range(10)]) / 10
    iters = max(1, int(statistics.median(back) / one))  # a loop about as long as the copy

    def gemms() -> None:
        for _ in range(iters):
            a @ b

    alone = [_elapsed(gemms) for _ in range(args.repeats)]
    together_gemm, together_copy = [], []
    for _ in range(args.repeats):
        torch.cuda.synchronize()
        cb, ce = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        cb.record(h2d)
        with torch.cuda.stream(h2d):
            copy(state, views)
        ce.record(h2d)
        together_gemm.append(_elapsed(gemms))
        ce.synchronize()
        together_copy.append(cb.elapsed_time(ce) / 1e3)
    record("overlap", "gemm_loop_alone", alone, gemm_iters=iters)
    record("overlap", "gemm_loop_with_copy_back", together_gemm, gemm_iters=iters)
    record("overlap", "copy_back_with_gemm_loop", together_copy, gemm_iters=iters)

    # decode: a host-bound loop shaped like a decode step (small GEMMs, then the step's tokens to pinned host
    # memory and a wait for them), alone and beside the copy out queued whole and windowed
    x = torch.randn(256, 3584, dtype=torch.bfloat16, device=device)
    w = torch.randn(3584, 3584, dtype=torch.bfloat16, device=device)
    tokens = torch.empty(256, dtype=torch.int64).pin_memory()

    def decode_steps(n: int = 200, out: torch.Tensor | None = None) -> float:
        """Seconds per step; `out`: a CUDA view of `tokens` (mapped pinned memory) that a kernel writes,
        instead of a copy by the copy engine."""
        t0 = time.perf_counter()
        for _ in range(n):
            y = x
            for _ in range(8):
                y = y @ w
            if out is None:
                tokens.copy_(y[:, 0].to(torch.int64), non_blocking=True)
            else:
                torch.bitwise_or(y[:, 0].to(torch.int64), 0, out=out)
            torch.cuda.current_stream().synchronize()
        return (time.perf_counter() - t0) / n

    decode_steps(20)
    record("decode", "step_alone", [decode_steps() for _ in range(args.repeats)])
    for how in ("queued_whole", "windowed"):
        steps = []
        for _ in range(args.repeats):
            torch.cuda.synchronize()
            if how == "windowed":
                cp = off.WindowedCopier(device, [(v.data_ptr(), t.data_ptr(), t.numel() * 4)
                                                 for v, t in zip(views, state)], d2h)
            else:
                d2h.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(d2h):
                    copy(views, state)
            steps.append(decode_steps(100))  # about 0.3 s: inside the copy
            cp.synchronize() if how == "windowed" else d2h.synchronize()
        record("decode", f"step_with_copy_out_{how}", steps)
    try:
        _off_the_copy_engine(record, decode_steps, tokens, views, state, nbytes, args.repeats)
    except Exception as e:  # noqa: BLE001 - a probe of alternatives: record why it could not run
        print(f"off_copy_engine: not run ({type(e).__name__}: {e})")
        rows.append(dict(meta, part="off_copy_engine", what="not_run", error=f"{type(e).__name__}: {e}"))
    append_jsonl(args.out, rows)


def _off_the_copy_engine(record, decode_steps, tokens, views, state, nbytes, repeats) -> None:
    """The copy engine delays every small device-to-host copy while the copy out runs. Two ways around it:
    - mapped_tokens: the decode loop's tokens written to mapped pinned memory by a kernel, beside the
      windowed copy out (the copy engine busy, the tokens not on it);
    - sm_copy_out: the copy out itself done by kernels writing mapped host memory (64 MiB per launch, on
      a side stream), alone (its bandwidth) and beside the decode loop (copies by the copy engine)."""
    from hybridengine.rollout.runner import mapped
    from hybridengine.train import offload as off

    device = torch.device("cuda")
    out = mapped(tokens, device).view(torch.int64)
    record("off_copy_engine", "step_mapped_tokens_alone", [decode_steps(out=out) for _ in range(repeats)])
    d2h = off._Streams.of(device)[1]
    steps = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        cp = off.WindowedCopier(device, [(v.data_ptr(), t.data_ptr(), t.numel() * 4) for v, t in zip(views, state)],
                                d2h)
        steps.append(decode_steps(100, out=out))
        cp.synchronize()
    record("off_copy_engine", "step_mapped_tokens_with_copy_out_windowed", steps)

    host = [mapped(v, device).view(torch.int32) for v in views]
    src = [t.view(torch.int32) for t in state]
    chunk = 16 * 2**20  # int32 elements: 64 MiB

    def sm_copy() -> None:
        for d, s_ in zip(host, src):
            for a in range(0, s_.numel(), chunk):
                torch.bitwise_or(s_[a:a + chunk], 0, out=d[a:a + chunk])

    side = torch.cuda.Stream()

    def timed_sm_copy(during=None) -> float:
        """Device seconds of one kernel copy out on the side stream; `during()` runs meanwhile."""
        torch.cuda.synchronize()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record(side)
        with torch.cuda.stream(side):
            sm_copy()
        end.record(side)
        if during is not None:
            during()
        end.synchronize()
        return begin.elapsed_time(end) / 1e3

    record("off_copy_engine", "copy_out_by_kernels", [timed_sm_copy() for _ in range(repeats)])
    assert all(torch.equal(v, t.cpu()) for v, t in zip(views[:2], state[:2])), "the kernel copy is not exact"
    steps, during = [], []
    for _ in range(repeats):
        during.append(timed_sm_copy(lambda: steps.append(decode_steps(100))))
    record("off_copy_engine", "step_with_copy_out_by_kernels", steps)
    record("off_copy_engine", "copy_out_by_kernels_with_decode", during)


if __name__ == "__main__":
    main()
