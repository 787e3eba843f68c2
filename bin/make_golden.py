"""Rewrite tests/golden/ppo_tiny_qwen2.json: the per-step losses of test_training's tiny deterministic run.

    .venv/bin/python bin/make_golden.py          # check, print old and new, write
    .venv/bin/python bin/make_golden.py --check  # check and print only

Run it only for a change that is meant to move the losses, and say why in the commit that carries
the new file. The run is `tests/test_training.py::golden_run` (the test replays the same one). Its
first step is checked against the independent reference (tests/_formulas.py over a plain forward
at the initial weights) before anything is written; a run that fails the check is not written.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # this checkout's package, whatever is installed
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # as tests/conftest.py: before any kernel import

import test_training  # noqa: E402  (needs tests/ on the path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="check and print, do not write")
    args = parser.parse_args()
    path = test_training.GOLDEN
    old = json.loads(path.read_text())["losses"] if path.exists() else None
    losses, first32, first64 = test_training.golden_run()
    test_training.check_first_step(losses[0], first32, first64)
    print(f"first step: {losses[0]!r}; fp32 reference {first32!r}, fp64 reference {first64!r}")
    for step, new in enumerate(losses):
        before = "-" if old is None or step >= len(old) else repr(old[step])
        print(f"step {step}: {before} -> {new!r}")
    if args.check:
        return 0
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps({"config": test_training.CFG, "losses": losses}, indent=1) + "\n")
    print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
