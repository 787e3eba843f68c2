"""Run a test worker in `world` gloo processes: fn(rank, world, init_file, *args, errors)."""

import contextlib
import gc
import os
import sys
import tempfile
import traceback

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


def spawn(fn, world: int, *args) -> None:
    """Start the processes, wait for them, and fail with every rank's reported error."""
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    failure = None
    with tempfile.TemporaryDirectory() as tmp:
        try:
            mp.start_processes(fn, args=(world, os.path.join(tmp, "store"), *args, errors), nprocs=world,
                               start_method="spawn", join=True)
        except mp.ProcessExitedException as e:  # a rank died (a signal): keep what the others reported
            failure = e
    messages = []
    while not errors.empty():
        messages.append(errors.get())
    if failure is not None:  # the reports name the first error; a rank that aborts is often its peer's victim
        raise AssertionError(f"{failure}; reports of the other ranks: {messages or 'none'}") from failure
    assert not messages, "\n".join(messages)
