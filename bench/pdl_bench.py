"""Programmatic dependent launch (`modeling.ops.pdl`) modes side by side in one process on one GPU.

One rank runtime of the same model per mode is built in this process, its kernels captured with
`GRAPHLINE_PDL=<mode>` (0: off; 1: the next kernel starts once this one passed its wait; early: once this one
is resident); then the rank's synchronous decode step (inputs in, next tokens on the host) is timed on each in
turn, in rounds, at each batch. The tokens must be identical (the kernels' arithmetic does not change). Prints
median ms per step and each mode's ratio to off.

    python -m bench.pdl_bench --model qwen3-0.6b --batches 1,8,64 --context 128
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import torch

from actors.rank import RankRuntime, RuntimeConfig
from bench.common import machine, write_json
from bench.graph_bench import _decode_batch
from graphrunner.config import GraphRunnerConfig
from modeling.ops.pdl import PDL_ENV, pdl_enabled
from parallel.context import ParallelContext


def _runtime(args, mode: str, max_batch: int) -> RankRuntime:
    os.environ[PDL_ENV] = mode
    graph = GraphRunnerConfig(max_decode_batch=max_batch, pcg_max_tokens=512)
    cfg = RuntimeConfig(model=args.model, device="cuda", num_kv_blocks=args.blocks, graph=graph)
    rt = RankRuntime(cfg, ParallelContext(), torch.device("cuda", 0))
    rt.load_model()
    rt.allocate_kv_cache()
    rt.build_runner()
    rt.capture_all()
    return rt


def _time_steps(rt: RankRuntime, sb, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        rt.execute(sb)
        out.append((time.perf_counter() - t0) * 1e3)
    return out


@torch.inference_mode()
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
    batches = [int(b) for b in args.batches.split(",")]
    saved = os.environ.get(PDL_ENV)
    try:
        os.environ[PDL_ENV] = "1"
        if not pdl_enabled(torch.device("cuda", 0)):
            raise SystemExit("PDL is not available here (needs sm_90+ and a Triton with launch_pdl)")
        sides = {m: _runtime(args, m, max(batches)) for m in modes}
    finally:
        if saved is None:
            os.environ.pop(PDL_ENV, None)
        else:
            os.environ[PDL_ENV] = saved
    res: dict = {"machine": machine(), "model": args.model, "context": args.context, "batches": {}}
    for b in batches:
        sbs = {k: _decode_batch(rt, b, args.context) for k, rt in sides.items()}
        toks = {k: np.asarray(rt.execute(sbs[k])) for k, rt in sides.items()}
        for k in modes[1:]:
            if not np.array_equal(toks["0"], toks[k]):
                raise SystemExit(f"batch {b}: tokens differ with PDL {k}: {toks[k][:8]} vs {toks['0'][:8]}")
        times: dict[str, list[float]] = {k: [] for k in modes}
        for r in range(args.rounds):
            for k in (modes if r % 2 == 0 else modes[::-1]):
                _time_steps(sides[k], sbs[k], 5)
                times[k] += _time_steps(sides[k], sbs[k], args.steps)
        med = {k: statistics.median(v) for k, v in times.items()}
        res["batches"][b] = {f"{k}_ms": v for k, v in med.items()}
        res["batches"][b].update({f"{k}_ratio": med[k] / med["0"] for k in modes[1:]})
        print(f"batch {b:4d}: " + "  ".join(f"PDL {k} {med[k]:.3f} ms" for k in modes) + "  " +
              "  ".join(f"{k}/off {med[k] / med['0']:.3f}" for k in modes[1:]), flush=True)
    if args.out:
        write_json(args.out, res)
    return res


if __name__ == "__main__":
    main()
