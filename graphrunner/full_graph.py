"""Full CUDA graphs for decode steps: one graph per key (batch bucket, query length 1, model extra key).

Lifecycle of one `DecodeGraph` (seed):
    model-owned static buffers (made once per runner lifetime, shared by every decode graph; the per-step fields a
    model declares as its `decode_staging` are views of the runner-owned `staging.HostStaging`)
    -> fill buffers + redirect the context (`update_context`) -> eager warm-up
    -> capture the complete model call into the shared pool on the rank stream
    -> keep the output buffer -> later: fill, redirect, replay, slice.
The first capture returns the WARM-UP output: capture executes nothing, and replaying
right after the warm-up would apply a stateful model's state update twice.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from .capture import KeepOriginalErrorGraph
from .errors import GraphCaptureError
from .forward_args import model_kwargs, scalar_constants
from .staging import HostStaging, staging_for
from .step import ForwardStep, GraphMeta


@dataclass(frozen=True)
class DecodeGraphKey:
    batch: int
    query_len: int = 1
    extra: tuple = ()


def decode_graph_key(model: Any, step: ForwardStep, padded_batch: int) -> DecodeGraphKey:
    """Key of the graph serving `step` at `padded_batch` (scalar extras are part of it: they are
    baked into the captured call)."""
    constants = scalar_constants(step.extras) or ()
    return DecodeGraphKey(padded_batch, 1, tuple(model.graph_extra_key(step)) + constants)


class DecodeGraph:
    """One captured decode graph and its output buffer (graph-pool storage it owns)."""

    __slots__ = ("key", "graph", "output", "pool_bytes", "capture_seconds")

    def __init__(self, key: DecodeGraphKey, graph: Any, output: torch.Tensor, pool_bytes: int, seconds: float):
        self.key = key
        self.graph = graph
        self.output = output
        self.pool_bytes = pool_bytes
        self.capture_seconds = seconds


class FullGraphRunner:
    """Owns every decode graph of one runner, the model's static buffers, their host staging (when the model
    declares a `decode_staging` spec) and the shared graph pool."""

    def __init__(self, model: Any, graph_meta: GraphMeta, stream: Any):
        self.model = model
        self.graph_meta = graph_meta
        self.device = graph_meta.device
        self.stream = stream
        self._graphs: dict[DecodeGraphKey, DecodeGraph] = {}
        self._buffers: Optional[dict[str, torch.Tensor]] = None
        self._staging: Optional[HostStaging] = None
        self._pool: Optional[Any] = None

    # ---- queries
    def has_graph(self, key: DecodeGraphKey) -> bool:
        return key in self._graphs

    def keys(self) -> list[DecodeGraphKey]:
        return list(self._graphs)

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    @property
    def pool_bytes(self) -> int:
        return sum(g.pool_bytes for g in self._graphs.values())

    @property
    def buffer_bytes(self) -> int:
        if not self._buffers:
            return 0
        storages = {}  # buffers may be views of one staging tensor: count each device storage once
        if self._staging is not None:
            st = self._staging.tensor.untyped_storage()
            storages[st.data_ptr()] = st.nbytes()
        for b in self._buffers.values():
            if isinstance(b, torch.Tensor) and b.device.type == self.device.type:
                st = b.untyped_storage()
                storages[st.data_ptr()] = st.nbytes()
        return sum(storages.values())

    @property
    def staging(self) -> Optional[HostStaging]:
        """The host staging of the model's static buffers (None before the first capture, after `reset()`, or
        when the model declares no `decode_staging`)."""
        return self._staging

    def _ensure_buffers(self) -> dict[str, torch.Tensor]:
        if self._buffers is None:
            self._staging = staging_for(self.model, self.graph_meta)
            self._buffers = self.model.make_buffers(self.graph_meta, self._staging)
        return self._buffers

    def _host_staging(self) -> HostStaging:
        if self._staging is None:
            raise GraphCaptureError("armed decode replays need a model that declares a decode_staging spec")
        return self._staging

    # ---- start-up
    def capture(self, step: ForwardStep, padded_batch: int) -> tuple[DecodeGraphKey, torch.Tensor]:
        """Warm up and capture the graph for `step` at `padded_batch`; returns (key, warm-up output sliced).

        Runs on the current stream, which must be the rank's forward stream.
        """
        if padded_batch > self.graph_meta.max_batch_size or padded_batch < step.batch_size:
            raise GraphCaptureError(
                f"padded batch {padded_batch} must be in [{step.batch_size}, {self.graph_meta.max_batch_size}]"
            )
        key = decode_graph_key(self.model, step, padded_batch)
        if key in self._graphs:
            raise GraphCaptureError(f"decode graph {key} is already captured")
        t0 = time.perf_counter()
        buffers = self._ensure_buffers()
        self.model.fill_buffers(buffers, step, padded_batch)
        ctx = self.model.update_context(buffers, step, padded_batch)
        kwargs = model_kwargs(ctx)
        warm = self.model(**kwargs)  # one eager warm-up before each capture
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        reserved_before = torch.cuda.memory_reserved(self.device)
        graph = torch.cuda.CUDAGraph()
        try:
            with KeepOriginalErrorGraph(graph, pool=self._pool, stream=self.stream, capture_error_mode="thread_local"):
                output = self.model(**kwargs)
        except BaseException:
            # a failed capture may leave its pool id unusable: later captures get a fresh pool
            self._pool = None
            raise
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        pool_bytes = max(0, torch.cuda.memory_reserved(self.device) - reserved_before)
        self._graphs[key] = DecodeGraph(key, graph, output, pool_bytes, time.perf_counter() - t0)
        return key, self.model.get_outputs(warm, step.num_tokens)

    # ---- serving
    def replay(self, key: DecodeGraphKey, step: ForwardStep) -> torch.Tensor:
        """Fill the static buffers from the live step, redirect the context, replay, slice the output."""
        g = self._graphs[key]
        buffers = self._buffers
        self.model.fill_buffers(buffers, step, key.batch)
        self.model.update_context(buffers, step, key.batch)
        g.graph.replay()
        return self.model.get_outputs(g.output, step.num_tokens)

    def arm(self, key: DecodeGraphKey, gate: Callable[[], Any]) -> None:
        """Enqueue a replay of `key` before its step is known: once the previous transfer out of the host
        staging has run (`HostStaging.wait`), rows [0, bucket) of the mirror become padding rows, then `gate()`
        enqueues device work that holds the stream until the host opens it, then the staged transfer
        (`copy_prefix`) and the replay follow. Before opening, the caller writes the live step into the mirror
        (`stage_armed`); a gate opened without it replays padding rows, which write nothing. Needs a model that
        declares a `decode_staging` spec. Stream: the current one (the rank's forward stream)."""
        g = self._graphs[key]
        staging = self._host_staging()
        staging.wait()
        staging.pad_rows(0, key.batch)
        gate()
        staging.copy_prefix(key.batch)
        g.graph.replay()

    def stage_armed(self, key: DecodeGraphKey, ids: Any, num_history: Any, block_tables: Any,
                    block_size: int) -> None:
        """Write a live decode step, given as host arrays (token ids int64 `[n]`, cached tokens int32 `[n]`,
        block tables int32 `[n, W]`, validated), into the host staging of an armed replay of `key` whose gate
        is still closed (`HostStaging.stage_decode`: the model's declared `stage_decode`, then padding rows up
        to the bucket). Host only: the transfer is already enqueued behind the gate."""
        self._host_staging().stage_decode(ids, num_history, block_tables, block_size, key.batch)

    def output_of(self, batch: int) -> Optional[torch.Tensor]:
        """The captured output buffer of the graph of bucket `batch` (graph-pool storage, valid until `reset()`);
        None when there is none, or several (different model extras) and so no single answer."""
        found = [g for k, g in self._graphs.items() if k.batch == batch]
        return found[0].output if len(found) == 1 else None

    def pool(self) -> Any:
        """The graph pool every decode graph (and the runner's decode epilogues) is captured into."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return self._pool

    # ---- invalidation
    def reset(self) -> None:
        """Drop every graph, the static buffers, their host staging and the shared pool (caller synchronizes
        first)."""
        self._graphs.clear()
        self._buffers = None
        self._staging = None
        self._pool = None

