"""Decode epilogues: small graphs the runner captures on a decode graph's output, per decode bucket.

The caller registers, before capture, a named epilogue: `fn(hidden, bucket) -> tuple[Tensor, ...]` over the
decode graph's output rows (`hidden` `[bucket, H]`, graph-pool storage) and the largest bucket it serves. Each
`capture(bucket, hidden)` (right after that bucket's decode graph) runs every fitting `fn` once eagerly, then
captures it into the decode graphs' pool. The runner stays model-blind: what an epilogue computes (an LM head,
a sampler) is the caller's; which graph runs and when it is released is the runner's.

Lifetime: graphs and outputs live until `reset()`; outputs are rewritten by every replay of their graph.
Stream: capture and replay run on the current stream, which must be the rank's forward stream.
"""
from __future__ import annotations

import time
from typing import Any, Callable, NamedTuple, Optional

import torch

from .capture import end_capture, end_capture_quietly
from .errors import GraphCaptureError

EpilogueFn = Callable[[torch.Tensor, int], tuple]


class EpilogueSpec(NamedTuple):
    name: str
    fn: EpilogueFn
    max_batch: int


class EpilogueGraph(NamedTuple):
    graph: Any
    outputs: tuple  # device tensors of the pool, `[bucket, ...]` each


class DecodeEpilogues:
    """The epilogue graphs of one runner, keyed by (bucket, name)."""

    def __init__(self, device: torch.device, pool: Callable[[], Any]):
        self.device = device
        self._pool = pool  # the decode graphs' pool handle (created on first use)
        self._specs: dict[str, EpilogueSpec] = {}
        self._graphs: dict[tuple[int, str], EpilogueGraph] = {}
        self.pool_bytes = 0
        self.capture_seconds = 0.0

    def register(self, name: str, fn: EpilogueFn, max_batch: int) -> None:
        """Add an epilogue for buckets up to `max_batch`; before the buckets are captured (a name is registered
        once; registrations survive `reset()`, graphs do not)."""
        if name in self._specs:
            raise GraphCaptureError(f"epilogue {name!r} is already registered")
        if self._graphs:
            raise GraphCaptureError("register epilogues before capturing decode graphs")
        self._specs[name] = EpilogueSpec(name, fn, max_batch)

    @property
    def names(self) -> list[str]:
        return list(self._specs)

    def capture(self, bucket: int, hidden: torch.Tensor) -> None:
        """Capture every registered epilogue serving `bucket` on `hidden` (`[bucket, H]`, the decode graph's
        output rows). One eager run each first (kernel compiles and allocator warm-up happen outside the capture)."""
        specs = [s for s in self._specs.values() if bucket <= s.max_batch and (bucket, s.name) not in self._graphs]
        if not specs:
            return
        t0 = time.perf_counter()
        for s in specs:
            s.fn(hidden, bucket)
        torch.cuda.synchronize(self.device)
        reserved = torch.cuda.memory_reserved(self.device)
        stream = torch.cuda.current_stream(self.device)
        for s in specs:
            graph = torch.cuda.CUDAGraph()
            # capture_begin/end directly: `torch.cuda.graph` would add a gc.collect() + empty_cache() per graph
            graph.capture_begin(pool=self._pool(), capture_error_mode="thread_local")
            try:
                outs = s.fn(hidden, bucket)
            except BaseException:
                end_capture_quietly(graph, self.device)
                raise
            end_capture(graph, self.device)
            self._graphs[(bucket, s.name)] = EpilogueGraph(graph, tuple(outs))
        stream.synchronize()
        self.pool_bytes += max(0, torch.cuda.memory_reserved(self.device) - reserved)
        self.capture_seconds += time.perf_counter() - t0

    def outputs(self, bucket: int, name: str) -> Optional[tuple]:
        g = self._graphs.get((bucket, name))
        return None if g is None else g.outputs

    def replay(self, bucket: int, name: str) -> Optional[tuple]:
        """Replay the epilogue of `bucket` on the current stream (after the bucket's decode graph); its outputs
        (views of the pool, valid until the next replay of the same graph), or None when it was not captured."""
        g = self._graphs.get((bucket, name))
        if g is None:
            return None
        g.graph.replay()
        return g.outputs

    def buckets(self) -> list[int]:
        return sorted({b for b, _ in self._graphs})

    def reset(self) -> None:
        """Drop every graph (registrations stay); the caller synchronizes first."""
        self._graphs.clear()
        self.pool_bytes = 0
        self.capture_seconds = 0.0
