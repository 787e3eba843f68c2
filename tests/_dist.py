"""Run a test worker in `world` gloo processes: fn(rank, world, init_file, *args, errors)."""

import os
import tempfile

import torch.multiprocessing as mp


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
