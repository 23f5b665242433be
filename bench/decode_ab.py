"""Kernel-level switches side by side in one process on one GPU: the rank's synchronous decode step under each.

One rank runtime of the same model per variant is built in this process, each with the kernel options its
variables give (a variant is `label:NAME=VALUE[;NAME=VALUE...]` over this process's environment, NAME one of the
option variables of `actors.environment`; the first is the baseline); then the rank's
synchronous decode step (inputs in, next tokens on the host) is timed on each in turn, in alternating rounds, at
each batch. Prints median ms per step, each variant's ratio to the baseline and whether its tokens equal the
baseline's (switches that change the arithmetic may flip near-tied greedy choices of random weights).

    python -m bench.decode_ab --variants "off:GRAPHLINE_GEMV=0" "gemv:GRAPHLINE_GEMV=1" --batches 1,2,64

Two assignments are not variables but tuning tables, installed while that variant's graphs are captured and taken
out after: `gemm_table=PATH` (a `bench.gemm_tune` JSON's entries for the skinny GEMM) and `gemv_table=PATH` (a
`bench.gemv_tune` JSON's winners for the decode GEMV); `decode_launch=WARPS,STAGES[,BLOCK_N[,SPLITS]]` sets the
decode attention's warps, pipeline stages (and tile, and split count) over `decode_config`'s choice. `--layers N`
keeps the first N layers of the model.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from typing import Callable, Iterator

import numpy as np
import torch

from actors.environment import OPTION_VARIABLES, child_environ, options_from_environ
from actors.rank import RankRuntime, RuntimeConfig
from bench.common import machine, write_json
from bench.graph_bench import _decode_batch
from graphrunner.config import GraphRunnerConfig
from parallel.context import ParallelContext


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    """`label:NAME=VALUE;NAME=VALUE` -> (label, {NAME: VALUE}); an empty assignment list is allowed."""
    label, _, assigns = text.partition(":")
    env = {}
    for item in filter(None, assigns.split(";")):
        name, eq, value = item.partition("=")
        if not eq or not name:
            raise SystemExit(f"variant {text!r}: {item!r} is not NAME=VALUE")
        if name.strip() not in OPTION_VARIABLES + TABLES:
            raise SystemExit(f"variant {text!r}: {name.strip()} is neither an option variable "
                             f"({', '.join(OPTION_VARIABLES)}) nor a table ({', '.join(TABLES)})")
        env[name.strip()] = value.strip()
    if not label:
        raise SystemExit(f"variant {text!r} has no label")
    return label, env


TABLES = ("gemm_table", "gemv_table", "decode_launch")


@contextlib.contextmanager
def installed_tables(env: dict[str, str]) -> Iterator[None]:
    """The variant's tuning tables (`TABLES`) in `triton_gemm` / `triton_gemv`, and its decode attention launch
    (`decode_launch=WARPS,STAGES[,BLOCK_N[,SPLITS]]` over `decode_config`'s choice) for the duration; restored after."""
    import dataclasses

    from modeling.ops import triton_decode, triton_gemm, triton_gemv

    chosen = triton_decode.decode_config
    if "decode_launch" in env:
        warps, stages, *rest = (int(x) for x in env["decode_launch"].split(","))
        over = {"num_warps": warps, "num_stages": stages, **dict(zip(("block_n", "num_splits"), rest))}
        triton_decode.decode_config = lambda *a: dataclasses.replace(chosen(*a), **over)

    saved = (dict(triton_gemm._CONFIGS), dict(triton_gemm._GATED_CONFIGS), dict(triton_gemv._CONFIGS))
    try:
        if "gemm_table" in env:
            from bench.gemm_tune import install_table

            install_table(env["gemm_table"])
        if "gemv_table" in env:
            from bench.gemv_tune import install_winners

            install_winners(env["gemv_table"])
        yield
    finally:
        triton_decode.decode_config = chosen
        for table, old in zip((triton_gemm._CONFIGS, triton_gemm._GATED_CONFIGS, triton_gemv._CONFIGS), saved):
            table.clear()
            table.update(old)


def _runtime(model: str, blocks: int, env: dict[str, str], max_batch: int, context: int = 128) -> RankRuntime:
    kernels = options_from_environ(child_environ(**{k: v for k, v in env.items() if k not in TABLES})).kernels
    graph = GraphRunnerConfig(max_decode_batch=max_batch, pcg_max_tokens=512)
    cfg = RuntimeConfig(model=model, device="cuda", num_kv_blocks=blocks, graph=graph, kernels=kernels,
                        max_model_len=max(4096, context + 64))
    rt = RankRuntime(cfg, ParallelContext(), torch.device("cuda", 0))
    with installed_tables(env):
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
def compare(variants: list[tuple[str, dict[str, str]]], model: str = "qwen3-0.6b", batches: tuple[int, ...] = (1,),
            context: int = 128, blocks: int = 2048, rounds: int = 10, steps: int = 100,
            on_tokens_differ: Callable[[str, int], None] | None = None, random_tokens: bool = False) -> dict:
    """Build one runtime per variant, time the decode step side by side; returns the JSON-ready result.
    `on_tokens_differ(label, batch)` is called where a variant's tokens differ from the baseline's (default:
    recorded only). random_tokens: each sequence's input token drawn at random (seeded), so that a MoE model's
    tokens route to different experts; default: token 7 everywhere, which routes every sequence alike."""
    labels = [label for label, _ in variants]
    sides = {label: _runtime(model, blocks, env, max(batches), context) for label, env in variants}
    base = labels[0]
    res: dict = {"machine": machine(), "model": model, "context": context, "random_tokens": random_tokens,
                 "variants": {label: env for label, env in variants}, "batches": {}}
    for b in batches:
        vocab = sides[base].model.config.vocab_size
        tokens = np.random.default_rng(b).integers(0, vocab, b) if random_tokens else None
        sbs = {k: _decode_batch(rt, b, context, tokens) for k, rt in sides.items()}
        toks = {k: np.asarray(rt.execute(sbs[k])) for k, rt in sides.items()}
        same = {k: bool(np.array_equal(toks[base], toks[k])) for k in labels[1:]}
        for k, ok in same.items():
            if not ok and on_tokens_differ is not None:
                on_tokens_differ(k, b)
        times: dict[str, list[float]] = {k: [] for k in labels}
        for r in range(rounds):
            for k in (labels if r % 2 == 0 else labels[::-1]):
                _time_steps(sides[k], sbs[k], 5)
                times[k] += _time_steps(sides[k], sbs[k], steps)
        med = {k: statistics.median(v) for k, v in times.items()}
        row = {f"{k}_ms": v for k, v in med.items()}
        row.update({f"{k}_ratio": med[k] / med[base] for k in labels[1:]})
        row.update({f"{k}_tokens_equal": v for k, v in same.items()})
        res["batches"][b] = row
        print(f"batch {b:4d}: " + "  ".join(f"{k} {med[k]:.3f} ms" for k in labels) + "  " +
              "  ".join(f"{k}/{base} {med[k] / med[base]:.3f}{'' if same[k] else ' (tokens differ)'}"
                        for k in labels[1:]), flush=True)
    return res


def add_step_args(ap: argparse.ArgumentParser, batches: str) -> None:
    """The options of a side-by-side decode-step comparison (`compare`'s keyword arguments and `--out`)."""
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--layers", type=int, default=None, help="keep the first N layers of the model")
    ap.add_argument("--batches", default=batches)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--blocks", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--steps", type=int, default=100, help="steps per round and side")
    ap.add_argument("--random-tokens", action="store_true",
                    help="a random input token per sequence (MoE: tokens route to different experts), not 7 for all")
    ap.add_argument("--out", default=None)


def run(args: argparse.Namespace, variants: list[tuple[str, dict[str, str]]],
        on_tokens_differ: Callable[[str, int], None] | None = None) -> dict:
    """`compare` with the options of `add_step_args`; writes `--out`."""
    from bench.model_sweep import preset_with_layers

    res = compare(variants, preset_with_layers(args.model, args.layers), tuple(int(b) for b in args.batches.split(",")),
                  args.context, args.blocks, args.rounds, args.steps, on_tokens_differ, args.random_tokens)
    if args.out:
        write_json(args.out, res)
    return res


def main() -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", nargs="+", required=True, help="label:NAME=VALUE;... (first: the baseline)")
    add_step_args(ap, "1,64")
    args = ap.parse_args()
    variants = [parse_variant(v) for v in args.variants]
    if len({label for label, _ in variants}) != len(variants):
        raise SystemExit("variant labels must differ")
    return run(args, variants)


if __name__ == "__main__":
    main()
