"""The per-rank parallel context handed to model layers: ranks, sizes and process groups.

Lifetime: one rank's runtime; the groups it names are owned by `parallel.groups`
and destroyed with them. A default `ParallelContext()` is a single rank.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class ParallelContext:
    """tp_*: tensor parallel (attention, dense MLP, vocab); ep_*: expert parallel (MoE experts);
    dp_*: data parallel index of this rank's attention group. Groups are torch.distributed
    ProcessGroups (None for a single rank). `ep_dispatcher` is the MoE token dispatcher."""

    tp_rank: int = 0
    tp_size: int = 1
    tp_group: Optional[Any] = None
    ep_rank: int = 0
    ep_size: int = 1
    ep_group: Optional[Any] = None
    dp_rank: int = 0
    dp_size: int = 1
    ep_dispatcher: Optional[Any] = None

    def __post_init__(self) -> None:
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} outside tp_size {self.tp_size}")
        if not 0 <= self.ep_rank < self.ep_size:
            raise ValueError(f"ep_rank {self.ep_rank} outside ep_size {self.ep_size}")
