"""Construction of one piecewise plan by direct CUDA stream capture (start-up only, no FX/Dynamo).

    capture until the first eager boundary -> capture_end -> replay that piece (capture
    executes nothing, the boundary needs real inputs) -> run the boundary eagerly on real
    data -> bind its result into a stable bridge -> resume capture -> ... -> last piece.

Only a whole plan is returned; on any exception the active capture is ended
best-effort, leased bridges are returned, nothing is published, and the ORIGINAL
exception propagates unchanged.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
from torch.overrides import TorchFunctionMode

from .boundary import _ACTIVE_BUILDER, BoundarySpec, OutputPolicy
from .capture import end_capture, end_capture_quietly
from .bridges import (
    EagerOnlySlot,
    FixedBridge,
    PaddedBridge,
    ReusableBridgePool,
    TupleBinding,
    _axis,
    storage_ptr,
    tensor_leaves,
    validate_leaf,
)
from .errors import CapturedRequestValueError, ConcurrentBuildError, PlanBuildError
from .plan import EagerStep, GraphStep, PiecewisePlan
from .templates import ArgumentBinder, shallow_tensors

__all__ = ["ArgumentBinder", "shallow_tensors", "_CaptureBuilder"]


class _CaptureGuard(TorchFunctionMode):
    """While a piece is being captured, reject torch calls on values whose address is not stable."""

    def __init__(self, builder: "_CaptureBuilder"):
        super().__init__()
        self.builder = builder

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: A002 - torch's signature
        kwargs = kwargs or {}
        b = self.builder
        if b._capturing and b._forbidden:
            b._check_captured_use(func, args, kwargs)
        return func(*args, **kwargs)


class _CaptureBuilder:
    """Builds ONE plan. Not reusable; not thread-safe (one build per thread at a time)."""

    def __init__(
        self,
        *,
        device: torch.device,
        stream: Any,
        pool: Any,
        frame: Mapping[str, Any],
        request_owned: Sequence[str],
        token_capacity: int,
        bridge_pool: ReusableBridgePool,
        inputs: Mapping[str, torch.Tensor],
        guard: bool = True,
        graph_factory: Optional[Callable[[], Any]] = None,
    ):
        """graph_factory: makes one piece (default `torch.cuda.CUDAGraph`); CPU unit tests inject a
        no-op piece to exercise the splitting/binding logic without a device."""
        self.device = torch.device(device)
        self._graph_factory = graph_factory if graph_factory is not None else torch.cuda.CUDAGraph
        self._stream = stream
        self._pool = pool
        self._capacity = int(token_capacity)
        self._bridge_pool = bridge_pool
        self._inputs = dict(inputs)
        self._guard = guard
        self._binder = ArgumentBinder(frame, request_owned, self.device)
        self._steps: list[Any] = []
        self._bridges: list[torch.Tensor] = []
        self._leases: list[torch.Tensor] = []
        self._pending_release: list[torch.Tensor] = []
        self._num_slots = 0
        self._graph: Optional[Any] = None
        self._capturing = False
        self._depth = 0
        self._forbidden: dict[int, str] = {}
        self._used = False

    # ------------------------------------------------------------------ driver
    def build(self, forward: Callable[[], torch.Tensor]) -> tuple[PiecewisePlan, torch.Tensor]:
        """Trace `forward()` into a plan. Returns (plan, the output materialized by the build)."""
        if self._used:
            raise PlanBuildError("a _CaptureBuilder builds one plan only")
        self._used = True
        if _ACTIVE_BUILDER.get() is not None:
            raise ConcurrentBuildError("a piecewise plan build is already active in this thread")
        token = _ACTIVE_BUILDER.set(self)
        try:
            if self._guard:
                self._forbidden = {i: "a tensor of the start-up request's attention metadata / state ids"
                                   for i in self._binder.request_tensor_ids()}
            with _CaptureGuard(self) if self._guard else contextlib.nullcontext():
                self._begin_piece()
                out = forward()
                self._end_piece()
            plan = self._publishable(out)
        except BaseException:
            self._discard_active_capture()
            self._return_leases()
            raise
        finally:
            _ACTIVE_BUILDER.reset(token)
            self._binder = None  # type: ignore[assignment]  # drop build-time references (frame, slots)
            self._forbidden = {}
        return plan, out

    def on_boundary(self, spec: BoundarySpec, args: tuple, kwargs: dict) -> Any:
        """Called by the `eager_boundary` wrapper while this builder is active."""
        if self._depth:
            return spec.fn(*args, **kwargs)  # nested: part of the outermost boundary
        if not self._capturing:
            raise PlanBuildError(f"boundary {spec.name} called while no piece is being captured")
        self._end_piece()
        arg_t = [self._binder.template(a) for a in args]
        kw_t = {k: self._binder.template(v) for k, v in kwargs.items()}
        input_ptrs = _input_storage_ptrs(args, kwargs)
        self._depth += 1
        try:
            result = spec.fn(*args, **kwargs)
        finally:
            self._depth -= 1
        binding, returned, leases = self._bind(spec, result, input_ptrs)
        self._append(EagerStep(len(self._steps), spec, arg_t, kw_t, binding))
        self._pending_release.extend(leases)
        self._begin_piece()
        return returned

    # ------------------------------------------------------------------ pieces
    def _begin_piece(self) -> None:
        if self.device.type == "cuda":
            current = torch.cuda.current_stream(self.device)
            if current != self._stream:
                raise PlanBuildError(
                    f"piecewise capture must run on the rank's forward stream {self._stream}, current is {current} "
                    "(a boundary must return on the stream it was called on)"
                )
        graph = self._graph_factory()
        graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
        self._graph = graph
        self._capturing = True

    def _end_piece(self) -> None:
        graph, self._graph = self._graph, None
        self._capturing = False
        end_capture(graph, self.device, allow_empty=True)
        graph.replay()  # capture executed nothing: materialize this piece for the next eager step
        self._append(GraphStep(len(self._steps), graph))

    def _append(self, step: Any) -> None:
        self._steps.append(step)
        released, self._pending_release = self._pending_release, []
        for lease in released:  # their declared last use was the step just appended
            self._bridge_pool.release(lease)
            self._forbidden[id(lease)] = "a reusable bridge after the step following its boundary"

    def _discard_active_capture(self) -> None:
        """Best-effort: end an active capture so the stream and allocator leave capture mode."""
        graph, self._graph = self._graph, None
        self._capturing = False
        if graph is None:
            return
        end_capture_quietly(graph, self.device)

    def _return_leases(self) -> None:
        for lease in self._leases:
            try:
                if self._bridge_pool.is_lease(lease):
                    self._bridge_pool.release(lease)
            except BaseException:  # noqa: BLE001
                pass
        self._steps = []
        self._bridges = []

    # ------------------------------------------------------------------ results
    def _bind(self, spec: BoundarySpec, result: Any, input_ptrs: set[int]) -> tuple[Any, Any, list[torch.Tensor]]:
        if spec.output is OutputPolicy.EAGER_ONLY:
            slot = self._num_slots
            self._num_slots += 1
            self._binder.add_slot(slot, result)
            if self._guard:
                for i in self._binder.slot_leaf_ids():
                    self._forbidden.setdefault(i, f"an EAGER_ONLY result of {spec.name}")
            return EagerOnlySlot(slot), result, []
        leaves, container = tensor_leaves(result, spec)
        parts, returned, leases = [], [], []
        for leaf in leaves:
            validate_leaf(leaf, spec, self.device, input_ptrs, self._capacity if spec.padded else None)
            if spec.padded:
                axis = _axis(leaf, spec)
                shape = list(leaf.shape)
                shape[axis] = self._capacity
                if spec.reuse_bridge_after_next_step:
                    bridge = self._bridge_pool.allocate_padded_tensor(shape, leaf.dtype, leaf.device, axis)
                else:
                    bridge = torch.empty(shape, dtype=leaf.dtype, device=leaf.device)
                part: Any = PaddedBridge(bridge, axis)
            else:
                if spec.reuse_bridge_after_next_step:
                    bridge = self._bridge_pool.allocate_tensor(leaf.shape, leaf.dtype, leaf.device)
                else:
                    bridge = torch.empty_strided(leaf.size(), leaf.stride(), dtype=leaf.dtype, device=leaf.device)
                part = FixedBridge(bridge)
            if spec.reuse_bridge_after_next_step:
                leases.append(bridge)
                self._leases.append(bridge)
            else:
                self._bridges.append(bridge)
            part.bind(leaf, spec)
            self._binder.add_bridge(bridge)
            parts.append(part)
            returned.append(bridge)
        if container is None:
            return parts[0], returned[0], leases
        return TupleBinding(parts, container), container(returned), leases

    def _publishable(self, out: Any) -> PiecewisePlan:
        if not isinstance(out, torch.Tensor):
            raise PlanBuildError(f"the forward returned {type(out).__name__}; a plan output must be one tensor")
        if id(out) in self._forbidden:
            raise CapturedRequestValueError(f"the forward returned {self._forbidden[id(out)]}")
        if self._binder.is_slot_leaf(out):
            raise CapturedRequestValueError("the forward returned an EAGER_ONLY boundary result")
        if self._binder.frame_name(out) is not None:
            raise CapturedRequestValueError("the forward returned a request frame value")
        if self._binder.is_bridge(out):
            output = out  # plan- or pool-owned
        else:
            output = self._binder._tensor(out).tensor  # non-owning view of graph-pool storage
        return PiecewisePlan(
            steps=self._steps,
            output=output,
            inputs=self._inputs,
            bridges=self._bridges,
            num_slots=self._num_slots,
            pool=self._pool,
        )

    # ------------------------------------------------------------------ guard
    def _check_captured_use(self, func: Any, args: tuple, kwargs: dict) -> None:
        forbidden = self._forbidden
        for v in _iter_shallow(args, kwargs):
            what = forbidden.get(id(v))
            if what is not None:
                name = getattr(func, "__name__", repr(func))
                raise CapturedRequestValueError(
                    f"captured work ({name}) consumed {what}; its address is not stable for the plan lifetime. "
                    "Move that consumer into an eager boundary, or bridge the value"
                )


def _iter_shallow(args: tuple, kwargs: dict):
    for v in args:
        yield v
        if isinstance(v, (list, tuple)):
            yield from v
    for v in kwargs.values():
        yield v
        if isinstance(v, (list, tuple)):
            yield from v


def _input_storage_ptrs(args: tuple, kwargs: dict) -> set[int]:
    return {storage_ptr(v) for v in _iter_shallow(args, kwargs) if isinstance(v, torch.Tensor) and v.numel()}

