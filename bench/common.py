"""Timing helpers shared by the benchmarks: device copy bandwidth and step timing."""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Callable

import torch


def copy_bandwidth(device: torch.device, nbytes: int = 2 << 30, iters: int = 10) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        b.copy_(a)
    end.record()
    end.synchronize()
    secs = start.elapsed_time(end) / 1e3 / iters
    del a, b
    return 2 * nbytes / secs


def time_step(fn: Callable[[], object], device: torch.device, warmup: int = 5, iters: int = 30) -> dict[str, float]:
    """Median wall time (host + device, synchronised each iteration) and median device time, in seconds."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize(device)
    walls, gpus = [], []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        s.record()
        fn()
        e.record()
        e.synchronize()
        walls.append(time.perf_counter() - t0)
        gpus.append(s.elapsed_time(e) / 1e3)
    return {"wall_s": statistics.median(walls), "gpu_s": statistics.median(gpus)}


def write_json(path: str | None, data: dict) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(data, indent=2, default=str))


def machine() -> str:
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}, torch {torch.__version__}"
    return f"CPU, torch {torch.__version__}"
