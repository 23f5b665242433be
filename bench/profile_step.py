"""Where a step's time goes: the timeline of a rank's decode step (host work before the graph launch,
the launch calls, kernels against the gaps between them, the tail to the token on the host), the
device kernel table for a decode graph replay and a piecewise prefill replay, and the host-side
profiles of the rank's decode path and the piecewise replay (Python functions by own time).

    python -m bench.profile_step --model qwen3-0.6b --batch 1 --tokens 512
    python -m bench.profile_step --model qwen3-30b-a3b --layers 8 --batch 1 --tokens 2048
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from actors.rank import RankRuntime, RuntimeConfig
from bench.graph_bench import _decode_batch, _decode_step, _prefill_step
from graphrunner.config import GraphRunnerConfig
from parallel.context import ParallelContext


def decode_timeline(fn, iters: int = 20) -> dict[str, float]:
    """Median microseconds per call of `fn` (one synchronous decode step) from a profiler trace: `host_pre`
    (call start to the first graph launch), `launch` (host time inside cudaGraphLaunch calls), `launch_to_gpu`
    (first launch start to first kernel start), `gpu_span` (first kernel start to last kernel end),
    `kernels` (sum of kernel durations), `gaps` (span minus kernels), `tail` (last kernel end to call end),
    `wall`, and `num_kernels`. The profiler instruments every node of a graph launch, which inflates `launch`
    and `launch_to_gpu` (~0.2-0.45 ms here against 7-25 us host time per replay without it, see
    `bench.launch_bench`); the kernel and gap figures are not affected."""
    import json
    import os
    import tempfile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(iters):
            with torch.profiler.record_function(f"timeline_step_{i}"):
                fn()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    steps = sorted((e for e in events if str(e.get("name", "")).startswith("timeline_step_") and e.get("ph") == "X"),
                   key=lambda e: e["ts"])
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    launches = [e for e in events if e.get("name") == "cudaGraphLaunch" and e.get("ph") == "X"]
    rows: dict[str, list[float]] = {k: [] for k in ("host_pre", "launch", "launch_to_gpu", "gpu_span", "kernels",
                                                    "gaps", "tail", "wall", "num_kernels")}
    for i, st in enumerate(steps):
        t0, t1 = st["ts"], st["ts"] + st["dur"]
        nxt = steps[i + 1]["ts"] if i + 1 < len(steps) else float("inf")
        ks = [k for k in kernels if t0 <= k["ts"] < nxt]
        ls = sorted((e for e in launches if t0 <= e["ts"] < t1), key=lambda e: e["ts"])
        if not ks or not ls:
            continue
        first, last = ks[0]["ts"], max(k["ts"] + k["dur"] for k in ks)
        busy = sum(k["dur"] for k in ks)
        rows["host_pre"].append(ls[0]["ts"] - t0)
        rows["launch"].append(sum(e["dur"] for e in ls))
        rows["launch_to_gpu"].append(first - ls[0]["ts"])
        rows["gpu_span"].append(last - first)
        rows["kernels"].append(busy)
        rows["gaps"].append(last - first - busy)
        rows["tail"].append(t1 - last)
        rows["wall"].append(st["dur"])
        rows["num_kernels"].append(len(ks))
    return {k: statistics.median(v) for k, v in rows.items() if v}


def kernel_table(fn, iters: int = 10, rows: int = 25) -> str:
    """The profiler's kernel table of `iters` calls of `fn`, by device time."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=60)


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--layers", type=int, default=None, help="keep the first N layers of the model")
    ap.add_argument("--random-tokens", action="store_true",
                    help="a random input token per sequence (seeded by the batch, as `bench.decode_ab`), not 7 for all")
    args = ap.parse_args()
    graph = GraphRunnerConfig(max_decode_batch=max(8, args.batch), pcg_max_tokens=args.tokens, pcg_token_stride=512)
    from bench.model_sweep import preset_with_layers

    cfg = RuntimeConfig(model=preset_with_layers(args.model, args.layers), device="cuda", num_kv_blocks=1024,
                        max_model_len=8192, graph=graph)
    rt = RankRuntime(cfg, ParallelContext(), torch.device("cuda", 0))
    rt.load_model()
    rt.allocate_kv_cache()
    rt.build_runner()
    rt.capture_all()
    vocab = rt.model.config.vocab_size
    tokens = np.random.default_rng(args.batch).integers(0, vocab, args.batch) if args.random_tokens else None
    sb = _decode_batch(rt, args.batch, args.context, tokens)
    for _ in range(20):
        rt.execute(sb)
    times = []
    for _ in range(300):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        rt.execute(sb)
        times.append(time.perf_counter() - t0)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(300):
        rt.execute(sb)
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(22)
    print(f"## rank execute (decode fast path), batch {args.batch}: median {1e3 * statistics.median(times):.3f} ms; "
          f"host profile of 300 calls by own time")
    print(s.getvalue())
    tl = decode_timeline(lambda: rt.execute(sb))
    print(f"## rank decode step timeline, batch {args.batch} (median us per step, under the profiler)")
    print("  " + "  ".join(f"{k} {v:.1f}" for k, v in tl.items()))
    d = _decode_step(rt, args.batch, args.context, tokens)
    print(f"## decode graph replay, batch {args.batch}, context {args.context} (10 steps)")
    print(kernel_table(lambda: rt.runner(d)))
    p = _prefill_step(rt, args.tokens)
    print(f"## piecewise prefill replay, {args.tokens} tokens (10 steps)")
    print(kernel_table(lambda: rt.runner(p)))
    prof = cProfile.Profile()
    torch.cuda.synchronize()
    prof.enable()
    for _ in range(20):
        rt.runner(p)
    torch.cuda.synchronize()
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
    print(f"## host profile of 20 piecewise replays ({args.tokens} tokens), by own time")
    print(s.getvalue())


if __name__ == "__main__":
    main()
