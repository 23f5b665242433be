"""The `graphline` command line. Subcommands register themselves in `COMMANDS`."""
from __future__ import annotations

import argparse
import sys
from typing import Callable, Optional, Sequence

from launch.demo import add_demo_parser
from launch.generate import add_generate_parser
from launch.serve import add_serve_parser


def _serve_bench():
    """`bench/serve_bench.py` as a module: the `bench` package, else the file next to this checkout."""
    try:
        import bench.serve_bench as mod

        return mod
    except ImportError:
        import importlib.util
        from pathlib import Path

        path = Path(__file__).resolve().parent.parent / "bench" / "serve_bench.py"
        if not path.exists():
            return None
        spec = importlib.util.spec_from_file_location("graphline_serve_bench", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    """`graphline bench`: the serving benchmark of `bench/serve_bench.py` (same options)."""
    p = sub.add_parser("bench", help="serving benchmark: throughput and time per output token at 1/16/64 clients")
    mod = _serve_bench()
    if mod is None:
        p.set_defaults(func=lambda args: print("graphline bench: bench/serve_bench.py is not installed; run it from "
                                               "a checkout") or 2)
        return
    mod.add_arguments(p)
    p.set_defaults(func=mod.run)


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
    from launch.options import LaunchError

    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except LaunchError as exc:
        print(f"graphline {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
