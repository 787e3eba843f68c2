"""`python -m hybridengine_bench run --suite NAME --gpus N` | `python -m hybridengine_bench soak` |
`python -m hybridengine_bench report` | `python -m hybridengine_bench list`.

`run` with --gpus > 1 starts itself under torchrun (one process per GPU, `-m hybridengine_bench.worker`); all
processes share one run id, and rank 0 appends the rows.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from .common import RESULTS, new_run_id


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hybridengine_bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a suite and append its rows")
    run.add_argument("--suite", required=True, help="see `python -m hybridengine_bench list`")
    run.add_argument("--gpus", type=int, default=1, help="processes, one per GPU (default 1)")
    run.add_argument("--model", action="append", help="embedded model config; repeat for several "
                     "(default: tiny-qwen2 for smoke, else qwen2.5-1.5b)")
    run.add_argument("--scale", type=float, default=1.0, help="multiply repeat counts (0.3: a quick pass)")
    run.add_argument("--out", default=os.environ.get("HE_BENCH_RESULTS", str(RESULTS)),
                     help="rows file to append to "
                          "(default $HE_BENCH_RESULTS or hybridengine_bench/results/results.jsonl)")
    run.add_argument("--cpu", action="store_true", help="run on CPU even where CUDA is available")
    rep = sub.add_parser("report", help="report.md and the plots from the rows; refreshes the README's marked table")
    rep.add_argument("--rows", default=str(RESULTS))
    rep.add_argument("--out-dir", default=None, help="default: the rows file's folder")
    rep.add_argument("--readme", default=str(Path(__file__).resolve().parent.parent / "README.md"),
                     help="the README whose table between <!-- bench:begin --> and <!-- bench:end --> is rewritten")
    sub.add_parser("list", help="suites and their benches")
    sub.add_parser("soak", help="the GRPO loop for minutes on varying shapes, memory and step time per step "
                   "(see `python -m hybridengine_bench soak --help`)", add_help=False)
    return p


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "soak":  # its own options (hybridengine_bench/soak.py)
        from .soak import main as soak_main

        soak_main(argv[1:])
        return
    args = parser().parse_args(argv)
    if args.command == "list":
        from .worker import SUITES

        for name, benches in SUITES.items():
            print(f"{name:<14} {' '.join(benches)}")
        return
    if args.command == "report":
        from .report import report

        report(Path(args.rows), Path(args.out_dir) if args.out_dir else Path(args.rows).parent, Path(args.readme))
        return
    from .worker import SUITES

    if args.suite not in SUITES:
        raise SystemExit(f"unknown suite {args.suite!r}; known: {', '.join(SUITES)}")
    if args.gpus < 1:
        raise SystemExit(f"--gpus must be >= 1, got {args.gpus}")
    os.environ.setdefault("HE_BENCH_RUN_ID", new_run_id())
    if args.gpus > 1 and "LOCAL_RANK" not in os.environ:
        worker_args = ["--suite", args.suite, "--gpus", str(args.gpus), "--scale", str(args.scale), "--out", args.out,
                       *(f"--model={m}" for m in args.model or []), *(["--cpu"] if args.cpu else [])]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.gpus}",
               "-m", "hybridengine_bench.worker", *worker_args]
        raise SystemExit(subprocess.run(cmd, env=os.environ).returncode)
    from .worker import run_args

    run_args(args)

if __name__ == "__main__":
    main()
