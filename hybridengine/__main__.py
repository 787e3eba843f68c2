"""Command line: `hybridengine info` | `hybridengine demo` | `hybridengine grpo` (also `python -m hybridengine ...`)."""

from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="hybridengine", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="versions, extension ops, GPUs, and the implementation of each op")
    demo = sub.add_parser("demo", help="the current main job: model vs transformers, layout round trip")
    demo.add_argument("--config", default="tiny-qwen2", help="embedded model config (default: tiny-qwen2)")
    demo.add_argument("--world-size", type=int, default=4, help="training ranks to lay out (default 4)")
    demo.add_argument("--tp", type=int, default=2, help="generation TP degree (default 2)")
    sub.add_parser("grpo", help="the example GRPO trainer (see `hybridengine grpo --help`)", add_help=False)
    if argv is None:
        import sys

        argv = sys.argv[1:]
    if argv and argv[0] == "grpo":
        from .examples.grpo import main as grpo_main

        grpo_main(argv[1:])
        return
    args = parser.parse_args(argv)
    if args.command == "info":
        from .info import info

        print(info())
    else:
        from .demo import run_demo

        run_demo(args.config, args.world_size, args.tp)


if __name__ == "__main__":
    main()
