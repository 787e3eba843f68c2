"""Run a test worker in `world` gloo processes: fn(rank, world, init_file, *args, errors)."""

import contextlib
import gc
import os
import sys
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def finish(ok: bool) -> None:
    """End a worker: its process group, then the process itself.

    A rank that succeeded meets the others in a barrier first (no rank tears down while a peer still
    runs the last collective); a rank that failed skips it, so its peers' barrier fails fast (closed
    sockets) instead of waiting. The process then leaves with os._exit(0), skipping interpreter
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
        os._exit(0)


@contextlib.contextmanager
def reporting(errors, label: str):
    """The body of a spawned worker: an exception goes to the parent through `errors`, as `label` and its
    traceback; then the process ends through `finish`, with the barrier when the body succeeded."""
    ok = False
    try:
        yield
        ok = True
    except Exception:  # noqa: BLE001 - reported to the parent with the rank
        errors.put(f"{label}: {traceback.format_exc()}")
    finally:
        finish(ok)


def _worker(rank: int, fn, threads: int, *args) -> None:
    """A spawned worker: its share of the parent's CPU threads, then fn(rank, *args)."""
    torch.set_num_threads(threads)
    fn(rank, *args)


def spawn(fn, world: int, *args) -> None:
    """Start the processes, wait for them, and fail with every rank's reported error.

    The workers run on the CPU: they see no GPU (CUDA_VISIBLE_DEVICES is empty while they start; they
    test the sharding logic over gloo, and on a GPU machine each of up to 8 processes would otherwise
    initialise CUDA), and they share the parent's CPU threads (world processes with a thread per core
    each oversubscribe the CPU world times over, and OpenMP's spinning threads then starve each other)."""
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    failure = None
    threads = max(1, torch.get_num_threads() // world)
    with tempfile.TemporaryDirectory() as tmp:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # read by each worker when it starts
        try:
            workers = mp.start_processes(_worker, args=(fn, threads, world, os.path.join(tmp, "store"), *args, errors),
                                         nprocs=world, start_method="spawn", join=False)
        finally:
            if visible is None:
                del os.environ["CUDA_VISIBLE_DEVICES"]
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = visible
        try:
            while not workers.join():
                pass
        except mp.ProcessExitedException as e:  # a rank died (a signal): keep what the others reported
            failure = e
    messages = []
    while not errors.empty():
        messages.append(errors.get())
    if failure is not None:  # the reports name the first error; a rank that aborts is often its peer's victim
        raise AssertionError(f"{failure}; reports of the other ranks: {messages or 'none'}") from failure
    assert not messages, "\n".join(messages)
