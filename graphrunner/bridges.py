"""Result bindings of eager boundaries (output adapters), the reusable bridge pool, and non-owning views.

A *bridge* is a stable tensor that captured graph pieces read at a fixed address;
at every replay the boundary's fresh result is copied into it. Ownership:
- ordinary bridges belong to their plan (freed when the plan is dropped);
- bridges declared `reuse_bridge_after_next_step` are leased from the runner's
  `ReusableBridgePool`; a released lease keeps its physical storage (captured graphs
  still hold the address), it only becomes available to later boundaries, of this
  or another token-bucket plan (plans never replay concurrently: forwards are serial).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from .boundary import BoundarySpec, OutputPolicy
from .errors import BridgeMismatchError, UnsupportedBoundaryOutput


# ---------------------------------------------------------------------------------------------
# non-owning tensor views


def make_weak_view(t: torch.Tensor) -> torch.Tensor:
    """A tensor aliasing `t`'s memory that does NOT own (keep alive) the storage.

    Used for captured tensors referenced by replay templates (graph-pool activations,
    plan inputs, weights, cache arenas): their storage is kept alive by the graph pool,
    the plan or the model, and a template must never extend that lifetime (or hold the
    graph pool's blocks after reset). Needs torch >= 2.1 (`_construct_storage_from_data_pointer`).
    """
    storage = t.untyped_storage()
    weak = torch._C._construct_storage_from_data_pointer(storage.data_ptr(), t.device, storage.nbytes())
    view = torch.empty(0, dtype=t.dtype, device=t.device)
    view.set_(weak, t.storage_offset(), t.size(), t.stride())
    return view


def storage_ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


# ---------------------------------------------------------------------------------------------
# layout checks


def is_non_overlapping_and_dense(t: torch.Tensor) -> bool:
    """True when `t`'s elements occupy exactly numel consecutive slots of its storage (any dim order)."""
    if t.numel() <= 1:
        return True
    dims = sorted((st, sz) for st, sz in zip(t.stride(), t.size()) if sz != 1)
    expected = 1
    for st, sz in dims:
        if st != expected:
            return False
        expected *= sz
    return True


def owns_whole_storage(t: torch.Tensor) -> bool:
    """Dense, starting at offset 0, and covering its whole storage (a fresh result, not a partial view)."""
    return (
        t.storage_offset() == 0
        and is_non_overlapping_and_dense(t)
        and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    )


def tensor_leaves(result: Any, spec: BoundarySpec) -> tuple[list[torch.Tensor], Optional[type]]:
    """Split a bridged result into tensor leaves: a tensor, or a flat tuple/list of tensors.

    Returns (leaves, container type or None for a single tensor). Anything else is a
    mixed/unsupported tree for a bridge policy.
    """
    if isinstance(result, torch.Tensor):
        return [result], None
    if isinstance(result, (tuple, list)) and not hasattr(result, "_fields") and result:
        if all(isinstance(x, torch.Tensor) for x in result):
            return list(result), type(result)
    raise UnsupportedBoundaryOutput(
        f"{spec.name} returned {type(result).__name__} under {spec.output.name}: a bridge policy needs a tensor or a "
        "flat tuple/list of tensors (mixed trees are unsupported: split the operator into several boundaries, or "
        "declare output=OutputPolicy.EAGER_ONLY if only later eager steps consume it)"
    )


def validate_leaf(
    t: torch.Tensor, spec: BoundarySpec, device: torch.device, input_ptrs: set[int], capacity: Optional[int]
) -> None:
    """Reject what a generic bridge cannot represent (see UnsupportedBoundaryOutput)."""
    who = f"{spec.name} ({spec.output.name})"
    if t.layout != torch.strided or t.is_nested:
        raise UnsupportedBoundaryOutput(f"{who} returned a non-strided tensor (layout {t.layout})")
    if t.device != device:
        raise UnsupportedBoundaryOutput(f"{who} returned a tensor on {t.device}; bridges live on {device}")
    if t.numel() > 0 and storage_ptr(t) in input_ptrs:
        raise UnsupportedBoundaryOutput(
            f"{who} returned a tensor aliasing one of its inputs; alias-preserving outputs need an operator-owned "
            "adapter, not the generic tracer"
        )
    if spec.output is OutputPolicy.PADDED_VIEW:
        if not _non_overlapping(t):
            raise UnsupportedBoundaryOutput(f"{who} returned a tensor with overlapping strides {t.stride()}")
    elif not owns_whole_storage(t):
        raise UnsupportedBoundaryOutput(
            f"{who} returned a view (offset {t.storage_offset()}, strides {t.stride()}) into a larger or overlapping "
            "storage; declare output=OutputPolicy.PADDED_VIEW for operator-owned buffers, or return a fresh tensor"
        )
    if spec.padded:
        axis = _axis(t, spec)
        if capacity is not None and t.shape[axis] > capacity:
            raise UnsupportedBoundaryOutput(f"{who} returned {t.shape[axis]} rows, above the token bucket {capacity}")


def _non_overlapping(t: torch.Tensor) -> bool:
    dims = sorted((st, sz) for st, sz in zip(t.stride(), t.size()) if sz != 1)
    span = 1
    for st, sz in dims:
        if st < span:
            return False
        span = st * sz
    return True


def _axis(t: torch.Tensor, spec: BoundarySpec) -> int:
    axis = spec.token_axis if spec.token_axis >= 0 else t.dim() + spec.token_axis
    if not 0 <= axis < t.dim():
        raise UnsupportedBoundaryOutput(f"{spec.name}: token_axis {spec.token_axis} is out of range for {t.dim()}-d output")
    return axis


# ---------------------------------------------------------------------------------------------
# bindings (used identically at build and at every replay)


class FixedBridge:
    """BRIDGE policy: copy a result of exactly the bridge's shape and dtype."""

    __slots__ = ("bridge",)

    def __init__(self, bridge: torch.Tensor):
        self.bridge = bridge

    def bind(self, result: Any, spec: BoundarySpec) -> None:
        if not isinstance(result, torch.Tensor) or result.shape != self.bridge.shape or result.dtype != self.bridge.dtype:
            raise BridgeMismatchError(f"{spec.name}: result {_describe(result)} does not fit bridge {_describe(self.bridge)}")
        self.bridge.copy_(result)


class PaddedBridge:
    """PADDED_TOKENS / PADDED_VIEW: copy the real rows along the token axis, zero the bucket tail."""

    __slots__ = ("bridge", "axis", "capacity")

    def __init__(self, bridge: torch.Tensor, axis: int):
        self.bridge = bridge
        self.axis = axis
        self.capacity = bridge.shape[axis]

    def bind(self, result: Any, spec: BoundarySpec) -> None:
        b, ax = self.bridge, self.axis
        if (
            not isinstance(result, torch.Tensor)
            or result.dim() != b.dim()
            or result.dtype != b.dtype
            or result.shape[ax] > self.capacity
            or any(result.shape[i] != b.shape[i] for i in range(b.dim()) if i != ax)
        ):
            raise BridgeMismatchError(f"{spec.name}: result {_describe(result)} does not fit padded bridge {_describe(b)}")
        n = result.shape[ax]
        if n == self.capacity:
            b.copy_(result)
            return
        b.narrow(ax, 0, n).copy_(result)
        b.narrow(ax, n, self.capacity - n).zero_()


class TupleBinding:
    """A flat tuple/list of bridged tensors, one binding per leaf."""

    __slots__ = ("parts", "container")

    def __init__(self, parts: Sequence[Any], container: type):
        self.parts = tuple(parts)
        self.container = container

    def bind(self, result: Any, spec: BoundarySpec) -> None:
        if not isinstance(result, (tuple, list)) or len(result) != len(self.parts):
            raise BridgeMismatchError(f"{spec.name}: expected {len(self.parts)} results, got {_describe(result)}")
        for part, r in zip(self.parts, result):
            part.bind(r, spec)

    @property
    def bridges(self) -> list[torch.Tensor]:
        return [p.bridge for p in self.parts]


class EagerOnlySlot:
    """EAGER_ONLY: store the result in the plan's per-replay slot list (cleared after each replay)."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index

    def bind_slot(self, result: Any, slots: list) -> None:
        slots[self.index] = result


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"Tensor{tuple(x.shape)}:{x.dtype}"
    return type(x).__name__


# ---------------------------------------------------------------------------------------------
# reusable bridge pool


@dataclass
class _Slot:
    storage: torch.Tensor  # contiguous, full capacity along `axis`
    axis: Optional[int]  # token axis for padded slots, None for fixed-shape slots
    available: bool = False


class ReusableBridgePool:
    """Physical bridge storage for boundaries declared `reuse_bridge_after_next_step`.

    `allocate_*` returns a lease (a tensor view of a slot); `release(lease)` marks the
    slot available again WITHOUT freeing it (captured graphs keep its address). A padded
    request may be served by a larger slot narrowed along the token axis. One pool backs
    every plan of a runner: plans are mutually exclusive in time. Concurrent replays are
    not supported (they would need separate slots or explicit leases). Owned by the
    runner's piecewise manager; `clear()` (reset) drops all storage.
    """

    def __init__(self) -> None:
        self._slots: list[_Slot] = []
        self._leases: dict[int, tuple[int, torch.Tensor]] = {}

    def allocate_tensor(self, shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A contiguous bridge of exactly `shape`."""
        shape = tuple(int(s) for s in shape)
        for i, s in enumerate(self._slots):
            if s.available and s.axis is None and tuple(s.storage.shape) == shape and s.storage.dtype == dtype \
                    and s.storage.device == device:
                return self._lease(i, s.storage)
        self._slots.append(_Slot(torch.empty(shape, dtype=dtype, device=device), None))
        return self._lease(len(self._slots) - 1, self._slots[-1].storage)

    def allocate_padded_tensor(
        self, shape: Sequence[int], dtype: torch.dtype, device: torch.device, token_axis: int
    ) -> torch.Tensor:
        """A contiguous-storage bridge of `shape`; a larger available slot is narrowed along `token_axis`."""
        shape = tuple(int(s) for s in shape)
        best = None
        for i, s in enumerate(self._slots):
            st = s.storage
            if not s.available or s.axis != token_axis or st.dtype != dtype or st.device != device or st.dim() != len(shape):
                continue
            if any(st.shape[d] != shape[d] for d in range(len(shape)) if d != token_axis):
                continue
            if st.shape[token_axis] < shape[token_axis]:
                continue
            if best is None or st.shape[token_axis] < self._slots[best].storage.shape[token_axis]:
                best = i
        if best is None:
            self._slots.append(_Slot(torch.empty(shape, dtype=dtype, device=device), token_axis))
            best = len(self._slots) - 1
        st = self._slots[best].storage
        return self._lease(best, st.narrow(token_axis, 0, shape[token_axis]))

    def _lease(self, index: int, view: torch.Tensor) -> torch.Tensor:
        self._slots[index].available = False
        if view is self._slots[index].storage:
            view = view.view(view.shape)  # a distinct object per lease, so release() is by identity
        self._leases[id(view)] = (index, view)
        return view

    def release(self, lease: torch.Tensor) -> None:
        """Make the lease's slot available to later boundaries; its storage stays allocated."""
        entry = self._leases.pop(id(lease), None)
        if entry is None:
            raise KeyError("release() of a tensor that is not a live lease of this pool")
        self._slots[entry[0]].available = True

    def is_lease(self, t: torch.Tensor) -> bool:
        return id(t) in self._leases

    @property
    def nbytes(self) -> int:
        return sum(s.storage.numel() * s.storage.element_size() for s in self._slots)

    @property
    def num_slots(self) -> int:
        return len(self._slots)

    def clear(self) -> None:
        """Drop every slot (reset only: graphs reading these addresses must already be gone)."""
        self._slots.clear()
        self._leases.clear()
