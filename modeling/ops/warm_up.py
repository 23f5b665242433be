"""Compile Triton kernel variants side by side before serving.

A cold Triton cache costs about a second per kernel variant, partly outside the GIL (ptxas is a subprocess), so
compiles on several threads overlap in part (the measured gain: docs/benchmarks.md, seventh session, "Attention
compiles side by side"). `run_side_by_side` runs warm-up calls (each one launch) on worker threads bound to the
caller's CUDA device, current stream and inference mode: every launch still lands on that one stream, in some
order, so stream-ordered kernels (split-K and split-KV arrival counters) stay correct. `prime_kernel_caches` creates
each kernel's per-device cache entry on the calling thread first: two threads that met an unseen kernel together
could each build one and lose a compiled variant.
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from types import ModuleType
from typing import Any, Callable, Iterable, Sequence

import torch

def compile_threads(requested: int | None = None) -> int:
    """Threads warm-ups compile on: `requested` (`KernelOptions.compile_threads`, >= 1), else up to 8 of this
    host's cores."""
    if requested is None:
        return max(1, min(8, os.cpu_count() or 1))
    if requested < 1:
        raise ValueError(f"compile threads (GRAPHLINE_COMPILE_THREADS) must be >= 1, got {requested}")
    return requested


def prime_kernel_caches(modules: Iterable[ModuleType], device: torch.device) -> int:
    """Create the per-device cache entry of every Triton kernel defined in `modules` (compiles nothing); returns
    how many kernels it touched. A no-op for Triton versions without `JITFunction.device_caches`."""
    from triton.runtime.jit import JITFunction

    index = device.index if device.index is not None else torch.cuda.current_device()
    touched = 0
    for module in modules:
        for value in vars(module).values():
            caches = getattr(value, "device_caches", None) if isinstance(value, JITFunction) else None
            if caches is not None:
                caches[index]  # noqa: B018 - the defaultdict builds the entry on first access
                touched += 1
    return touched


def run_side_by_side(calls: Sequence[Callable[[], Any]], threads: int | None = None) -> None:
    """Run `calls` on up to `threads` worker threads (None: `compile_threads()`; 1: one after another here), each
    inside the caller's CUDA device, current stream and inference mode. Returns when all returned (their launches
    are enqueued, not finished); the first failure is raised after every call ended."""
    workers = min(len(calls), threads if threads is not None else compile_threads())
    if workers <= 1:
        for call in calls:
            call()
        return
    inference = torch.is_inference_mode_enabled()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        device = torch.cuda.current_device()
        stream = torch.cuda.current_stream(device)

        def bound(call: Callable[[], Any]) -> None:
            with torch.cuda.device(device), torch.cuda.stream(stream), torch.inference_mode(inference):
                call()
    else:  # no CUDA context on this thread: only the inference mode travels

        def bound(call: Callable[[], Any]) -> None:
            with torch.inference_mode(inference):
                call()

    with ThreadPoolExecutor(workers, thread_name_prefix="kernel-warm-up") as pool:
        futures = [pool.submit(bound, call) for call in calls]
    errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:
        raise errors[0]
