"""Replay argument templates: how a boundary's direct arguments are bound (shallow, by identity).

frame values (matched by identity)    -> `_FrameValueRef(name)`, re-bound to the live request
results of prior EAGER_ONLY boundaries -> `_EagerSlotRef(slot, path)`
bridges                                -> the plan/pool-owned bridge
other CUDA tensors                     -> non-owning views (graph pool, plan inputs, weights, caches)
scalars, dtypes, modules, functions    -> constants
containers                             -> templates of their items (a frame value nested inside is rejected)
other objects                          -> constants, after a shallow scan for nested request objects

Rejected: request-owned tensors passed directly (pass the frame value), values derived
from eager-only results, host tensors, nested request objects.
"""
from __future__ import annotations

import dataclasses
import enum
import functools
import types
from typing import Any, Mapping, Optional, Sequence

import torch

from .bridges import make_weak_view, storage_ptr
from .errors import NestedRequestObjectError, UnsupportedBoundaryArgument
from .plan import _Const, _DictTemplate, _EagerSlotRef, _FrameValueRef, _SeqTemplate, _TensorRef

_SCALARS = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device, torch.Size, slice,
            type(Ellipsis), torch.layout, torch.memory_format)


def _is_scalar(v: Any) -> bool:
    return isinstance(v, _SCALARS) or isinstance(v, enum.Enum)


def _shallow_attrs(obj: Any) -> list[Any]:
    """The direct attribute values of `obj` (dataclass fields, __dict__, __slots__); [] for opaque objects."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [getattr(obj, f.name, None) for f in dataclasses.fields(obj)]
    out: list[Any] = []
    d = getattr(obj, "__dict__", None)
    if isinstance(d, dict):
        out.extend(d.values())
    for cls in type(obj).__mro__:
        names = cls.__dict__.get("__slots__", ())
        for name in (names,) if isinstance(names, str) else names:
            if name not in ("__dict__", "__weakref__") and hasattr(obj, name):
                out.append(getattr(obj, name))
    return out


def shallow_tensors(obj: Any) -> list[torch.Tensor]:
    """Tensors directly held by a frame value (itself, its attributes, tensors in list/tuple attributes)."""
    if obj is None:
        return []
    if isinstance(obj, torch.Tensor):
        return [obj]
    out: list[torch.Tensor] = []
    for v in _shallow_attrs(obj):
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            out.extend(x for x in v if isinstance(x, torch.Tensor))
    return out


class ArgumentBinder:
    """Turns a boundary's DIRECT arguments into replay templates (binding is deliberately shallow).

    frame: name -> the start-up request's frame value; matched by identity -> `_FrameValueRef(name)`.
    request_owned: frame names whose tensors are request-lifetime (their tensors, and
        objects nesting frame values, are rejected instead of being captured by address).
    device: CUDA tensors on this device type become non-owning views; host tensors are rejected.
    """

    def __init__(self, frame: Mapping[str, Any], request_owned: Sequence[str], device: torch.device):
        self.device = torch.device(device)
        self._keep: list[Any] = [v for v in frame.values()]  # ids stay valid while building
        self._frame_ids = {id(v): n for n, v in frame.items() if v is not None and not _is_scalar(v)}
        self._request_ids: set[int] = set()
        self._request_ptrs: set[int] = set()
        for name in request_owned:
            for t in shallow_tensors(frame.get(name)):
                self._request_ids.add(id(t))
                if t.numel():
                    self._request_ptrs.add(storage_ptr(t))
        self._keep.extend(t for n in request_owned for t in shallow_tensors(frame.get(n)))
        self._bridge_ids: dict[int, torch.Tensor] = {}
        self._slot_leaves: dict[int, tuple[int, tuple]] = {}
        self._slot_ptrs: set[int] = set()

    # -- registration
    def add_bridge(self, t: torch.Tensor) -> None:
        self._bridge_ids[id(t)] = t

    def add_slot(self, slot: int, value: Any) -> None:
        self._keep.append(value)

        def walk(v: Any, path: tuple, depth: int) -> None:
            if _is_scalar(v):
                return
            self._slot_leaves.setdefault(id(v), (slot, path))
            if isinstance(v, torch.Tensor):
                if v.numel():
                    self._slot_ptrs.add(storage_ptr(v))
            elif depth < 2 and isinstance(v, (tuple, list)):
                for i, x in enumerate(v):
                    walk(x, path + (i,), depth + 1)
            elif depth < 2 and isinstance(v, dict):
                for k, x in v.items():
                    walk(x, path + (k,), depth + 1)

        walk(value, (), 0)

    def request_tensor_ids(self) -> set[int]:
        return set(self._request_ids)

    def slot_leaf_ids(self) -> set[int]:
        return {i for i, (s, p) in self._slot_leaves.items()}

    def is_slot_leaf(self, v: Any) -> bool:
        return id(v) in self._slot_leaves

    def is_bridge(self, t: Any) -> bool:
        return id(t) in self._bridge_ids

    def frame_name(self, v: Any) -> Optional[str]:
        return self._frame_ids.get(id(v))

    # -- templates
    def template(self, value: Any, depth: int = 0) -> Any:
        if _is_scalar(value):
            return _Const(value)
        name = self._frame_ids.get(id(value))
        if name is not None:
            if depth:
                raise NestedRequestObjectError(
                    f"request frame value {name!r} is nested inside a container argument; pass it as a direct "
                    "boundary argument (binding is shallow)"
                )
            return _FrameValueRef(name)
        slot = self._slot_leaves.get(id(value))
        if slot is not None:
            return _EagerSlotRef(*slot)
        if isinstance(value, torch.Tensor):
            return self._tensor(value)
        if isinstance(value, (tuple, list)):
            return _SeqTemplate(type(value), [self.template(x, depth + 1) for x in value])
        if isinstance(value, dict):
            return _DictTemplate(type(value), {k: self.template(x, depth + 1) for k, x in value.items()})
        if isinstance(value, (torch.nn.Module, type, types.FunctionType, types.BuiltinFunctionType)):
            return _Const(value)
        if isinstance(value, types.MethodType):
            self._scan(value.__self__, f"the object bound to {value.__qualname__}")
            return _Const(value)
        if isinstance(value, functools.partial):
            for x in list(value.args) + list(value.keywords.values()):
                self._check_not_request(x, "a functools.partial argument")
            return _Const(value)
        self._scan(value, f"a {type(value).__name__} argument")
        return _Const(value)

    def _tensor(self, t: torch.Tensor) -> Any:
        if id(t) in self._bridge_ids:
            return _TensorRef(t)  # plan/pool-owned bridge
        ptr = storage_ptr(t) if t.numel() else None
        if id(t) in self._request_ids or (ptr is not None and ptr in self._request_ptrs):
            raise NestedRequestObjectError(
                "a boundary argument is (a view of) a tensor owned by the start-up request's frame "
                f"{tuple(self._frame_ids.values())}; pass the frame value itself (e.g. attn_metadata)"
            )
        if ptr is not None and ptr in self._slot_ptrs:
            raise UnsupportedBoundaryArgument(
                "a boundary argument is derived from an eager-only result; pass the eager-only result itself"
            )
        if t.device.type != self.device.type:
            raise UnsupportedBoundaryArgument(
                f"a boundary argument is a {t.device.type} tensor; host tensors are request data the plan cannot "
                "re-bind (keep them inside attn_metadata)"
            )
        return _TensorRef(make_weak_view(t))

    def _check_not_request(self, v: Any, where: str) -> None:
        if id(v) in self._frame_ids:
            raise NestedRequestObjectError(
                f"request frame value {self._frame_ids[id(v)]!r} is held by {where}; pass it as a direct argument"
            )
        if isinstance(v, torch.Tensor) and (
            id(v) in self._request_ids or (v.numel() and storage_ptr(v) in self._request_ptrs)
        ):
            raise NestedRequestObjectError(f"{where} holds a tensor of the start-up request's frame")

    def _scan(self, obj: Any, where: str) -> None:
        for v in _shallow_attrs(obj):
            self._check_not_request(v, where)
            if isinstance(v, (list, tuple)):
                for x in v:
                    self._check_not_request(x, where)
