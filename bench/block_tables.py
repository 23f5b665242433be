"""Host time of a step's block tables (`engine.step_batch.build_batch`): from each sequence's cached int32 table
(`engine.step_batch.block_tables`, the engine's path) against from its Python list every step (the plain path), side
by side in one run, for decode batches and contexts (64-token blocks). CPU only.

    python -m bench.block_tables --batches 1,8,64,256 --contexts 512,2000,8000,32000
"""
from __future__ import annotations

import argparse
import timeit

import numpy as np

from engine.request import Request
from engine.sequence import Sequence
from engine.step_batch import block_tables


def tables_from_lists(seqs) -> np.ndarray:
    """The plain path: int32 `[B, W]` from the lists."""
    lists = [s.block_table for s in seqs]
    out = np.zeros((len(seqs), max(map(len, lists))), np.int32)
    for i, t in enumerate(lists):
        out[i, : len(t)] = t
    return out


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,8,64,256")
    p.add_argument("--contexts", default="512,2000,8000,32000")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)
    rows = []
    print(f"{'batch':>5} {'context':>7} {'blocks':>6} | {'lists us':>8} {'cached us':>9} | cached / lists")
    for b in (int(x) for x in args.batches.split(",")):
        for ctx in (int(x) for x in args.contexts.split(",")):
            seqs = []
            for _ in range(b):
                s = Sequence(Request.make([1], max_tokens=1))
                s.block_table = rng.integers(1, 1 << 20, ctx // args.block_size + 1).tolist()
                seqs.append(s)
            assert np.array_equal(tables_from_lists(seqs), block_tables(seqs))
            plain, cached = [], []
            for _ in range(args.rounds):  # interleaved
                plain.append(timeit.timeit(lambda: tables_from_lists(seqs), number=200) / 200 * 1e6)
                cached.append(timeit.timeit(lambda: block_tables(seqs), number=200) / 200 * 1e6)
            r = {"batch": b, "context": ctx, "lists_us": min(plain), "cached_us": min(cached)}
            rows.append(r)
            print(f"{b:5d} {ctx:7d} {len(seqs[0].block_table):6d} | {r['lists_us']:8.1f} {r['cached_us']:9.1f} | "
                  f"{r['cached_us'] / r['lists_us']:.2f}")
    return rows


if __name__ == "__main__":
    main()
