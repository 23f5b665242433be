"""Helpers shared by the benchmarks: device copy bandwidth, step timing, a preset's projection shapes, weight copies."""
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


def preset_projections(name: str) -> dict[str, tuple[int, int]]:
    """The weight shapes (N rows, K) of preset `name`'s dense decode projections at TP=1: qkv, o_proj, lm_head, and
    for a dense MLP gate_up (gate and up rows stacked: 2 x intermediate) and down. MoE experts are not among them."""
    from modeling.config import PRESETS

    c = PRESETS[name]
    q, kv, h = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.hidden_size
    shapes = {"qkv": (q + 2 * kv, h), "o_proj": (h, q), "lm_head": (c.vocab_size, h)}
    if not c.num_experts:
        shapes.update(gate_up=(2 * c.intermediate_size, h), down=(h, c.intermediate_size))
    return shapes


def weight_copies(weight_bytes: int, min_bytes: int, max_copies: int) -> int:
    """How many copies of a weight a timing graph cycles through so L2 never holds it: enough for `min_bytes` in
    all, at least 2, at most `max_copies`."""
    return max(2, min(max_copies, -(-min_bytes // weight_bytes)))


def graph_replay_us(fn: Callable[[], object], replays: int = 10) -> float:
    """fn once eagerly, then captured in one CUDA graph; microseconds per replay of that graph."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(replays):
        g.replay()
    e.record()
    e.synchronize()
    return s.elapsed_time(e) * 1e3 / replays
