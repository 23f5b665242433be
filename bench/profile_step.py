"""Where a step's time goes: device kernel table for a decode graph replay and a piecewise prefill
replay, and the host-side profile of the piecewise replay (Python functions by cumulative time).

    python -m bench.profile_step --model qwen3-0.6b --batch 1 --tokens 512
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from actors.rank import RankRuntime, RuntimeConfig
from bench.graph_bench import _decode_batch, _decode_step, _prefill_step
from graphrunner.config import GraphRunnerConfig
from parallel.context import ParallelContext


def _kernel_table(fn, iters: int = 10, rows: int = 25) -> str:
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
    args = ap.parse_args()
    graph = GraphRunnerConfig(max_decode_batch=max(8, args.batch), pcg_max_tokens=args.tokens, pcg_token_stride=512)
    cfg = RuntimeConfig(model=args.model, device="cuda", num_kv_blocks=1024, max_model_len=8192, graph=graph)
    rt = RankRuntime(cfg, ParallelContext(), torch.device("cuda", 0))
    rt.load_model()
    rt.allocate_kv_cache()
    rt.build_runner()
    rt.capture_all()
    sb = _decode_batch(rt, args.batch, args.context)
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
    d = _decode_step(rt, args.batch, args.context)
    print(f"## decode graph replay, batch {args.batch}, context {args.context} (10 steps)")
    print(_kernel_table(lambda: rt.runner(d)))
    p = _prefill_step(rt, args.tokens)
    print(f"## piecewise prefill replay, {args.tokens} tokens (10 steps)")
    print(_kernel_table(lambda: rt.runner(p)))
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
