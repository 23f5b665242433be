"""Programmatic dependent launch (`modeling.ops.pdl`) modes side by side in one process on one GPU.

One rank runtime of the same model per mode is built in this process, its kernels captured with
`KernelOptions(pdl=<mode>)` (`GRAPHLINE_PDL`; 0: off; 1: the next kernel starts once this one passed its wait; early: once this one
is resident); then the rank's synchronous decode step (inputs in, next tokens on the host) is timed on each in
turn, in rounds, at each batch (`bench.decode_ab`). The tokens must be identical (the kernels' arithmetic does
not change). Prints median ms per step and each mode's ratio to off.

    python -m bench.pdl_bench --model qwen3-0.6b --batches 1,8,64 --context 128
"""
from __future__ import annotations

import argparse

import torch

from bench.decode_ab import add_step_args, run
from modeling.ops.options import PDL_ENV
from modeling.ops.pdl import pdl_supported


def main() -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default="0,1,early")
    add_step_args(ap, "1,8,64")
    args = ap.parse_args()
    modes = args.modes.split(",")
    if modes[0] != "0":
        raise SystemExit("--modes must start with 0 (the baseline)")
    if not pdl_supported(torch.device("cuda", 0)):
        raise SystemExit("PDL is not available here (needs sm_90+ and a Triton with launch_pdl)")

    def differ(label: str, batch: int) -> None:
        raise SystemExit(f"batch {batch}: tokens differ with PDL {label}")

    return run(args, [(m, {PDL_ENV: m}) for m in modes], differ)


if __name__ == "__main__":
    main()
