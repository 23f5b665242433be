"""Full CUDA graphs for prefill steps: one graph per key (token bucket, sequence bucket, model extra key).

A prefill step of n tokens over B sequences pays, on the piecewise path, one eager attention boundary per layer
launched from Python. A full prefill graph replays the whole step, attention included, as one graph: the step's
tokens and metadata are copied into static buffers whose bucket prefix the graph reads by address, and the
attention kernels take every length from those buffers (the model's contract, `modeling.prefill_buffers`). A
captured graph bakes in no request-time shape: only the bucket (T tokens, S sequences) and the block-table width.

Model contract (model-blind here): `supports_prefill_graph(step)`, `make_prefill_buffers(T_max, S_max, W,
device)`, `fill_prefill_buffers(buffers, step, T, S)`, `prefill_context(buffers, step, T, S)` (a step whose
tensors are the bucket views) and `get_outputs(output, n)`.

Lifecycle (seed rules): captured at start-up only, largest first, into one pool shared by every prefill graph
(they replay one at a time on the rank stream; each keeps its output buffer); serving only replays; `reset()`
drops all. The first capture of a key returns the eager warm-up's output, as decode graphs do.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from .buckets import round_up_decode, round_up_tokens
from .capture import KeepOriginalErrorGraph
from .errors import GraphCaptureError
from .forward_args import model_kwargs, scalar_constants
from .step import ForwardStep, GraphMeta


@dataclass(frozen=True)
class PrefillGraphKey:
    tokens: int
    seqs: int
    extra: tuple = ()


class PrefillGraphRunner:
    """Owns every full prefill graph of one runner, their static buffers and their graph pool.

    token_buckets / seq_buckets: ascending (`GraphRunnerConfig.prefill_graph_buckets`). graph_meta: the runner's
    (device, block-table width). stream: the rank's forward stream.
    """

    def __init__(self, model: Any, token_buckets: Sequence[int], seq_buckets: Sequence[int], graph_meta: GraphMeta,
                 stream: Any):
        self.model = model
        self.token_buckets = tuple(token_buckets)
        self.seq_buckets = tuple(seq_buckets)
        self.graph_meta = graph_meta
        self.device = graph_meta.device
        self.stream = stream
        self._graphs: dict[PrefillGraphKey, tuple[Any, torch.Tensor, int]] = {}  # key -> (graph, output, pool bytes)
        self._buffers: Optional[dict[str, Any]] = None
        self._pool: Optional[Any] = None

    # ---- queries
    def _extra(self, step: ForwardStep) -> Optional[tuple]:
        """The key's extra part: the model's graph key, then the step's scalar extras (baked into the captured
        call); None when an extra is dynamic (no prefill graph serves the step)."""
        constants = scalar_constants(step.extras)
        return None if constants is None else tuple(self.model.graph_extra_key(step)) + constants

    def key_for(self, step: ForwardStep) -> Optional[PrefillGraphKey]:
        """The key that would serve `step` (None: too many tokens or sequences, or dynamic extras); whether it
        is captured is `has_graph`."""
        extra = self._extra(step)
        want = max(step.num_tokens, int(step.token_bucket_hint or 0))
        if extra is None or want > self.token_buckets[-1] or step.batch_size > self.seq_buckets[-1]:
            return None
        return PrefillGraphKey(round_up_tokens(want, self.token_buckets),
                               round_up_decode(step.batch_size, self.seq_buckets), extra)

    def has_graph(self, key: PrefillGraphKey) -> bool:
        return key in self._graphs

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    @property
    def pool_bytes(self) -> int:
        return sum(g[2] for g in self._graphs.values())

    @property
    def buffer_bytes(self) -> int:
        if not self._buffers:
            return 0
        return sum(b.numel() * b.element_size() for b in self._buffers.values() if isinstance(b, torch.Tensor))

    def _ensure_buffers(self) -> dict[str, Any]:
        if self._buffers is None:
            self._buffers = self.model.make_prefill_buffers(self.token_buckets[-1], self.seq_buckets[-1],
                                                            self.graph_meta.max_blocks_per_seq, self.device)
        return self._buffers

    # ---- start-up
    def capture(self, step: ForwardStep, tokens: int, seqs: int) -> tuple[PrefillGraphKey, torch.Tensor]:
        """Warm up and capture the graph of (`tokens`, `seqs`) on `step` (a harmless start-up step that fits);
        returns (key, the warm-up output sliced to the step's tokens). Current stream = the rank's forward stream."""
        if tokens not in self.token_buckets or seqs not in self.seq_buckets:
            raise GraphCaptureError(f"({tokens}, {seqs}) is not a prefill graph bucket of "
                                    f"{list(self.token_buckets)} x {list(self.seq_buckets)}")
        extra = self._extra(step)
        if extra is None:
            raise GraphCaptureError("a prefill graph cannot be captured with dynamic extras")
        key = PrefillGraphKey(tokens, seqs, extra)
        if key in self._graphs:
            raise GraphCaptureError(f"prefill graph {key} is already captured")
        buffers = self._ensure_buffers()
        self.model.fill_prefill_buffers(buffers, step, tokens, seqs)
        kwargs = model_kwargs(self.model.prefill_context(buffers, step, tokens, seqs))
        warm = self.model(**kwargs)  # one eager warm-up before each capture
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        torch.cuda.synchronize(self.device)
        reserved_before = torch.cuda.memory_reserved(self.device)
        graph = torch.cuda.CUDAGraph()
        try:
            with KeepOriginalErrorGraph(graph, pool=self._pool, stream=self.stream, capture_error_mode="thread_local"):
                output = self.model(**kwargs)
        except BaseException:
            self._pool = None  # a failed capture's pool is never captured into again
            raise
        torch.cuda.synchronize(self.device)
        pool_bytes = max(0, torch.cuda.memory_reserved(self.device) - reserved_before)
        self._graphs[key] = (graph, output, pool_bytes)
        return key, self.model.get_outputs(warm, step.num_tokens)

    def capture_token_bucket(self, step: ForwardStep, tokens: int) -> None:
        """`capture` every sequence bucket of token bucket `tokens` not captured yet, largest first."""
        extra = self._extra(step)
        for seqs in sorted(self.seq_buckets, reverse=True):
            if PrefillGraphKey(tokens, seqs, extra) not in self._graphs:
                self.capture(step, tokens, seqs)

    # ---- serving
    def replay(self, key: PrefillGraphKey, step: ForwardStep) -> torch.Tensor:
        """Fill the buffers from the live step, replay, and return the output rows of its real tokens (a view of
        the graph's output buffer: consume it before the next replay of this key)."""
        graph, output, _ = self._graphs[key]
        self.model.fill_prefill_buffers(self._buffers, step, key.tokens, key.seqs)
        graph.replay()
        return self.model.get_outputs(output, step.num_tokens)

    # ---- invalidation
    def reset(self) -> None:
        """Drop every graph, the static buffers and the pool (the caller synchronizes first)."""
        self._graphs.clear()
        self._buffers = None
        self._pool = None

