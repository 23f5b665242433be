"""Warm-up choice of the decode projection fallbacks (`projection_choice`, step 2): for every (N, K) of the loaded
model and every row class the tuning table lacks, the faster of cuBLAS and the safe generic config, from the disk
cache (`projection_choice.resolve`) or measured here.

A measurement captures each candidate in a CUDA graph of at least `_MIN_CALLS` calls at the row class's largest M,
cycling over enough weight copies that L2 never holds the weight (as `bench.gemm_tune` measures), then times the
two graphs with CUDA events in alternating rounds and keeps each one's best. Called outside capture on the forward
stream (`Qwen3ForCausalLM.warm_up_kernels`). Cost per measured (N, K, class): ~10-300 ms of replays, a first compile
of its safe config on a cold Triton cache, and up to max(256 MiB, one weight) of weight copies, freed (and the
allocator's cache emptied) on return. Nothing is measured for a cached entry.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Callable, Iterable, Optional

import torch
import torch.nn.functional as F
import triton

from graphrunner.capture import KeepOriginalErrorGraph
from modeling.ops import projection_choice as pc
from modeling.ops import triton_gemm, triton_gemv

_COPY_BYTES = 256 << 20  # weight bytes cycled through per graph: several times L2
_MAX_COPIES = 64
_MIN_CALLS = 16  # calls per captured graph: max(this, copies)
_ROUNDS = 3  # alternating timing rounds per candidate; the best one counts


class ProjectionMeasureError(RuntimeError):
    """The measurement was asked for inside a CUDA graph capture."""


def _capture(fn: Callable[[int], torch.Tensor], calls: int) -> torch.cuda.CUDAGraph:
    """A graph of fn(0) .. fn(calls - 1), after one eager call (lazy state: split-K counters, compiles); captured on
    torch's side stream, thread-local like the runner's captures (a failed one raises its own error)."""
    fn(0)
    graph = torch.cuda.CUDAGraph()
    with KeepOriginalErrorGraph(graph, capture_error_mode="thread_local"):
        for i in range(calls):
            fn(i)
    graph.replay()
    return graph


def _seconds_per_call(graph: torch.cuda.CUDAGraph, calls: int, replays: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / (replays * calls)


def time_candidates(n: int, k: int, mc: int, cfg: pc.Config, device: torch.device, dtype: torch.dtype,
                    pdl: int = 0, replays: int = 10) -> tuple[float, float]:
    """(cuBLAS, skinny GEMM with `cfg` at PDL mode `pdl`) seconds per call of x `[mc, k]` @ w `[n, k]`^T in
    `dtype` (bf16 / fp16) on `device`, the current stream, outside capture."""
    copies = max(1, min(_MAX_COPIES, math.ceil(_COPY_BYTES / (n * k * 2))))
    calls = max(_MIN_CALLS, copies)
    g = torch.Generator(device=device).manual_seed(n * 31 + k)
    ws = [torch.randn(n, k, device=device, dtype=dtype, generator=g).mul_(k ** -0.5) for _ in range(copies)]
    x = torch.randn(mc, k, device=device, dtype=dtype, generator=g)
    gemm_cfg = triton_gemm.GemmConfig(*cfg)
    graphs = (_capture(lambda i: F.linear(x, ws[i % copies]), calls),
              _capture(lambda i: triton_gemm.linear_with_config(x, ws[i % copies], gemm_cfg, pdl=pdl), calls))
    best = [math.inf, math.inf]
    for _ in range(_ROUNDS):
        for j, graph in enumerate(graphs):
            best[j] = min(best[j], _seconds_per_call(graph, calls, replays))
    return best[0], best[1]


def measure_projection_fallbacks(shapes: Iterable[tuple[int, int]], device: torch.device,
                                 dtype: torch.dtype = torch.bfloat16, *, gemv: bool = True, pdl: int = 0,
                                 cache_path: Optional[Path] = None, replays: int = 10) -> dict:
    """Choose and record (`projection_choice.resolve`) the fallback of every (N, K) in `shapes` x
    measured row class (`projection_choice.needs_choice`: not 32 or 64) not in the table nor chosen here
    yet, skipping row class 1 where the GEMV serves (`gemv`: the bound `KernelOptions.gemv`, weights up
    to GEMV_MAX_N rows). `pdl`: the PDL mode the skinny GEMM launches with;
    `cache_path` None: `projection_choice.default_cache_path()`. Returns {(N, K, row class): Choice} of what it
    chose now; {} off CUDA or for dtypes the skinny GEMM lacks (it takes bf16 / fp16 only)."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return {}
    if torch.cuda.is_current_stream_capturing():
        raise ProjectionMeasureError("choose the projection fallbacks before any CUDA graph capture")
    index = device.index if device.index is not None else torch.cuda.current_device()
    sms = triton_gemm._sm_count(index)
    wanted = [(n, k, mc) for n, k in shapes for mc in pc.ROW_CLASSES
              if not (mc == 1 and gemv and n <= triton_gemv.GEMV_MAX_N)]
    context = pc.MeasureContext(gpu=torch.cuda.get_device_name(index), torch=torch.__version__,
                                cuda=str(torch.version.cuda), triton=triton.__version__,
                                dtype=str(dtype).removeprefix("torch."), pdl=pdl)
    dev = torch.device("cuda", index)

    def safe(n: int, k: int, mc: int) -> pc.Config:
        c = triton_gemm.default_config(n, k, mc, sms)
        return (c.block_n, c.block_k, c.split_k, c.num_warps, c.num_stages)

    def measure(n: int, k: int, mc: int, cfg: pc.Config) -> tuple[float, float]:
        return time_candidates(n, k, mc, cfg, dev, dtype, pdl, replays)

    with torch.cuda.device(index):
        done = pc.resolve(wanted, index, context, triton_gemm._CONFIGS, safe, measure,
                          cache_path if cache_path is not None else pc.default_cache_path())
        if any(c.source == "measured" for c in done.values()):
            torch.cuda.empty_cache()  # the weight copies' blocks back to the driver, not kept for eager use
    return done
