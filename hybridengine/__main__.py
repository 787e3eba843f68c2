"""Command line: `hybridengine info` | `hybridengine grpo` | `hybridengine tool` (also `python -m hybridengine ...`)."""

from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="hybridengine", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="versions, extension ops, GPUs, and the implementation of each op")
    sub.add_parser("grpo", help="the example GRPO trainer (see `hybridengine grpo --help`)", add_help=False)
    sub.add_parser("tool", help="the tool-using example: multi-turn episodes through generate_async, trained by GRPO "
                                "(see `hybridengine tool --help`)", add_help=False)
    if argv is None:
        import sys

        argv = sys.argv[1:]
    if argv and argv[0] == "grpo":
        from hybridengine.examples.grpo import main as grpo_main

        grpo_main(argv[1:])
        return
    if argv and argv[0] == "tool":
        from hybridengine.examples.tool import main as tool_main

        tool_main(argv[1:])
        return
    parser.parse_args(argv)
    from hybridengine.info import info

    print(info())


if __name__ == "__main__":
    main()
