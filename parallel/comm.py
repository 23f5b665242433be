"""Collectives used inside model layers. On NCCL they are capturable in CUDA graphs
(no host synchronisation, fixed shapes); on gloo (CPU tests) the same code runs eagerly.
A `None` group or a group of one rank makes every op the identity.

Fast all-reduce registry: `RankGroups` may register a faster all-reduce for a group
(`parallel.symm_allreduce.SymmMemAllReduce`: one-shot over NVLink for small tensors).
`all_reduce` asks it first (`can_reduce(x)`) and falls back to NCCL / gloo. The registry is
per-process state (one entry per live group, keyed by the group object's identity), written
only by `RankGroups.init()` / `destroy()`; its decisions must be the same on every rank of
the group for the same tensor shape, dtype and layout (the implementation guarantees it).
"""
from __future__ import annotations

from typing import Any, Optional, Protocol

import torch
import torch.distributed as dist


class FastAllReduce(Protocol):
    """What `register_fast_all_reduce` accepts."""

    def can_reduce(self, x: torch.Tensor) -> bool: ...

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor: ...


_FAST: dict[int, tuple[Any, FastAllReduce]] = {}  # id(group) -> (group, impl); the group is kept alive


def register_fast_all_reduce(group: Optional[Any], impl: FastAllReduce) -> None:
    """Route `all_reduce(x, group)` to `impl.all_reduce(x)` whenever `impl.can_reduce(x)` (replaces any previous)."""
    if not (callable(getattr(impl, "can_reduce", None)) and callable(getattr(impl, "all_reduce", None))):
        raise TypeError(f"{type(impl).__name__} lacks can_reduce(x) / all_reduce(x)")
    _FAST[id(group)] = (group, impl)


def clear_fast_all_reduce(group: Optional[Any]) -> Optional[FastAllReduce]:
    """Forget the fast implementation of `group`; returns it (the caller closes it) or None."""
    entry = _FAST.get(id(group))
    if entry is None or entry[0] is not group:
        return None
    del _FAST[id(group)]
    return entry[1]


def fast_all_reduce(group: Optional[Any]) -> Optional[FastAllReduce]:
    """The fast implementation registered for `group`, if any."""
    entry = _FAST.get(id(group))
    return entry[1] if entry is not None and entry[0] is group else None


def group_size(group: Optional[Any]) -> int:
    return 1 if group is None else dist.get_world_size(group)


def all_reduce(x: torch.Tensor, group: Optional[Any]) -> torch.Tensor:
    """Sum `x` over `group` and return the sum. Callers must use the RETURNED tensor.

    A registered fast implementation that accepts `x` returns a new tensor and leaves `x`
    as it was; otherwise NCCL / gloo sum `x` in place and `x` itself is returned. A
    registered implementation is asked before the group-of-one shortcut.
    """
    if _FAST:
        impl = fast_all_reduce(group)
        if impl is not None and impl.can_reduce(x):
            return impl.all_reduce(x)
    if group_size(group) == 1:
        return x
    dist.all_reduce(x, group=group)
    return x


def all_reduce_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                            group: Optional[Any], add_rms_norm: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(s) * weight, s) for s = all_reduce(x) + residual; x, residual `[T, H]`, weight `[H]`.

    One kernel when the group's fast implementation fuses it (`can_fuse_add_rms_norm`, the same decision on
    every rank for the same shapes and dtypes); otherwise `all_reduce` then `add_rms_norm(y, residual)`, the
    caller's `(y, residual) -> (normed, sum)` operator.
    """
    if _FAST:
        impl = fast_all_reduce(group)
        fuse = getattr(impl, "can_fuse_add_rms_norm", None)
        if fuse is not None and fuse(x, residual, weight):
            return impl.all_reduce_add_rms_norm(x, residual, weight, eps)
    return add_rms_norm(all_reduce(x, group), residual)


def all_gather(x: torch.Tensor, group: Optional[Any], dim: int = 0) -> torch.Tensor:
    """Concatenate equal-shaped `x` from every rank of `group` along `dim` (rank order)."""
    n = group_size(group)
    if n == 1:
        return x
    x = x.contiguous()
    if x.is_cuda:
        out = torch.empty((n * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(out, x, group=group)
        if dim != 0:
            out = torch.cat(out.chunk(n, dim=0), dim=dim)
        return out
    parts = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=dim)


def reduce_scatter(x: torch.Tensor, group: Optional[Any]) -> torch.Tensor:
    """Sum `x` `[n * m, ...]` over `group` and return this rank's `[m, ...]` slice."""
    n = group_size(group)
    if n == 1:
        return x
    x = x.contiguous()
    m = x.shape[0] // n
    if x.is_cuda:
        out = torch.empty((m, *x.shape[1:]), dtype=x.dtype, device=x.device)
        dist.reduce_scatter_tensor(out, x, group=group)
        return out
    dist.all_reduce(x, group=group)  # gloo has no reduce_scatter_tensor
    r = dist.get_rank(group)
    return x[r * m : (r + 1) * m].clone()
