"""Time to first token of long prompts through the engine with the cuDNN prefill on and off, side by side.

    python -m bench.prefill_sdpa_ab --model qwen3-0.6b --tokens 4096,8192,16384 --rounds 2

Each round starts one engine (local executor, `graphline serve`'s defaults: chunked prefill at 4096 tokens a step,
so a long prompt runs as chunks after history through the piecewise plans) with `GRAPHLINE_PREFILL_SDPA=1` and one
with `=0` (`KernelOptions.prefill_sdpa`, read when the executor is built), in alternating order, and measures the
median time to first token of one greedy request at a time (`bench.model_sweep.engine_runs`). Prints the medians
over rounds and on / off.
"""
from __future__ import annotations

import argparse
import os
import statistics

from bench.common import machine, write_json
from bench.model_sweep import engine_runs
from modeling.ops.options import PREFILL_SDPA_ENV


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--tokens", default="4096,8192,16384")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    tokens = tuple(int(t) for t in args.tokens.split(",") if t)
    before = os.environ.get(PREFILL_SDPA_ENV)
    times: dict[str, dict[int, list[float]]] = {"1": {t: [] for t in tokens}, "0": {t: [] for t in tokens}}
    try:
        for r in range(args.rounds):
            for mode in (("1", "0") if r % 2 == 0 else ("0", "1")):
                os.environ[PREFILL_SDPA_ENV] = mode
                for row in engine_runs(args.model, [], 512, 1, tokens, repeats=args.repeats)["ttft"]:
                    times[mode][row["tokens"]].append(row["ttft_s"])
                    print(f"round {r} {PREFILL_SDPA_ENV}={mode} {row['tokens']:6d} tokens: "
                          f"{row['ttft_s'] * 1e3:9.2f} ms", flush=True)
    finally:
        if before is None:
            os.environ.pop(PREFILL_SDPA_ENV, None)
        else:
            os.environ[PREFILL_SDPA_ENV] = before
    print(f"# {machine()} | {args.model} | median TTFT over {args.rounds} rounds")
    print(f"{'tokens':>7} {'cuDNN ms':>9} {'paged ms':>9} {'on / off':>8}")
    rows = []
    for t in tokens:
        on, off = statistics.median(times["1"][t]), statistics.median(times["0"][t])
        rows.append({"tokens": t, "on_s": on, "off_s": off, "ratio": on / off, "rounds": {"on": times["1"][t],
                                                                                        "off": times["0"][t]}})
        print(f"{t:7d} {on * 1e3:9.2f} {off * 1e3:9.2f} {on / off:8.3f}")
    write_json(args.out, {"machine": machine(), "args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
