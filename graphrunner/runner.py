"""`CUDAGraphRunner`: one rank's graph selection, start-up capture, replay and invalidation.

The coordinator drives start-up one bucket at a time (same buckets, same order on
every rank): `decode_capture_sizes()` / `capture_decode(b)`, then
`prefill_capture_sizes()` / `capture_prefill(t)`. On CPU or in eager mode those calls
run one eager warm-up forward of the bucket, so the lock-step protocol is identical.
Serving (`__call__`) never captures and never evicts. `reset()` is the only
invalidation owner.
"""
from __future__ import annotations

import contextlib
import gc
import time
from typing import Any, Callable, Iterator, Optional

import torch

from .config import GraphRunnerConfig
from .dispatch import Decision, DispatchPolicy, Path
from .epilogue import DecodeEpilogues, EpilogueFn
from .errors import GraphCaptureError
from .forward_args import model_kwargs
from .full_graph import DecodeGraphKey, FullGraphRunner, decode_graph_key
from .piecewise import PiecewiseGraphManager
from .prefill_graph import PrefillGraphRunner
from .standard import REQUEST_LIFETIME_FRAME_NAMES, StandardPiecewiseRuntime
from .stats import EagerReason, ExecPath, RunnerStats
from .step import ForwardStep, GraphMeta

DummyStepFactory = Callable[[int, int, bool], ForwardStep]


class CUDAGraphRunner:
    """Per-rank CUDA graph runner (model- and operator-blind).

    model: the standard decoder contract (see graphrunner/README.md).
    dummy_step_factory(num_tokens, batch_size, is_decoding): a harmless bucket-shaped step.
    max_blocks_per_seq: block-table width of the decode graph buffers.
    stream: the rank's forward stream (default: current stream at construction). Capture
        is illegal on the legacy default stream, so if that is what we get the runner
        owns a side stream and brackets every call with stream waits both ways.
    """

    def __init__(
        self,
        model: Any,
        config: GraphRunnerConfig,
        device: torch.device | str,
        dummy_step_factory: DummyStepFactory,
        max_blocks_per_seq: int,
        stream: Optional[Any] = None,
    ):
        self.model = model
        self.config = config
        self.device = torch.device(device)
        self.dummy_step_factory = dummy_step_factory
        self.stats = RunnerStats()
        self._cuda = self.device.type == "cuda"
        self._decode_buckets = config.decode_buckets()
        self._prefill_buckets = config.prefill_buckets()
        self._prefill_graph_tokens, self._prefill_graph_seqs = config.prefill_graph_buckets()
        self._reset_hooks: list[Callable[[], None]] = []
        self._preparing = 0
        self.stream: Optional[Any] = None
        if self._cuda:
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            self.stream = stream if stream is not None else torch.cuda.current_stream(self.device)
            if self.stream == torch.cuda.default_stream(self.device):
                self.stream = torch.cuda.Stream(self.device)
        max_batch = self._decode_buckets[-1] if self._decode_buckets else 0
        max_tokens = max(max_batch, self._prefill_buckets[-1] if self._prefill_buckets else 0,
                         self._prefill_graph_tokens[-1] if self._prefill_graph_tokens else 0, 1)
        self.graph_meta = GraphMeta(max_batch, max_tokens, max_blocks_per_seq, self.device)
        graphs = self._cuda and not config.eager_mode
        self._full: Optional[FullGraphRunner] = (
            FullGraphRunner(model, self.graph_meta, self.stream) if graphs and self._decode_buckets else None
        )
        self._epilogues: Optional[DecodeEpilogues] = (
            DecodeEpilogues(self.device, self._full.pool) if self._full is not None else None
        )
        self._prefill_graphs: Optional[PrefillGraphRunner] = (
            PrefillGraphRunner(model, self._prefill_graph_tokens, self._prefill_graph_seqs, self.graph_meta,
                               self.stream)
            if graphs and self._prefill_graph_tokens and hasattr(model, "make_prefill_buffers") else None
        )
        self._decisions: dict[tuple, Decision] = {}  # memoised decode decisions (see `decide_decode`)
        self._pcg: Optional[StandardPiecewiseRuntime] = None
        off_reason = EagerReason.PCG_DISABLED
        if graphs and self._prefill_buckets:
            off_reason = self._enable_piecewise()
        self._policy = DispatchPolicy(
            model=model,
            eager_mode=config.eager_mode,
            cuda=self._cuda,
            decode_buckets=self._decode_buckets,
            has_decode_graph=self._full.has_graph if self._full is not None else (lambda key: False),
            piecewise=self._pcg,
            piecewise_off_reason=off_reason,
            prefill_graphs=self._prefill_graphs,
        )

    def _enable_piecewise(self) -> EagerReason:
        supports = getattr(self.model, "supports_piecewise_cuda_graph", None)
        enable = getattr(self.model, "enable_piecewise_cuda_graph", None)
        if supports is None or enable is None or not supports():
            return EagerReason.PCG_UNSUPPORTED_BY_MODEL
        if not enable():  # the model installs its operators' boundaries all-or-none
            return EagerReason.PCG_UNSUPPORTED_BY_MODEL
        manager = PiecewiseGraphManager(
            self.device, self.stream, capture_guard=self.config.pcg_capture_guard,
            request_owned=REQUEST_LIFETIME_FRAME_NAMES,
        )
        self._pcg = StandardPiecewiseRuntime(self.model, manager, self._prefill_buckets)
        return EagerReason.PCG_DISABLED

    # ------------------------------------------------------------------ introspection
    @property
    def piecewise_enabled(self) -> bool:
        return self._pcg is not None

    @property
    def piecewise_manager(self) -> Optional[PiecewiseGraphManager]:
        return self._pcg.manager if self._pcg is not None else None

    @property
    def full_graphs(self) -> Optional[FullGraphRunner]:
        """The decode graphs, for tests and benchmarks (product code: `run`, `replay_decode`, `arm_decode`...)."""
        return self._full

    @property
    def num_decode_graphs(self) -> int:
        return self._full.num_graphs if self._full is not None else 0

    @property
    def num_prefill_graphs(self) -> int:
        return self._prefill_graphs.num_graphs if self._prefill_graphs is not None else 0

    @property
    def num_plans(self) -> int:
        return self._pcg.manager.num_plans if self._pcg is not None else 0

    def decode_output(self, batch: int) -> Optional[torch.Tensor]:
        """The output buffer of the captured decode graph of bucket `batch`: every replay of that graph writes
        its rows there. Graph-pool storage, valid until `reset()`. None if not captured (or ambiguous)."""
        return self._full.output_of(batch) if self._full is not None else None

    def decide(self, step: ForwardStep) -> Decision:
        """The path `step` would take now (no side effects)."""
        return self._policy.decide(step, self._preparing > 0)

    def decide_decode(self, step: ForwardStep) -> Decision:
        """`decide(step)` for a plain decode step (one token per sequence, no extras, adapters or micro-batches),
        memoised by (batch size, hints): for such steps the decision is a function of those and of the captured
        graphs, and the memo is cleared whenever graphs are captured or dropped."""
        key = (step.batch_size, step.num_tokens, step.is_decoding, step.global_decode, step.batch_bucket_hint,
               step.token_bucket_hint)
        d = self._decisions.get(key)
        if d is None or self._preparing:
            d = self.decide(step)
            if not self._preparing and step.extras is None and step.adapter_ids is None and not step.micro_batch:
                self._decisions[key] = d
        return d

    # ------------------------------------------------------------------ decode epilogues
    def register_epilogue(self, name: str, fn: EpilogueFn, max_batch: int) -> None:
        """Capture `fn(hidden [bucket, H], bucket) -> tuple of tensors` on every decode graph's output up to bucket
        `max_batch`, right after that graph, into the same pool (`graphrunner.epilogue`). No-op without decode
        graphs (CPU, eager mode). Register before `capture_decode`."""
        if self._epilogues is not None:
            self._epilogues.register(name, fn, max_batch)

    def replay_epilogue(self, bucket: int, name: str) -> Optional[tuple]:
        """Replay epilogue `name` of decode bucket `bucket` after that bucket's decode graph (current stream);
        its outputs (pool views, `[bucket, ...]`, valid until its next replay), or None when not captured."""
        return None if self._epilogues is None else self._epilogues.replay(bucket, name)

    def epilogue_outputs(self, bucket: int, name: str) -> Optional[tuple]:
        """The output tensors of a captured epilogue (what its replays write), or None."""
        return None if self._epilogues is None else self._epilogues.outputs(bucket, name)

    def epilogue_stats(self) -> dict[str, Any]:
        e = self._epilogues
        if e is None:
            return {"names": [], "buckets": [], "pool_bytes": 0}
        return {"names": e.names, "buckets": e.buckets(), "pool_bytes": e.pool_bytes,
                "capture_s": round(e.capture_seconds, 4)}

    # ------------------------------------------------------------------ serving
    def __call__(self, step: ForwardStep) -> torch.Tensor:
        """Run one forward step; returns hidden states `[num_tokens, H]`.

        The path is decided before any side effect. A graph output is a view of
        reusable storage: consume it before the next call.
        """
        return self.run(step, self.decide(step))

    def run(self, step: ForwardStep, decision: Decision) -> torch.Tensor:
        """`__call__` with the path already decided by `decide(step)` (a caller that needs the decision, e.g.
        its bucket, decides once). Same output contract as `__call__`."""
        with torch.inference_mode():
            if self._cuda and torch.cuda.current_stream(self.device) != self.stream:
                with self._on_rank_stream():
                    return self._execute(step, decision, serving=True)
            return self._execute(step, decision, serving=True)

    # Decode graphs by the `decode_key` of a FULL_GRAPH decision the caller holds (the rank's decode lanes and armed
    # steps). Current stream: the forward stream, in inference mode; no stats recorded (the caller records).
    def replay_decode(self, key: DecodeGraphKey, step: ForwardStep) -> torch.Tensor:
        """`FullGraphRunner.replay`: fill, redirect, replay; the output `[num_tokens, H]` (a graph-pool view)."""
        return self._full.replay(key, step)

    def arm_decode(self, key: DecodeGraphKey, gate: Callable[[], Any]) -> None:
        """`FullGraphRunner.arm`: enqueue a replay of `key` on padding rows behind `gate()`."""
        self._full.arm(key, gate)

    def stage_armed_decode(self, key: DecodeGraphKey, ids: Any, num_history: Any, block_tables: Any,
                           block_size: int) -> None:
        """`FullGraphRunner.stage_armed`: write a step's host arrays into `key`'s armed replay, gate still closed."""
        self._full.stage_armed(key, ids, num_history, block_tables, block_size)

    def _execute(self, step: ForwardStep, decision: Decision, serving: bool) -> torch.Tensor:
        path = decision.path
        if path is Path.FULL_GRAPH:
            out = self._full.replay(decision.decode_key, step)
            self.stats.record_step(ExecPath.FULL_GRAPH, step.num_tokens, decision.decode_key.batch)
            return out
        if path is Path.PREFILL_GRAPH:
            key = decision.prefill_key
            out = self._prefill_graphs.replay(key, step)
            self.stats.record_step(ExecPath.PREFILL_GRAPH, step.num_tokens, key.tokens)
            return out
        if path is Path.PIECEWISE:
            out = self._pcg.replay(decision.descriptor, step)
            if serving:
                self.stats.record_step(ExecPath.PIECEWISE, step.num_tokens, decision.descriptor.token_bucket)
            return out
        if path is Path.BUILD:
            t0 = time.perf_counter()
            out = self._pcg.prepare(decision.descriptor, step)
            torch.cuda.synchronize(self.device)
            self.stats.record_capture("prefill", decision.descriptor.token_bucket, time.perf_counter() - t0, True)
            self._refresh_memory_stats()
            return out
        out = self.model(**model_kwargs(step))
        if serving:
            self.stats.record_step(ExecPath.EAGER, step.num_tokens, step.num_tokens, decision.reason)
        return out

    @contextlib.contextmanager
    def _on_rank_stream(self) -> Iterator[None]:
        if not self._cuda:
            yield
            return
        current = torch.cuda.current_stream(self.device)
        if current == self.stream:
            yield
            return
        self.stream.wait_stream(current)
        try:
            with torch.cuda.stream(self.stream):
                yield
        finally:
            current.wait_stream(self.stream)

    # ------------------------------------------------------------------ start-up
    def decode_capture_sizes(self) -> list[int]:
        """Decode buckets in capture order (largest first)."""
        return sorted(self._decode_buckets, reverse=True)

    def prefill_capture_sizes(self) -> list[int]:
        """Token buckets of the piecewise plans and the full prefill graphs, in capture order (largest first)."""
        return sorted(set(self._prefill_buckets) | set(self._prefill_graph_tokens), reverse=True)

    @contextlib.contextmanager
    def preparing_prefill(self) -> Iterator[None]:
        """Start-up preparation context: inside it a prefill step without a plan builds one."""
        self._preparing += 1
        try:
            yield
        finally:
            self._preparing -= 1

    def capture_decode(self, batch: int) -> float:
        """Warm up and capture the decode graph of bucket `batch`; returns seconds (0.0 if already captured).

        CPU / eager mode / unsupported by the model: one eager warm-up forward instead.
        """
        if batch not in self._decode_buckets:
            raise GraphCaptureError(f"{batch} is not a decode bucket {list(self._decode_buckets)}")
        step = self.dummy_step_factory(batch, batch, True)
        with torch.inference_mode(), self._on_rank_stream():
            t0 = time.perf_counter()
            as_graph = self._full is not None and bool(self.model.supports_cuda_graph(step))
            if as_graph:
                if self._full.has_graph(decode_graph_key(self.model, step, batch)):
                    return 0.0
                self._decisions.clear()
                self._full.capture(step, batch)
                out = self._full.output_of(batch)
                if self._epilogues is not None and out is not None:
                    self._epilogues.capture(batch, out[:batch])
            else:
                self.model(**model_kwargs(step))
            if self._cuda:
                torch.cuda.synchronize(self.device)
            seconds = time.perf_counter() - t0
        self.stats.record_capture("decode", batch, seconds, as_graph)
        self._refresh_memory_stats()
        return seconds

    def capture_prefill(self, tokens: int) -> float:
        """Build the piecewise plan of token bucket `tokens` and capture its full prefill graphs (one per sequence
        bucket), whichever it is a bucket of; returns seconds. CPU / eager mode / off: one eager warm-up instead."""
        if tokens not in self._prefill_buckets and tokens not in self._prefill_graph_tokens:
            raise GraphCaptureError(f"{tokens} is not a prefill token bucket {self.prefill_capture_sizes()[::-1]}")
        seconds = self._capture_plan(tokens) if tokens in self._prefill_buckets else 0.0
        if tokens in self._prefill_graph_tokens:
            seconds += self._capture_prefill_graphs(tokens)
        return seconds

    def _capture_plan(self, tokens: int) -> float:
        step = self.dummy_step_factory(tokens, 1, False)
        self._decisions.clear()  # a new plan may serve decode steps that have no full graph
        with torch.inference_mode(), self._on_rank_stream(), self.preparing_prefill():
            decision = self._policy.piecewise_choice(step, preparing=True)
            if isinstance(decision, Decision) and decision.path is Path.PIECEWISE:
                return 0.0
            built = isinstance(decision, Decision)  # Path.BUILD: the build records its own capture
            t0 = time.perf_counter()
            self._execute(step, decision if built else Decision(Path.EAGER, decision), serving=False)
            if built:
                return time.perf_counter() - t0
            if self._cuda:
                torch.cuda.synchronize(self.device)
            seconds = time.perf_counter() - t0
        self.stats.record_capture("prefill", tokens, seconds, False)
        return seconds

    def _capture_prefill_graphs(self, tokens: int) -> float:
        """The full prefill graphs of token bucket `tokens`, one per sequence bucket, largest first."""
        step = self.dummy_step_factory(tokens, 1, False)
        pg = self._prefill_graphs
        self._decisions.clear()
        with torch.inference_mode(), self._on_rank_stream():
            t0 = time.perf_counter()
            as_graph = pg is not None and bool(self.model.supports_prefill_graph(step))
            if as_graph:
                pg.capture_token_bucket(step, tokens)
            elif tokens not in self._prefill_buckets:  # the plan's capture already ran this bucket's warm-up
                self.model(**model_kwargs(step))
            if self._cuda:
                torch.cuda.synchronize(self.device)
            seconds = time.perf_counter() - t0
        self.stats.record_capture("prefill_graph", tokens, seconds, as_graph)
        self._refresh_memory_stats()
        return seconds

    # ------------------------------------------------------------------ invalidation
    def add_reset_hook(self, fn: Callable[[], None]) -> None:
        """Run `fn()` at the end of every `reset()` (e.g. collective DeepEP buffer destroy + barrier)."""
        self._reset_hooks.append(fn)

    def reset(self) -> None:
        """Drop every full graph, plan, bridge, static buffer and graph pool, then run the reset hooks.

        Call before weights, KV arenas or any other captured address change; re-capture after.
        Every hook runs even if one fails (collective hooks must pair up); the first error is raised.
        """
        if self._cuda:
            torch.cuda.synchronize(self.device)  # no replay may still be reading what we drop
        self._decisions.clear()
        if self._epilogues is not None:
            self._epilogues.reset()
        if self._full is not None:
            self._full.reset()
        if self._prefill_graphs is not None:
            self._prefill_graphs.reset()
        if self._pcg is not None:
            self._pcg.reset()
        gc.collect()
        if self._cuda:
            # A cuBLAS workspace first used during a capture lives in that graph's private pool
            # and would pin it; workspaces are re-created lazily (outside capture) on next use.
            getattr(torch._C, "_cuda_clearCublasWorkspaces", lambda: None)()
            torch.cuda.empty_cache()
        self.stats.on_reset()
        errors: list[BaseException] = []
        for hook in self._reset_hooks:
            try:
                hook()
            except BaseException as e:  # noqa: BLE001 - run every hook, re-raise the first
                errors.append(e)
        if errors:
            raise errors[0]

    def _refresh_memory_stats(self) -> None:
        pcg = self._pcg.manager if self._pcg is not None else None
        self.stats.refresh_memory(self._full, self._prefill_graphs, pcg)
