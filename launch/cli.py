"""The `graphline` command line. Subcommands register themselves in `COMMANDS`."""
from __future__ import annotations

import argparse
import sys
from typing import Callable, Optional, Sequence

from launch.demo import add_demo_parser

COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [add_demo_parser]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="graphline", description="graphline: Ray-actor LLM execution with CUDA graphs")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in COMMANDS:
        add(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
