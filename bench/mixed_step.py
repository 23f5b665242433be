"""What a chunked-prefill step costs against its two halves, split and whole, in one rank, side by side in one run.

    python -m bench.mixed_step --model qwen3-0.6b                        # one GPU, the serving defaults
    python -m bench.mixed_step --model qwen3-0.6b --chunks 512,1024,1984 --decode-rows 64 --context 2000
    python -m bench.mixed_step --smoke                                   # CPU, qwen3-tiny: a check that it runs

For each chunk size T: the mixed step a chunked scheduler sends (`--decode-rows` B decode rows at `--context`
tokens of history, then one prompt chunk of T new tokens with no history, as `engine.chunking` orders them)
against the decode step of the B rows alone and the prefill step of the chunk alone, each through
`RankRuntime.execute` (the rank's own dispatch: decode graphs, prefill graphs, piecewise plans, eager) with the
serving defaults (`launch.options`). The mixed step runs twice: split into its decode and prefill halves (the
default, `RuntimeConfig.split_mixed_steps`) and whole (one step on the token bucket's plan). Reported: the
median wall time per step (host + device, waited for), the paths the runner took, and `mixed / (decode +
prefill)`: above 1, a mixed step costs the decode rows more than the chunk's own cost. Prints a table and writes
JSON (`--out`).
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from typing import Any, Optional

import numpy as np

from bench.common import machine, write_json


def _tables(rt: Any, rows: list[int]) -> list[list[int]]:
    """One block table per row, covering `rows[i]` tokens, of distinct blocks (wrapping when the cache is small:
    timing only)."""
    bs, usable = rt.cfg.block_size, rt.kv_cache.spec.num_blocks - 1
    out, nxt = [], 0
    for n in rows:
        need = -(-n // bs)
        out.append([1 + (b % usable) for b in range(nxt, nxt + need)])
        nxt += need
    return out


def step_batches(rt: Any, decode_rows: int, context: int, chunk: int, vocab: int, seed: int = 0) -> dict:
    """{"decode", "prefill", "mixed"}: `StepBatch`es of B greedy decode rows at `context`, one chunk of `chunk`
    prompt tokens, and both in one step (decode rows first)."""
    from actors.batch import StepBatch

    rng = np.random.default_rng(seed)
    ids = [[int(x)] for x in rng.integers(0, vocab, decode_rows)] + [[int(x) for x in rng.integers(0, vocab, chunk)]]
    hist = [context] * decode_rows + [0]
    tables = _tables(rt, [context + 1] * decode_rows + [chunk])

    def batch(lo: int, hi: int) -> StepBatch:
        return StepBatch.from_sequences(ids[lo:hi], hist[lo:hi], tables[lo:hi])

    b = decode_rows
    return {"decode": batch(0, b) if b else None, "prefill": batch(b, b + 1), "mixed": batch(0, b + 1)}


def time_batch(rt: Any, batch: Any, iters: int, warmup: int = 3) -> dict:
    """Median wall time of `rt.execute(batch)` (it waits for the tokens) and the path the runner took last."""
    for _ in range(warmup):
        rt.execute(batch)
    before = dict(rt.runner.stats.snapshot()["steps"])
    walls = []
    for _ in range(iters):
        t0 = time.perf_counter()
        rt.execute(batch)
        walls.append(time.perf_counter() - t0)
    after = rt.runner.stats.snapshot()["steps"]
    paths = sorted(k for k in after if after[k] != before.get(k, 0))
    return {"ms": round(1e3 * statistics.median(walls), 3), "paths": paths}


def main(argv: Optional[list[str]] = None) -> dict:
    from launch.options import add_model_args, build_executor, start_executor

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    add_model_args(p, executor_default="local")
    p.add_argument("--chunks", default="128,512,1024,1984", help="prompt chunk sizes (tokens), comma-separated")
    p.add_argument("--decode-rows", type=int, default=64)
    p.add_argument("--context", type=int, default=2000, help="history tokens of every decode row")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--smoke", action="store_true", help="CPU, qwen3-tiny, small sizes: a check that it runs")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    chunks = [int(x) for x in args.chunks.split(",") if x.strip()]
    if args.smoke:
        args.device = "cpu" if args.device == "auto" else args.device
        args.max_model_len = min(args.max_model_len or 256, 256)
        args.num_kv_blocks = args.num_kv_blocks or 160
        chunks, args.decode_rows, args.context, args.iters = [16, 48], 4, 60, 3
    if args.executor != "local":
        p.error("--executor: this bench times one rank in this process (local)")
    if args.decode_rows < 0 or args.context < 1 or not chunks or min(chunks) < 1:
        p.error("--decode-rows must be >= 0, --context and every chunk >= 1")
    args.no_progress = True
    executor, _ = build_executor(args)
    print(f"mixed_step: starting the local executor for {args.model} ...", file=sys.stderr, flush=True)
    start_executor(executor, args)
    rt = executor.runtime
    vocab = executor.model_config.vocab_size
    if args.context + 1 > executor.max_model_len or max(chunks) > executor.max_model_len:
        p.error(f"--context / --chunks exceed max_model_len {executor.max_model_len}")
    rows = []
    try:
        for t in chunks:
            b = step_batches(rt, args.decode_rows, args.context, t, vocab, seed=t)
            got = {name: time_batch(rt, x, args.iters) for name, x in b.items() if x is not None}
            split_cfg = rt.cfg
            rt.cfg = dataclasses.replace(split_cfg, split_mixed_steps=False)  # the same rank, the step whole
            try:
                got["whole"] = time_batch(rt, b["mixed"], args.iters)
            finally:
                rt.cfg = split_cfg
            dec = got["decode"]["ms"] if "decode" in got else 0.0
            row = {"chunk": t, **{f"{k}_ms": v["ms"] for k, v in got.items()},
                   **{f"{k}_paths": v["paths"] for k, v in got.items()},
                   "mixed_over_sum": round(got["mixed"]["ms"] / (dec + got["prefill"]["ms"]), 3),
                   "whole_over_sum": round(got["whole"]["ms"] / (dec + got["prefill"]["ms"]), 3)}
            rows.append(row)
            print(f"mixed_step: chunk {t}: {row}", file=sys.stderr, flush=True)
    finally:
        executor.shutdown()
    print(f"\nmixed_step  {args.model}  {args.decode_rows} decode rows at {args.context} tokens + one chunk")
    print(f"{'chunk':>6}  {'decode ms':>10}  {'prefill ms':>10}  {'split ms':>10}  {'whole ms':>10}  "
          f"{'split / sum':>11}  {'whole / sum':>11}  paths (split | whole)")
    for r in rows:
        print(f"{r['chunk']:>6}  {r.get('decode_ms', 0.0):>10}  {r['prefill_ms']:>10}  {r['mixed_ms']:>10}  "
              f"{r['whole_ms']:>10}  {r['mixed_over_sum']:>11}  {r['whole_over_sum']:>11}  "
              f"{','.join(r['mixed_paths'])} | {','.join(r['whole_paths'])}")
    result = {"model": args.model, "machine": machine(), "decode_rows": args.decode_rows, "context": args.context,
              "rows": rows}
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
