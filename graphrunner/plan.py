"""A published piecewise plan: an ordered list of `GraphStep` and `EagerStep`, and its replay.

Replay runs every step in recorded order on the caller's (the rank's forward) stream:
a `GraphStep` replays one captured piece; an `EagerStep` resolves its argument template
against the live request frame, calls the undecorated boundary function and binds the
result (bridge copy or eager-only slot). The model's Python forward is not run.

Published steps hold: CUDA graphs, the boundary function, constants (python scalars,
runner-owned objects such as modules), non-owning views of captured tensors, bridges,
and references by NAME to frame values. Never the start-up request objects.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import torch
from torch.profiler import record_function

from .boundary import BoundarySpec
from .bridges import EagerOnlySlot


# ---------------------------------------------------------------------------------------------
# argument templates


class _Const:
    """A constant argument: python scalar, dtype, runner-owned object (module, operator backend)."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value

    def resolve(self, frame: Mapping[str, Any], slots: list) -> Any:
        return self.value


class _FrameValueRef:
    """A live request-frame value (`kv_caches`, `attn_metadata`, `state_ids`) looked up by name at replay."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def resolve(self, frame: Mapping[str, Any], slots: list) -> Any:
        return frame[self.name]

    def __repr__(self) -> str:
        return f"_FrameValueRef({self.name!r})"


class _TensorRef:
    """A stable tensor: a plan/pool-owned bridge, or a non-owning view of captured storage."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def resolve(self, frame: Mapping[str, Any], slots: list) -> Any:
        return self.tensor


class _EagerSlotRef:
    """The result (or a leaf of it, by `path`) of a prior eager-only boundary of this replay."""

    __slots__ = ("slot", "path")

    def __init__(self, slot: int, path: tuple = ()):
        self.slot = slot
        self.path = path

    def resolve(self, frame: Mapping[str, Any], slots: list) -> Any:
        value = slots[self.slot]
        for key in self.path:
            value = value[key]
        return value


class _SeqTemplate:
    """A tuple/list (or namedtuple) whose items are templates."""

    __slots__ = ("kind", "items", "named")

    def __init__(self, kind: type, items: Sequence[Any]):
        self.kind = kind
        self.items = tuple(items)
        self.named = hasattr(kind, "_fields")

    def resolve(self, frame: Mapping[str, Any], slots: list) -> Any:
        values = [i.resolve(frame, slots) for i in self.items]
        return self.kind(*values) if self.named else self.kind(values)


class _DictTemplate:
    __slots__ = ("kind", "items")

    def __init__(self, kind: type, items: Mapping[Any, Any]):
        self.kind = kind
        self.items = tuple(items.items())

    def resolve(self, frame: Mapping[str, Any], slots: list) -> Any:
        return self.kind((k, v.resolve(frame, slots)) for k, v in self.items)


# ---------------------------------------------------------------------------------------------
# steps


class GraphStep:
    """One captured piece (a `torch.cuda.CUDAGraph`)."""

    __slots__ = ("index", "graph", "_label")

    def __init__(self, index: int, graph: Any):
        self.index = index
        self.graph = graph
        self._label = f"piecewise::graph:{index}"

    def run(self, frame: Mapping[str, Any], slots: list) -> None:
        with record_function(self._label):
            self.graph.replay()


class EagerStep:
    """One eager boundary: declaration, argument template, result binding."""

    __slots__ = ("index", "spec", "fn", "args", "kwargs", "binding", "_label")

    def __init__(self, index: int, spec: BoundarySpec, args: Sequence[Any], kwargs: Mapping[str, Any], binding: Any):
        self.index = index
        self.spec = spec
        self.fn: Callable[..., Any] = spec.fn  # the undecorated function: nested boundaries are plain calls
        self.args = tuple(args)
        self.kwargs = tuple(kwargs.items())
        self.binding = binding
        self._label = f"piecewise::eager:{index}"

    def run(self, frame: Mapping[str, Any], slots: list) -> None:
        with record_function(self._label):
            args = [a.resolve(frame, slots) for a in self.args]
            kwargs = {k: v.resolve(frame, slots) for k, v in self.kwargs}
            result = self.fn(*args, **kwargs)
            if isinstance(self.binding, EagerOnlySlot):
                self.binding.bind_slot(result, slots)
            else:
                self.binding.bind(result, self.spec)


class PiecewisePlan:
    """An immutable ordered plan for one descriptor (lifetime: until `reset()`).

    inputs: plan-owned graph-input buffers (name -> bucket-length tensor).
    output: the stable output tensor (non-owning view of graph-pool storage, or a bridge).
    bridges: plan-owned bridge storage (kept alive here).
    pool: the plan's private CUDA graph memory pool handle (plan-local: token buckets may
        replay in any order, so plans never share captured activations).
    """

    def __init__(
        self,
        steps: Sequence[Any],
        output: torch.Tensor,
        inputs: Mapping[str, torch.Tensor],
        bridges: Sequence[torch.Tensor],
        num_slots: int,
        pool: Any,
        pool_bytes: int = 0,
    ):
        self.steps = tuple(steps)
        self.output = output
        self.inputs = dict(inputs)
        self.bridges = tuple(bridges)
        self.num_slots = num_slots
        self.pool = pool
        self.pool_bytes = pool_bytes

    @property
    def num_graph_steps(self) -> int:
        return sum(isinstance(s, GraphStep) for s in self.steps)

    @property
    def num_eager_steps(self) -> int:
        return sum(isinstance(s, EagerStep) for s in self.steps)

    @property
    def bridge_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.bridges)

    def replay(self, frame: Mapping[str, Any]) -> torch.Tensor:
        """Run every step in order with the live `frame`; returns the bucket-length output view.

        The eager-only slots live only for this call (request results are not retained).
        Failures propagate; nothing is retried.
        """
        slots: list = [None] * self.num_slots
        try:
            for step in self.steps:
                step.run(frame, slots)
        finally:
            slots.clear()
        return self.output

    def release(self) -> None:
        """Drop graphs and references (reset). The caller synchronizes the stream first."""
        self.steps = ()
        self.inputs = {}
        self.bridges = ()
        self.output = None  # type: ignore[assignment]


def iter_templates(step: EagerStep) -> list[Any]:
    """Flatten an eager step's templates (tests / introspection)."""
    out: list[Any] = []

    def walk(t: Any) -> None:
        out.append(t)
        if isinstance(t, _SeqTemplate):
            for i in t.items:
                walk(i)
        elif isinstance(t, _DictTemplate):
            for _, v in t.items:
                walk(v)

    for a in step.args:
        walk(a)
    for _, v in step.kwargs:
        walk(v)
    return out


__all__ = [
    "GraphStep",
    "EagerStep",
    "PiecewisePlan",
    "iter_templates",
    "_Const",
    "_FrameValueRef",
    "_TensorRef",
    "_EagerSlotRef",
    "_SeqTemplate",
    "_DictTemplate",
]
