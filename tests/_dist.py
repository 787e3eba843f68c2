"""Run a test worker in `world` gloo processes: fn(rank, world, init_file, *args, errors).

Every failure of a worker fails the calling test, with the rank's traceback in the message: any exception,
BaseExceptions included (`pytest.fail`, a `pytest.raises` that saw nothing, SystemExit, KeyboardInterrupt), a
non-zero exit, a signal. Two bounds keep a hang from blocking the run: every process group a worker makes
times out after `pg_timeout_s` (a collective waiting on a stuck peer raises), and the parent kills every
worker still running `join_timeout_s` after the start (a worker stuck outside a collective)."""

import contextlib
import ctypes
import datetime
import gc
import os
import signal
import sys
import tempfile
import time
import traceback
from multiprocessing.connection import wait

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Defaults, overridden by the environment (a slow machine) or by spawn's arguments (the harness's own tests).
# A healthy run's ranks move in step: no collective waits near PG_TIMEOUT_S for a peer, and the slowest CPU
# tests take 60-100 s in all. JOIN_TIMEOUT_S stays under pytest's per-test timeout (pyproject.toml) so that
# the harness, which names the ranks still running, fires first.
PG_TIMEOUT_S = float(os.environ.get("HE_TEST_PG_TIMEOUT", 90))
JOIN_TIMEOUT_S = float(os.environ.get("HE_TEST_JOIN_TIMEOUT", 240))
# After the first rank fails, how long its peers have to report their own errors before they are killed
# (a peer blocked in a collective with the failed rank fails at once: its sockets close).
GRACE_S = 15.0


def finish(ok: bool) -> None:
    """End a worker: its process group, then the process itself (exit status 0 if `ok`, else 1).

    A rank that succeeded meets the others in a barrier first (no rank tears down while a peer still
    runs the last collective); a rank that failed skips it, so its peers' barrier fails fast (closed
    sockets) instead of waiting. The process then leaves with os._exit, skipping interpreter
    finalization. Three times in sessions 8-9 (about one full suite in four) a gloo rank aborted with
    "terminate called without an active exception" (a std::thread destroyed while joinable) and no rank
    reported an error; teardown at exit is the suspect (pytorch/pytorch#179291 describes a gloo abort
    during finalization), not confirmed. An abort before this call still fails the test. Every result
    has gone through the errors queue by then. Only for spawned workers: it ends the process."""
    try:
        if ok:
            dist.barrier()
        dist.destroy_process_group()
    finally:
        gc.collect()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0 if ok else 1)


@contextlib.contextmanager
def reporting(errors, label: str):
    """The body of a spawned worker: whatever it raises goes to the parent through `errors`, as `label` and
    its traceback; then the process ends through `finish`, with the barrier when the body succeeded.

    BaseException, not Exception: pytest's `fail` and a `pytest.raises` block that saw nothing raise
    `Failed`, a BaseException; caught as Exception they passed silently."""
    ok = False
    try:
        yield
        ok = True
    except BaseException:  # noqa: BLE001 - reported to the parent with the rank
        errors.put(f"{label}: {traceback.format_exc()}")
    finally:
        finish(ok)


def _worker(rank: int, fn, threads: int, pg_timeout_s: float, world: int, init_file: str, *rest) -> None:
    """A spawned worker: killed with its parent, its share of the parent's CPU threads, a bound on every
    process group it makes, then fn(rank, world, init_file, *rest); what fn raises outside `reporting` is
    reported too (the queue is rest[-1])."""
    if sys.platform == "linux":  # a parent killed outright (no `finally`) leaves no orphan spinning in a collective
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    torch.set_num_threads(threads)
    # The default, not an argument to init_process_group: new_group(timeout=None) takes the backend's default
    # (30 min for gloo), not its parent group's, and the library makes its subgroups that way.
    dist.distributed_c10d.default_pg_timeout = datetime.timedelta(seconds=pg_timeout_s)
    try:
        fn(rank, world, init_file, *rest)
    except BaseException:  # noqa: BLE001 - a SystemExit, even exit(0), is a failure of the worker
        rest[-1].put(f"rank {rank} (outside `reporting`): {traceback.format_exc()}")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


def _describe_exit(code: int) -> str:
    return f"signal {signal.Signals(-code).name}" if code < 0 else f"status {code}"


def spawn(fn, world: int, *args, pg_timeout_s: float | None = None, join_timeout_s: float | None = None) -> None:
    """Start the processes, wait for them, and fail with every rank's reported error.

    The workers run on the CPU: they see no GPU (CUDA_VISIBLE_DEVICES is empty while they start; they
    test the sharding logic over gloo, and on a GPU machine each of up to 8 processes would otherwise
    initialise CUDA), and they share the parent's CPU threads (world processes with a thread per core
    each oversubscribe the CPU world times over, and OpenMP's spinning threads then starve each other).
    The reports are read while the workers run: a worker's put blocks once the pipe holds 64 KiB."""
    pg_timeout_s = PG_TIMEOUT_S if pg_timeout_s is None else pg_timeout_s
    join_timeout_s = JOIN_TIMEOUT_S if join_timeout_s is None else join_timeout_s
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    threads = max(1, torch.get_num_threads() // world)
    reports, procs, running = [], [], {}
    first_failure = timed_out = None
    with tempfile.TemporaryDirectory() as tmp:
        try:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            os.environ["CUDA_VISIBLE_DEVICES"] = ""  # read by each worker when it starts
            try:
                for rank in range(world):
                    p = ctx.Process(target=_worker, name=f"rank {rank}", args=(
                        rank, fn, threads, pg_timeout_s, world, os.path.join(tmp, "store"), *args, errors))
                    p.start()
                    procs.append(p)
                    running[rank] = p
            finally:
                if visible is None:
                    del os.environ["CUDA_VISIBLE_DEVICES"]
                else:
                    os.environ["CUDA_VISIBLE_DEVICES"] = visible
            deadline = time.monotonic() + join_timeout_s
            while running:
                now = time.monotonic()
                if now >= deadline:
                    timed_out = sorted(running)
                    break
                ended = wait([p.sentinel for p in running.values()], timeout=min(0.5, deadline - now))
                while not errors.empty():
                    reports.append(errors.get())
                for rank in [r for r, p in running.items() if p.sentinel in ended]:
                    running.pop(rank).join()
                    if procs[rank].exitcode != 0 and first_failure is None:
                        first_failure = rank
                        deadline = min(deadline, time.monotonic() + GRACE_S)
        finally:  # also when a start fails or the parent is interrupted (pytest-timeout, ^C): no orphans
            for p in running.values():
                p.kill()
            for p in procs:
                p.join()
    while not errors.empty():
        reports.append(errors.get())

    name = getattr(fn, "__qualname__", repr(fn))
    problems = []
    if timed_out is not None:
        if first_failure is None:
            problems.append(f"ranks {timed_out} still ran {join_timeout_s:.0f} s after the start (join_timeout_s, "
                            f"HE_TEST_JOIN_TIMEOUT): hung, killed")
        else:
            problems.append(f"ranks {timed_out} still ran {GRACE_S:.0f} s after rank {first_failure} failed: killed")
    killed = set(timed_out or ())
    problems += [f"rank {r} exited with {_describe_exit(p.exitcode)}" for r, p in enumerate(procs)
                 if p.exitcode != 0 and r not in killed]
    if problems or reports:
        summary = "; ".join(problems or ["every rank exited with 0"])
        details = "\n".join(reports) if reports else "no rank reported an error (see their stderr)"
        raise AssertionError(f"spawn({name}, world={world}): {summary}\n{details}")
