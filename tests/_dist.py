"""Run a test worker in `world` gloo processes: fn(rank, world, init_file, *args, errors)."""

import os
import tempfile

import torch.distributed as dist
import torch.multiprocessing as mp


def finish(ok: bool) -> None:
    """End a worker's process group. After a rank's last collective its peer may still be sending its part
    of it; a rank that closed its gloo sockets then makes the peer's send fail in gloo's own thread, which
    aborts the process (SIGABRT, seen in CI). A rank that succeeded meets the others in a barrier first; a
    rank that failed skips it, so its peers' barrier fails fast (closed sockets) instead of waiting."""
    if ok:
        dist.barrier()
    dist.destroy_process_group()


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
