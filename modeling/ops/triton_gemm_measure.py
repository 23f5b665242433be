"""Warm-up choice of the decode projection fallbacks (`projection_choice`, step 2): for every (N, K) of the loaded
model and every row class the tuning table lacks, the faster of cuBLAS and the safe generic config, from the disk
cache (`projection_choice.resolve`) or measured here, each in the form the model runs it (`measured_form`): a
projection whose residual add + RMSNorm the skinny GEMM fuses is timed with them on both sides, so a config that
wins as a bare GEMM but loses with its epilogue is not chosen.

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
from typing import Callable, Iterable, Mapping, Optional

import torch
import torch.nn.functional as F
import triton

from graphrunner.capture import KeepOriginalErrorGraph
from modeling.ops import projection_choice as pc
from modeling.ops import triton_fused, triton_gemm, triton_gemv

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


def measured_form(form: str, n: int, mc: int) -> str:
    """The form a projection of `form` (`projection_choice.FORMS`) with n output columns is measured in at row
    class mc: its residual add + RMSNorm only where `triton_gemm.linear_add_rms_norm` would fuse them
    (`triton_gemm.fuses_norm`); elsewhere both candidates run the same `add_rms_norm` after the GEMM, which is
    left out."""
    if form.endswith("add_norm") and not triton_gemm.fuses_norm(mc, n):
        return "gated" if form.startswith("gated") else "plain"
    return form


def time_candidates(n: int, k: int, mc: int, cfg: pc.Config, device: torch.device, dtype: torch.dtype,
                    pdl: int = 0, replays: int = 10, form: str = "plain") -> tuple[float, float]:
    """(cuBLAS, skinny GEMM with `cfg` at PDL mode `pdl`) seconds per call of x `[mc, k]` @ w `[n, k]`^T in
    `dtype` (bf16 / fp16) on `device`, the current stream, outside capture, in `form` as the model runs it
    (`measured_form`): "gated" x is `[mc, 2k]` (gate, up) and cuBLAS runs after `silu_and_mul`, the skinny GEMM with
    its SiLU-gate prologue; "add_norm" adds a residual `[mc, n]` and RMSNorms the sum: `add_rms_norm` after
    cuBLAS, the skinny GEMM's fused epilogue (`linear_add_rms_norm_with_config`)."""
    if form not in pc.FORMS:
        raise ValueError(f"form {form!r}: not one of {pc.FORMS}")
    gated, norm = form.startswith("gated"), form.endswith("add_norm")
    copies = max(1, min(_MAX_COPIES, math.ceil(_COPY_BYTES / (n * k * 2))))
    calls = max(_MIN_CALLS, copies)
    g = torch.Generator(device=device).manual_seed(n * 31 + k)
    ws = [torch.randn(n, k, device=device, dtype=dtype, generator=g).mul_(k ** -0.5) for _ in range(copies)]
    x = torch.randn(mc, 2 * k if gated else k, device=device, dtype=dtype, generator=g)
    residual = torch.randn(mc, n, device=device, dtype=dtype, generator=g)
    norm_w = torch.rand(n, device=device, dtype=dtype, generator=g).add_(0.5)
    gemm_cfg = triton_gemm.GemmConfig(*cfg)

    def cublas(i: int):
        y = F.linear(triton_fused.silu_and_mul(x, pdl=pdl) if gated else x, ws[i % copies])
        return triton_fused.add_rms_norm(y, residual, norm_w, 1e-6, pdl=pdl) if norm else y

    def skinny(i: int):
        if norm:
            return triton_gemm.linear_add_rms_norm_with_config(x, ws[i % copies], gemm_cfg, residual, norm_w, 1e-6,
                                                               gated=gated, pdl=pdl)
        if gated:
            return triton_gemm.linear_with_config(x, ws[i % copies], gemm_cfg, gated=True, pdl=pdl)
        return triton_gemm.linear_with_config(x, ws[i % copies], gemm_cfg, pdl=pdl)

    graphs = (_capture(cublas, calls), _capture(skinny, calls))
    best = [math.inf, math.inf]
    for _ in range(_ROUNDS):
        for j, graph in enumerate(graphs):
            best[j] = min(best[j], _seconds_per_call(graph, calls, replays))
    return best[0], best[1]


def measure_projection_fallbacks(shapes: Iterable[tuple[int, int]], device: torch.device,
                                 dtype: torch.dtype = torch.bfloat16, *, gemv: int = triton_gemv.GEMV_DEFAULT_ROWS,
                                 pdl: int = 0,
                                 cache_path: Optional[Path] = None, replays: int = 10,
                                 forms: Optional[Mapping[tuple[int, int], str]] = None) -> dict:
    """Choose and record (`projection_choice.resolve`) the fallback of every (N, K) in `shapes` x
    measured row class (`projection_choice.needs_choice`: not 32 or 64) not in the table nor chosen here
    yet, skipping the row classes the GEMV serves whole (classes up to `gemv`, the bound
    `KernelOptions.gemv_max_rows()`; weights up to GEMV_MAX_N rows). `pdl`: the PDL mode the skinny GEMM launches
    with;
    `cache_path` None: `projection_choice.default_cache_path()`; `forms`: {(N, K): form} of the shapes the model
    runs in another form than "plain" (`projection_choice.FORMS`, measured as `measured_form` says). Returns
    {(N, K, row class): Choice} of what it chose now; {} off CUDA or for dtypes the skinny GEMM lacks (it takes
    bf16 / fp16 only)."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return {}
    if torch.cuda.is_current_stream_capturing():
        raise ProjectionMeasureError("choose the projection fallbacks before any CUDA graph capture")
    index = device.index if device.index is not None else torch.cuda.current_device()
    sms = triton_gemm._sm_count(index)
    wanted = [(n, k, mc) for n, k in shapes for mc in pc.ROW_CLASSES
              if not (mc <= gemv and n <= triton_gemv.GEMV_MAX_N)]
    context = pc.MeasureContext(gpu=torch.cuda.get_device_name(index), torch=torch.__version__,
                                cuda=str(torch.version.cuda), triton=triton.__version__,
                                dtype=str(dtype).removeprefix("torch."), pdl=pdl)
    dev = torch.device("cuda", index)

    def safe(n: int, k: int, mc: int) -> pc.Config:
        c = triton_gemm.default_config(n, k, mc, sms)
        return (c.block_n, c.block_k, c.split_k, c.num_warps, c.num_stages)

    def form_of(n: int, k: int, mc: int) -> str:
        return measured_form((forms or {}).get((n, k), "plain"), n, mc)

    def measure(n: int, k: int, mc: int, cfg: pc.Config) -> tuple[float, float]:
        return time_candidates(n, k, mc, cfg, dev, dtype, pdl, replays, form=form_of(n, k, mc))

    with torch.cuda.device(index):
        done = pc.resolve(wanted, index, context, triton_gemm._CONFIGS, safe, measure,
                          cache_path if cache_path is not None else pc.default_cache_path(), form_of)
        if any(c.source == "measured" for c in done.values()):
            torch.cuda.empty_cache()  # the weight copies' blocks back to the driver, not kept for eager use
    return done
