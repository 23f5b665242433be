"""Piecewise prefill side by side in one process: a MoE model's experts captured inside the graph pieces
(`KernelOptions.moe_in_pieces`, `GRAPHLINE_MOE_IN_PIECES=1`: where the routed-expert kernel serves them without an
EP dispatcher; the default) against the same experts as an eager boundary between pieces (`=0`).

    python -m bench.prefill_ab --model qwen3-30b-a3b --layers 8 --cases 512,2048,4096,8x256

A case `T` is one sequence of T new tokens; `SxT` is S sequences of T tokens each in one step (several prompts at
once, which the full prefill graphs, at most 4 sequences, leave to the piecewise plans). Two rank runtimes of the
same seeded random weights, one per side, both with this process's other `GRAPHLINE_*` kernel options; each case is
timed on both in alternating rounds through the runner (`rt.runner(step)`: the piecewise plan of the step's token
bucket). Prints the median device and wall ms per step, the ratio pieces / boundary and whether the two outputs
are bitwise equal.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics

import numpy as np
import torch

from actors.environment import options_from_environ
from actors.rank import RankRuntime, RuntimeConfig
from bench.common import machine, time_step, write_json
from bench.graph_bench import _prefill_step
from bench.model_sweep import _moe_blocks, preset_with_layers
from graphrunner.config import GraphRunnerConfig
from graphrunner.step import ForwardStep
from parallel.context import ParallelContext

SIDES = ("boundary", "pieces")


def parse_case(text: str) -> tuple[int, int]:
    """`T` -> (1, T); `SxT` -> (S, T)."""
    seqs, x, tokens = text.strip().rpartition("x")
    try:
        s, t = int(seqs if x else 1), int(tokens)
    except ValueError:
        raise SystemExit(f"case {text!r} is neither T nor SxT") from None
    if s < 1 or t < 1:
        raise SystemExit(f"case {text!r}: sequences and tokens must be >= 1")
    return s, t


def _runtime(model: str, side: str, cases: list[tuple[int, int]]) -> RankRuntime:
    """A rank runtime whose piecewise plans cover every case and whose KV cache holds the largest one; side
    "pieces" turns `moe_in_pieces` on over this process's kernel options, "boundary" turns it off."""
    max_tokens = max(s * t for s, t in cases)
    graph = GraphRunnerConfig(max_decode_batch=1, pcg_max_tokens=max_tokens)
    kernels = dataclasses.replace(options_from_environ().kernels, moe_in_pieces=side == "pieces")
    cfg = RuntimeConfig(model=model, device="cuda", graph=graph, max_model_len=max(4096, max_tokens + 64),
                        kernels=kernels)
    blocks = 2 + max(s * -(-t // cfg.block_size) for s, t in cases)
    cfg = dataclasses.replace(cfg, num_kv_blocks=blocks)
    rt = RankRuntime(cfg, ParallelContext(), torch.device("cuda", 0))
    rt.load_model()
    rt.allocate_kv_cache()
    rt.build_runner()
    rt.capture_all()
    return rt


def _step(rt: RankRuntime, seqs: int, tokens: int) -> ForwardStep:
    """S fresh sequences of T random tokens each (ids over the whole vocabulary), on distinct KV blocks."""
    ids = np.random.default_rng(seqs * 100003 + tokens).integers(1, rt.model_config.vocab_size, seqs * tokens)
    return _prefill_step(rt, tokens, seqs, ids)


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=8, help="keep the first N layers (two copies must fit)")
    ap.add_argument("--cases", default="512,2048,4096,8x256")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--iters", type=int, default=10, help="timed steps per round and side")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cases = [parse_case(c) for c in args.cases.split(",") if c]
    model = preset_with_layers(args.model, args.layers)
    sides = {side: _runtime(model, side, cases) for side in SIDES}
    if not _moe_blocks(sides["pieces"]):
        raise SystemExit(f"{args.model} has no MoE layers: both sides would be the same")
    dev = torch.device("cuda", 0)
    print(f"# {machine()} | {model} | piecewise prefill, ms per step (device / wall), {args.rounds} rounds x "
          f"{args.iters} steps per side; MoE eager steps per plan: " + ", ".join(
              f"{side} {sum(b.needs_eager_boundary() for b in _moe_blocks(rt))}" for side, rt in sides.items()))
    rows = []
    for s, t in cases:
        steps = {side: _step(rt, s, t) for side, rt in sides.items()}
        outs = {side: rt.runner(steps[side]).clone() for side, rt in sides.items()}
        equal = bool(torch.equal(outs["pieces"], outs["boundary"]))
        gpu: dict[str, list[float]] = {side: [] for side in SIDES}
        wall: dict[str, list[float]] = {side: [] for side in SIDES}
        for r in range(args.rounds):
            for side in (SIDES if r % 2 == 0 else SIDES[::-1]):
                rt = sides[side]
                m = time_step(lambda: rt.runner(steps[side]), dev, warmup=2, iters=args.iters)
                gpu[side].append(m["gpu_s"] * 1e3)
                wall[side].append(m["wall_s"] * 1e3)
        med = {side: (statistics.median(gpu[side]), statistics.median(wall[side])) for side in SIDES}
        paths = {side: rt.runner.stats.snapshot()["steps"] for side, rt in sides.items()}
        row = {"seqs": s, "tokens": t, "boundary_ms": med["boundary"], "pieces_ms": med["pieces"],
               "ratio": med["pieces"][0] / med["boundary"][0], "outputs_equal": equal, "paths": paths}
        rows.append(row)
        print(f"{s:3d} x {t:5d}: boundary {med['boundary'][0]:8.3f} / {med['boundary'][1]:8.3f}  pieces "
              f"{med['pieces'][0]:8.3f} / {med['pieces'][1]:8.3f}  pieces/boundary {row['ratio']:.3f}  "
              f"{'equal' if equal else 'OUTPUTS DIFFER'}", flush=True)
    write_json(args.out, {"machine": machine(), "model": model, "rows": rows})


if __name__ == "__main__":
    main()
