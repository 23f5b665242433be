"""Piecewise CUDA graph (PCG) plans: public API and the plan manager.

Operators import `eager_boundary` / `OutputPolicy` from here. The tracer lives in
`piecewise_builder`, bridges in `bridges`, plan steps in `plan`; this module owns
`PiecewiseGraphManager`: the registry of published plans of one runner.

Rules (seed): plans are prepared at start-up only (the runner calls `prepare` in
its preparation context, with a harmless dummy step), every token bucket is
captured and kept, serving only replays, nothing is evicted; `reset()` drops all.
"""
from __future__ import annotations

from typing import Any, Callable, Hashable, Mapping, Optional, Sequence

import torch

from .boundary import BoundarySpec, OutputPolicy, active_builder, boundary_spec, eager_boundary
from .bridges import ReusableBridgePool, make_weak_view
from .errors import (
    BridgeMismatchError,
    CapturedRequestValueError,
    ConcurrentBuildError,
    NestedRequestObjectError,
    PlanBuildError,
    PlanNotFoundError,
    UnsupportedBoundaryArgument,
    UnsupportedBoundaryOutput,
)
from .piecewise_builder import ArgumentBinder, _CaptureBuilder
from .plan import EagerStep, GraphStep, PiecewisePlan, _FrameValueRef

__all__ = [
    "eager_boundary",
    "OutputPolicy",
    "BoundarySpec",
    "boundary_spec",
    "active_builder",
    "GraphStep",
    "EagerStep",
    "PiecewisePlan",
    "PiecewiseGraphManager",
    "ReusableBridgePool",
    "ArgumentBinder",
    "make_weak_view",
    "_CaptureBuilder",
    "_FrameValueRef",
    "PlanBuildError",
    "ConcurrentBuildError",
    "UnsupportedBoundaryOutput",
    "UnsupportedBoundaryArgument",
    "NestedRequestObjectError",
    "CapturedRequestValueError",
    "BridgeMismatchError",
    "PlanNotFoundError",
]


class PiecewiseGraphManager:
    """Published plans of one runner, keyed by descriptor, plus the shared reusable bridge pool.

    device: the rank's CUDA device. stream: the rank's forward stream (captures and
    replays run there; None = the current stream at `prepare`). request_owned: frame
    names whose tensors are request-lifetime (never captured by address).
    Not thread-safe; no concurrent build or replay.
    """

    def __init__(
        self,
        device: torch.device,
        stream: Optional[Any] = None,
        *,
        capture_guard: bool = True,
        request_owned: Sequence[str] = ("attn_metadata", "state_ids"),
    ):
        self.device = torch.device(device)
        self.stream = stream
        self.capture_guard = capture_guard
        self.request_owned = tuple(request_owned)
        self.bridge_pool = ReusableBridgePool()
        self._plans: dict[Hashable, PiecewisePlan] = {}
        # One graph memory pool for every plan: plans replay one at a time and a plan's
        # intermediates are dead between replays (its outputs are non-owning views), so
        # plans built largest-first reuse the same blocks (as vLLM shares one pool).
        self._graph_pool: Optional[Any] = None

    # ---- queries
    def has_plan(self, descriptor: Hashable) -> bool:
        return descriptor in self._plans

    def plan(self, descriptor: Hashable) -> PiecewisePlan:
        plan = self._plans.get(descriptor)
        if plan is None:
            raise PlanNotFoundError(f"no published piecewise plan for {descriptor!r}")
        return plan

    def descriptors(self) -> list[Hashable]:
        return list(self._plans)

    @property
    def num_plans(self) -> int:
        return len(self._plans)

    @property
    def pool_bytes(self) -> int:
        """Measured private graph-pool growth of all plans (reserved-memory deltas around builds)."""
        return sum(p.pool_bytes for p in self._plans.values())

    @property
    def bridge_bytes(self) -> int:
        return sum(p.bridge_bytes for p in self._plans.values()) + self.bridge_pool.nbytes

    # ---- start-up
    def prepare(
        self,
        descriptor: Hashable,
        forward: Callable[[], torch.Tensor],
        frame: Mapping[str, Any],
        token_capacity: int,
        inputs: Mapping[str, torch.Tensor],
    ) -> torch.Tensor:
        """Build and publish the plan for `descriptor` by tracing `forward()` (start-up only).

        `forward` must read graph inputs from `inputs` (plan-owned) and request data
        only through `frame`. Returns the output the build itself materialized (the
        plan is not replayed again for this call). On failure nothing is published
        and the original exception propagates.
        """
        if descriptor in self._plans:
            raise PlanBuildError(f"a plan for {descriptor!r} is already published")
        stream = self.stream if self.stream is not None else torch.cuda.current_stream(self.device)
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        reserved_before = torch.cuda.memory_reserved(self.device)
        pool_bridges_before = self.bridge_pool.nbytes
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        builder = _CaptureBuilder(
            device=self.device,
            stream=stream,
            pool=self._graph_pool,
            frame=frame,
            request_owned=self.request_owned,
            token_capacity=token_capacity,
            bridge_pool=self.bridge_pool,
            inputs=inputs,
            guard=self.capture_guard,
        )
        try:
            plan, out = builder.build(forward)
        except BaseException:
            self._graph_pool = None  # a failed capture's pool is never captured into again
            raise
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        grown = torch.cuda.memory_reserved(self.device) - reserved_before
        new_bridges = plan.bridge_bytes + (self.bridge_pool.nbytes - pool_bridges_before)
        plan.pool_bytes = max(0, grown - new_bridges)
        self._plans[descriptor] = plan  # publish: only whole plans
        return out

    # ---- serving
    def replay(self, descriptor: Hashable, frame: Mapping[str, Any]) -> torch.Tensor:
        """Replay the published plan with the live frame; returns its bucket-length output view."""
        return self.plan(descriptor).replay(frame)

    # ---- invalidation
    def reset(self) -> None:
        """Drop every plan (graphs, private pools, bridges) and the reusable bridge storage.

        The caller (runner.reset) synchronizes the stream first and owns the ordering
        with weight / cache changes.
        """
        for plan in self._plans.values():
            plan.release()
        self._plans.clear()
        self._graph_pool = None
        self.bridge_pool.clear()
