"""Placement of rank actors: one placement-group bundle per rank, ranks ordered by (node, GPU).

Bundles are `{"GPU": 1, "CPU": 1}` (or `{"CPU": 1}` on a cluster without GPUs), strategy
PACK (fill a node before the next: TP groups stay inside NVLink domains). Actors may land
on bundles in any order, so after they start each one reports its node id and GPU id
and `order_ranks` sorts them: rank r = r-th actor by (node id, GPU id, bundle index).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy


class PlacementError(RuntimeError):
    """The cluster cannot hold the rank group (not enough GPUs/CPUs), or placement timed out."""


@dataclass(frozen=True)
class ActorPlace:
    """What a started actor reports about where it runs."""

    bundle: int
    node_id: str
    node_ip: str
    gpu_ids: tuple[str, ...]
    pid: int
    # wall-clock (time.time) moments of the actor's start: "constructing" / "constructed" (the actor's __init__),
    # "torch" (its torch import done); for start-up reports
    started: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def gpu_sort_key(self) -> int:
        ids = [int(g) for g in self.gpu_ids if str(g).isdigit()]
        return min(ids) if ids else -1


def cluster_has_gpus() -> bool:
    return float(ray.cluster_resources().get("GPU", 0)) >= 1


def bundles_for(world: int, use_gpu: bool) -> list[dict[str, float]]:
    return [({"GPU": 1, "CPU": 1} if use_gpu else {"CPU": 1}) for _ in range(world)]


def create_placement_group(world: int, use_gpu: bool, timeout_s: float = 60.0) -> PlacementGroup:
    """Reserve one bundle per rank (PACK); raises PlacementError naming what is missing."""
    bundles = bundles_for(world, use_gpu)
    need = {k: sum(b[k] for b in bundles) for k in bundles[0]}
    have = ray.cluster_resources()
    short = {k: (v, float(have.get(k, 0))) for k, v in need.items() if float(have.get(k, 0)) < v}
    if short:
        raise PlacementError(
            "the Ray cluster cannot hold the rank group: "
            + ", ".join(f"{k}: need {v:g}, cluster has {h:g}" for k, (v, h) in short.items()))
    pg = placement_group(bundles, strategy="PACK", name="")
    t0 = time.monotonic()
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(pg)
        raise PlacementError(f"placement group of {world} bundles {bundles[0]} not ready after {timeout_s:.0f}s "
                             f"(resources busy?) [{time.monotonic() - t0:.1f}s]")
    return pg


def bundle_strategy(pg: PlacementGroup, bundle: int) -> PlacementGroupSchedulingStrategy:
    return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=bundle,
                                            placement_group_capture_child_tasks=False)


def remove_group(pg: Optional[PlacementGroup]) -> None:
    if pg is None:
        return
    try:
        remove_placement_group(pg)
    except Exception:  # noqa: BLE001 - already removed / cluster gone
        pass


def order_ranks(places: Sequence[ActorPlace]) -> list[int]:
    """Actor indices in rank order: by node id, then GPU id, then bundle index."""
    return sorted(range(len(places)), key=lambda i: (places[i].node_id, places[i].gpu_sort_key, places[i].bundle))


def describe_places(places: Sequence[ActorPlace], order: Sequence[int]) -> list[dict[str, Any]]:
    return [{"rank": r, "bundle": places[i].bundle, "node_id": places[i].node_id, "node_ip": places[i].node_ip,
             "gpu_ids": list(places[i].gpu_ids), "pid": places[i].pid} for r, i in enumerate(order)]
