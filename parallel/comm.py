"""Collectives used inside model layers. On NCCL they are capturable in CUDA graphs
(no host synchronisation, fixed shapes); on gloo (CPU tests) the same code runs eagerly.
A `None` group or a group of one rank makes every op the identity."""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist


def group_size(group: Optional[Any]) -> int:
    return 1 if group is None else dist.get_world_size(group)


def all_reduce(x: torch.Tensor, group: Optional[Any]) -> torch.Tensor:
    """Sum `x` over `group` in place and return it."""
    if group_size(group) == 1:
        return x
    dist.all_reduce(x, group=group)
    return x


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
