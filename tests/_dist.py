"""Run a test worker in `world` gloo processes: fn(rank, world, init_file, *args, errors)."""

import os
import tempfile

import torch.multiprocessing as mp


def spawn(fn, world: int, *args) -> None:
    """Start the processes, wait for them, and fail with every rank's reported error."""
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(fn, args=(world, os.path.join(tmp, "store"), *args, errors), nprocs=world,
                           start_method="spawn", join=True)
    messages = []
    while not errors.empty():
        messages.append(errors.get())
    assert not messages, "\n".join(messages)
