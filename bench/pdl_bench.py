"""Programmatic dependent launch (`modeling.ops.pdl`) modes side by side in one process on one GPU.

One rank runtime of the same model per mode is built in this process, its kernels captured with
`GRAPHLINE_PDL=<mode>` (0: off; 1: the next kernel starts once this one passed its wait; early: once this one
is resident); then the rank's synchronous decode step (inputs in, next tokens on the host) is timed on each in
turn, in rounds, at each batch (`bench.decode_ab`). The tokens must be identical (the kernels' arithmetic does
not change). Prints median ms per step and each mode's ratio to off.

    python -m bench.pdl_bench --model qwen3-0.6b --batches 1,8,64 --context 128
"""
from __future__ import annotations

import argparse
import os

import torch

from bench.common import write_json
from bench.decode_ab import compare
from modeling.ops.pdl import PDL_ENV, pdl_enabled


def main() -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--blocks", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--steps", type=int, default=100, help="steps per round and side")
    ap.add_argument("--modes", default="0,1,early")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    modes = args.modes.split(",")
    if modes[0] != "0":
        raise SystemExit("--modes must start with 0 (the baseline)")
    saved = os.environ.get(PDL_ENV)
    os.environ[PDL_ENV] = "1"
    try:
        if not pdl_enabled(torch.device("cuda", 0)):
            raise SystemExit("PDL is not available here (needs sm_90+ and a Triton with launch_pdl)")
    finally:
        if saved is None:
            os.environ.pop(PDL_ENV, None)
        else:
            os.environ[PDL_ENV] = saved

    def differ(label: str, batch: int) -> None:
        raise SystemExit(f"batch {batch}: tokens differ with PDL {label}")

    res = compare([(m, {PDL_ENV: m}) for m in modes], args.model, tuple(int(b) for b in args.batches.split(",")),
                  args.context, args.blocks, args.rounds, args.steps, on_tokens_differ=differ)
    if args.out:
        write_json(args.out, res)
    return res


if __name__ == "__main__":
    main()
