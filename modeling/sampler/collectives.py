"""The few collectives the sampler needs under TP (each rank holds one vocabulary shard). NCCL: capturable;
gloo (CPU tests): eager. A `None` group or a group of one rank makes every op the identity.

Only small tensors cross ranks: per-row statistics, histograms `[B, 2048]` int64 and per-chunk candidates,
never logits. Sums are of integers and gathers are combined in rank order, so every rank computes the same
bits."""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist


class ShardGroup:
    """Wraps the TP group of the vocabulary shards."""

    def __init__(self, group: Optional[Any]) -> None:
        self.group = group
        self.size = 1 if group is None else dist.get_world_size(group)

    def sum_(self, x: torch.Tensor) -> torch.Tensor:
        """In-place integer sum over the ranks; returns x."""
        if self.size > 1:
            dist.all_reduce(x, op=dist.ReduceOp.SUM, group=self.group)
        return x

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """x `[...]` (contiguous) -> `[size, ...]` in rank order (x itself viewed `[1, ...]` without TP)."""
        x = x.contiguous()
        if self.size == 1:
            return x.unsqueeze(0)
        if x.is_cuda:
            out = torch.empty((self.size, *x.shape), dtype=x.dtype, device=x.device)
            dist.all_gather_into_tensor(out.view(-1), x.view(-1), group=self.group)
            return out
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.stack(parts)
