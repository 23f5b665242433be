"""Where a decode step's time goes on the pipe step path: driver, pipes, rank host work, device.

    python -m bench.step_trace --out artifacts/step_trace.json                  # qwen3-0.6b, GPUs
    python -m bench.step_trace --model qwen3-tiny --device cpu --steps 20        # CPU smoke check
    python -m bench.step_trace --batches "" --prefill 128,512,2048 --pcg-max-tokens 2048   # prefill steps
    python -m bench.step_trace --batches 1,64 --sampling greedy,t1_k50,greedy_lp5         # sampled decode rows

`--prefill T,...` also traces prefill steps: one new sequence of T prompt tokens (no history), the step that
yields a request's first token, through the same segments (the plan replay, attention boundaries and sampling
are inside `launch` / `wait`; `--profile` splits the rank's host part by function).

Starts the deployment with `DriverOptions(step_trace=True)`, so the driver's `PipeStepper` and every rank's step
loop record perf_counter timestamps (one clock on one host) and each rank times its forward stream
with CUDA events from before the launch to after the tokens' device-to-host copy. For strict steps
(`Coordinator.step`: send, wait, send the next) the median of each segment, in microseconds:

  driver_pre   step called -> every request written (validation, planning, encoding, writes)
  to_rank      request written -> the rank has read it (pipe wake-up and read)
  decode       request read -> decoded into the step's arguments
  launch       `RankSteps.launch` called -> returned (checks, host metadata, copies, graph launches); the trace's
               timing events are made between the two
  wait         launch returned -> the rank saw the tokens' event complete
  reply        event complete -> reply written (device-to-host result, encoding, write)
  to_driver    reply written -> the driver has read every reply
  driver_post  replies read -> step returned
  device       the forward stream's span (CUDA events; includes any gap where it waited for the host); 0
               for a step an armed replay took (`actors.armed`: enqueued before its request came, so
               `launch` is staging the step and opening the gate)
  armed_steps  the rank's count of steps armed replays took (a count, not microseconds)
  read_skew    (more than one rank) the last rank's read minus the first rank's read: how much later the last
               rank could start the step, which collectives inside the graph make every rank wait for
  r<i>_launch, r<i>_wait  rank i's own launch and wait (i > 0)

`host_exposed` = total - device: the host time in series with the device.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

from bench.common import write_json

SEGMENTS = ("driver_pre", "to_rank", "decode", "launch", "wait", "reply", "to_driver", "driver_post")


def trace_steps(coord: Any, batch: Any, steps: int, warmup: int) -> dict[str, float]:
    """Median microseconds per segment over `steps` strict steps (rank 0's records)."""
    for _ in range(warmup):
        coord.step([batch])
    coord._stepper.trace.clear()
    coord._ranks.call("step_trace", (True,), timeout_s=60, what="clear step trace")
    spans = []
    for _ in range(steps):
        t0 = time.perf_counter()
        coord.step([batch])
        spans.append((t0, time.perf_counter()))
    driver = list(coord._stepper.trace)[-steps:]
    ranks = coord._ranks.call("step_trace", (True,), timeout_s=60, what="read step trace")
    rank0 = ranks[0][-steps:]
    others = [recs[-steps:] for recs in ranks[1:]]
    extra = ("read_skew",) + tuple(f"r{i}_{k}" for i in range(1, len(ranks)) for k in ("launch", "wait")) \
        if others else ()
    rows: dict[str, list[float]] = {k: [] for k in SEGMENTS + ("device", "total", "host_exposed", "lane_steps",
                                                     "armed_steps") + extra}
    for j, ((t0, t1), (sent, got), r) in enumerate(zip(spans, driver, rank0)):
        seg = {"driver_pre": sent - t0, "to_rank": r["read"] - sent, "decode": r["decoded"] - r["read"],
               "launch": r["launched"] - r["call"],
               "wait": r["ready"] - r["launched"], "reply": r["written"] - r["ready"],
               "to_driver": got - r["written"], "driver_post": t1 - got, "total": t1 - t0}
        seg["device"] = r.get("device_s", 0.0)
        seg["lane_steps"] = r.get("lane_steps", 0.0) / 1e6  # reported as a count, not microseconds
        seg["armed_steps"] = r.get("armed_steps", 0.0) / 1e6
        seg["host_exposed"] = seg["total"] - seg["device"]
        if others:
            reads = [r["read"]] + [o[j]["read"] for o in others]
            seg["read_skew"] = max(reads) - min(reads)
            for i, o in enumerate(others, start=1):
                seg[f"r{i}_launch"] = o[j]["launched"] - o[j]["call"]
                seg[f"r{i}_wait"] = o[j]["ready"] - o[j]["launched"]
        for k, v in seg.items():
            rows[k].append(v)
    return {k: 1e6 * statistics.median(v) for k, v in rows.items()}


def prefill_batch(tokens: int, block_size: int, vocab: int) -> Any:
    """One sequence of `tokens` prompt tokens and no history (the step that yields its first token), greedy."""
    import numpy as np

    from actors.batch import StepBatch

    per = -(-(tokens + 1) // block_size)
    rng = np.random.default_rng(tokens)
    return StepBatch(token_ids=rng.integers(0, vocab, tokens, dtype=np.int64),
                     q_seqlens=np.array([tokens], np.int32), num_history=np.zeros(1, np.int32),
                     block_tables=np.arange(1, per + 1, dtype=np.int32)[None, :],
                     temperature=np.zeros(1, np.float32), top_k=np.zeros(1, np.int32),
                     top_p=np.ones(1, np.float32), seeds=np.full(1, -1, np.int64))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from actors.options import DriverOptions
    from bench.dist_bench import SAMPLING_MODES, add_armed_wait_arg, armed_waits, decode_batch, make_coordinator, \
        with_sampling

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--device", default="auto", help="auto (GPUs when the cluster has them) or cpu")
    p.add_argument("--tp", default="1", help="TP sizes to run (comma list)")
    p.add_argument("--batches", default="1,64", help="decode batches (comma list; empty for none)")
    p.add_argument("--sampling", default="greedy",
                   help="decode (and prefill) rows sampled as each of these modes in turn (comma list): " + ", ".join(SAMPLING_MODES))
    p.add_argument("--prefill", default="", help="prefill steps of these prompt lengths (comma list)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--max-decode-batch", type=int, default=64)
    p.add_argument("--pcg-max-tokens", type=int, default=512)
    p.add_argument("--prefill-graph-max-tokens", type=int, default=0,
                   help="full prefill graphs up to this many tokens (0 = off: prefill steps replay piecewise plans)")
    p.add_argument("--num-cpus", type=int, default=None)
    add_armed_wait_arg(p)
    p.add_argument("--profile", default=None, help="also cProfile each rank's step loop into PROFILE.rank<r>")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    driver = DriverOptions(step_trace=True, step_profile=os.path.abspath(args.profile) if args.profile else None)
    import ray

    from actors.startup import ensure_ray

    ensure_ray(None, args.num_cpus or (4 if args.device == "cpu" else None))
    res: dict[str, Any] = {"model": args.model, "args": vars(args), "runs": []}
    try:
        for tp, wait in ((int(x), w) for x in args.tp.split(",") for w in armed_waits(args, int(x))):
            coord = make_coordinator(args, tp, wait, driver)
            coord.start(progress=False)
            try:
                if coord.step_path != "pipe":
                    raise SystemExit(f"step path is {coord.step_path}, the trace needs the pipe path")
                vocab = coord.model_config.vocab_size
                armed = "" if wait is None else f" armed_wait_ms={wait:g}"
                for b, mode in ((int(x), m) for x in args.batches.split(",") if x for m in args.sampling.split(",")):
                    batch = with_sampling(decode_batch(b, args.context, coord.block_size, coord.num_kv_blocks, vocab),
                                          mode)
                    r = trace_steps(coord, batch, args.steps, args.warmup)
                    res["runs"].append({"tp": tp, "armed_wait_ms": wait, "batch": b, "sampling": mode, "us": r})
                    print(f"tp={tp}{armed} batch={b} {mode}: " + "  ".join(f"{k} {v:.1f}" for k, v in r.items()),
                          flush=True)
                for t, mode in ((int(x), m) for x in args.prefill.split(",") if x for m in args.sampling.split(",")):
                    batch = with_sampling(prefill_batch(t, coord.block_size, vocab), mode)
                    r = trace_steps(coord, batch, args.steps, args.warmup)
                    res["runs"].append({"tp": tp, "armed_wait_ms": wait, "prefill_tokens": t, "sampling": mode,
                                        "us": r})
                    print(f"tp={tp}{armed} prefill={t} {mode}: " + "  ".join(f"{k} {v:.1f}" for k, v in r.items()),
                          flush=True)
            finally:
                coord.shutdown()
    finally:
        ray.shutdown()
    write_json(args.out, res)
    return res


if __name__ == "__main__":
    main()
