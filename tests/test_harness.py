"""The test harness itself: _dist.spawn fails the calling test on every kind of worker failure, with the
rank's traceback; a hung worker or collective fails in bounded time; a missing extension fails the tests
that need it unless HE_ALLOW_NO_EXTENSION=1 turns them into skips."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from _dist import reporting, spawn

REPO = Path(__file__).resolve().parent.parent


def _init(rank, world, init_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)


def _clean(rank, world, init_file, errors):
    _init(rank, world, init_file)
    with reporting(errors, f"rank {rank}"):
        t = torch.tensor([rank + 1.0])
        dist.all_reduce(t)
        assert t.item() == world * (world + 1) / 2


def _fail_pytest():
    pytest.fail("worker gave up")


def _exit_zero():
    sys.exit(0)


def _raises_nothing():
    with pytest.raises(ValueError, match="never"):
        pass


def _interrupt():
    raise KeyboardInterrupt


# Rank r fails the r-th way; the last rank raises outside `reporting` (the harness's own catch). What each
# rank's report shows:
FAILURES = [(_fail_pytest, "Failed: worker gave up"), (_exit_zero, "SystemExit: 0"),
            (_raises_nothing, "DID NOT RAISE"), (_interrupt, "KeyboardInterrupt")]


def _each_rank_fails_its_own_way(rank, world, init_file, errors):
    _init(rank, world, init_file)
    dist.barrier()
    how = FAILURES[rank][0]
    if rank == world - 1:
        how()
    with reporting(errors, f"rank {rank} (inside `reporting`)"):
        how()


def test_clean_workers_pass():
    spawn(_clean, 2)


def test_every_kind_of_worker_failure_fails_the_test():
    """One spawn for all four kinds (a spawn costs seconds); each rank's exit status and report are checked
    on their own, so each kind alone fails the call."""
    world = len(FAILURES)
    with pytest.raises(AssertionError) as info:
        spawn(_each_rank_fails_its_own_way, world)
    message = str(info.value)
    for rank, (how, shown) in enumerate(FAILURES):
        where = "outside `reporting`" if rank == world - 1 else "inside `reporting`"
        assert f"rank {rank} exited with status 1" in message, message
        report = message.split(f"rank {rank} ({where}): Traceback")[1].split("\nrank ")[0]
        assert f"in {how.__name__}" in report and shown in report, message  # the traceback reaches the failing line


def _hang(rank, world, init_file, pid_dir, errors):
    Path(pid_dir, str(rank)).write_text(str(os.getpid()))
    time.sleep(3600)


def test_a_hung_worker_is_killed_at_the_join_bound(tmp_path):
    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"ranks \[0, 1\] still ran 15 s after the start .*hung, killed"):
        spawn(_hang, 2, str(tmp_path), join_timeout_s=15)
    assert time.monotonic() - start < 40
    for f in tmp_path.iterdir():
        with pytest.raises(ProcessLookupError):
            os.kill(int(f.read_text()), 0)


def _stuck_collective(rank, world, init_file, errors):
    _init(rank, world, init_file)
    with reporting(errors, f"rank {rank}"):
        group = dist.new_group([0, 1])  # timeout=None: the harness's default bounds subgroups too
        if rank == 0:
            dist.all_reduce(torch.ones(1), group=group)  # rank 1 never joins
        else:
            time.sleep(6)


def test_a_collective_waiting_on_a_stuck_peer_times_out():
    """Rank 0's all-reduce fails after pg_timeout_s; the join bound (much longer) is not what ends it."""
    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"(?s)rank 0 exited with status 1\nrank 0: Traceback.*all_reduce.*"
                                             r"Timed out waiting 3000ms"):
        spawn(_stuck_collective, 2, pg_timeout_s=3, join_timeout_s=120)
    assert time.monotonic() - start < 60


EXTENSION_TESTS = ["tests/test_layout.py::test_tp1_is_natural_layout",
                   "tests/test_segment_copy.py::test_empty_table_is_a_no_op",
                   "tests/test_sharded.py::test_without_torch_distributed_one_rank_alone"]


def _run_without_extension(allow: bool) -> subprocess.CompletedProcess:
    """A test of each module that needs the extension, in a fresh pytest whose `import hybridengine._C` fails
    (as in a checkout where the build failed)."""
    blocker = ("import sys, importlib.abc\n"
               "class NoExtension(importlib.abc.MetaPathFinder):\n"
               "    def find_spec(self, name, path, target=None):\n"
               "        if name == 'hybridengine._C':\n"
               "            raise ImportError('blocked by test_harness: no extension')\n"
               "sys.meta_path.insert(0, NoExtension())\n"
               "import pytest\n"
               "sys.exit(pytest.main(sys.argv[1:]))\n")
    env = {k: v for k, v in os.environ.items() if k != "HE_ALLOW_NO_EXTENSION"}
    if allow:
        env["HE_ALLOW_NO_EXTENSION"] = "1"
    return subprocess.run([sys.executable, "-c", blocker, "-q", "-rs", "-p", "no:cacheprovider", *EXTENSION_TESTS],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


def test_missing_extension_fails_unless_opted_out():
    run = _run_without_extension(allow=False)
    assert run.returncode == 1 and "3 errors" in run.stdout, run.stdout + run.stderr
    assert run.stdout.count("hybridengine._C is not built (blocked by test_harness") == 3, run.stdout
    assert "or set HE_ALLOW_NO_EXTENSION=1 to skip" in run.stdout, run.stdout
    run = _run_without_extension(allow=True)
    assert run.returncode == 0 and "3 skipped" in run.stdout, run.stdout + run.stderr
    assert "HE_ALLOW_NO_EXTENSION=1: hybridengine._C is not built (blocked by test_harness" in run.stdout, run.stdout
