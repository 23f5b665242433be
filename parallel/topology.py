"""Rank layout of a deployment: `world = dp * tp`, experts sharded over `ep` ranks (1 or world).

Global rank `r = dp_rank * tp + tp_rank`: the ranks of one tensor-parallel group are
contiguous (one node, NVLink). With expert parallelism the EP group is every rank
and `ep_rank == r`. Pure data, no torch.distributed: the coordinator, the workers and
the unit tests share it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


class TopologyError(ValueError):
    """A (world, tp, dp, ep) combination that cannot be laid out."""


@dataclass(frozen=True)
class RankCoords:
    """Where one global rank sits: its DP group, its place in that group's TP group, its EP rank."""

    rank: int
    dp_rank: int
    tp_rank: int
    ep_rank: int


@dataclass(frozen=True)
class Topology:
    world: int
    tp: int = 1
    dp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "dp", "ep", "world"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise TopologyError(f"{name} must be an int >= 1, got {v!r}")
        if self.world != self.tp * self.dp:
            raise TopologyError(f"world size {self.world} != tp {self.tp} * dp {self.dp}")
        if self.ep not in (1, self.world):
            raise TopologyError(
                f"ep must be 1 (no expert parallelism) or the world size {self.world} "
                f"(experts sharded over every rank), got {self.ep}"
            )

    @staticmethod
    def of(tp: int = 1, dp: int = 1, ep: int = 1) -> "Topology":
        """The topology of `tp * dp` ranks (world size derived)."""
        ok = all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in (tp, dp))
        return Topology(world=tp * dp if ok else 1, tp=tp, dp=dp, ep=ep)  # bad tp/dp: TopologyError names it

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def collectives_cross_dp(self) -> bool:
        """True when some collective spans DP groups (EP), so DP ranks must agree on each step's phase."""
        return self.ep_enabled and self.dp > 1

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world:
            raise TopologyError(f"rank {rank} outside world size {self.world}")

    def coords(self, rank: int) -> RankCoords:
        self._check_rank(rank)
        dp_rank, tp_rank = divmod(rank, self.tp)
        return RankCoords(rank=rank, dp_rank=dp_rank, tp_rank=tp_rank, ep_rank=rank if self.ep_enabled else 0)

    def rank_of(self, dp_rank: int, tp_rank: int) -> int:
        if not (0 <= dp_rank < self.dp and 0 <= tp_rank < self.tp):
            raise TopologyError(f"(dp_rank {dp_rank}, tp_rank {tp_rank}) outside dp {self.dp} x tp {self.tp}")
        return dp_rank * self.tp + tp_rank

    def tp_groups(self) -> list[list[int]]:
        """The rank list of every TP group, indexed by DP rank."""
        return [[d * self.tp + t for t in range(self.tp)] for d in range(self.dp)]

    def tp_group_of(self, rank: int) -> list[int]:
        return self.tp_groups()[self.coords(rank).dp_rank]

    def ep_group(self) -> Optional[list[int]]:
        """The EP group's ranks (every rank), or None without expert parallelism."""
        return list(range(self.world)) if self.ep_enabled else None

    def dp_leaders(self) -> list[int]:
        """The TP-rank-0 of each DP group (whose step result the coordinator returns)."""
        return [d * self.tp for d in range(self.dp)]

    def describe(self) -> str:
        return f"world={self.world} (tp={self.tp} x dp={self.dp}), ep={self.ep}"
