"""The `graphline` command line. Subcommands register themselves in `COMMANDS`.

A failure prints one line naming the cause and the fix (`launch.failures.explain`) and exits non-zero; the
full traceback goes to a log file whose path the line gives.
"""
from __future__ import annotations

import argparse
import sys
from typing import Callable, Optional, Sequence

from launch.bench import add_bench_parser
from launch.demo import add_demo_parser
from launch.generate import add_generate_parser
from launch.serve import add_serve_parser

COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    add_serve_parser, add_generate_parser, add_bench_parser, add_demo_parser,
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="graphline", description="graphline: Ray-actor LLM execution with CUDA graphs")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in COMMANDS:
        add(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    from launch.failures import explain, write_log
    from launch.options import LaunchError, prepare_process

    args = build_parser().parse_args(argv)
    try:
        prepare_process(args)
        return int(args.func(args) or 0)
    except LaunchError as exc:
        print(f"graphline {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # noqa: BLE001 - one line for the operator, the traceback in the log
        path = write_log(args.command, exc)
        where = f" (full traceback: {path})" if path else ""
        print(f"graphline {args.command}: error: {explain(exc)}{where}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
