"""One rank's process groups: created with a timeout, destroyed cleanly, turned into a `ParallelContext`.

Rendezvous: rank 0 serves a `TCPStore` on port 0 (the OS picks a free port, so no port
races) and reports `(host, port)`; every other rank connects to it. Backend: NCCL when
the rank's device is CUDA, gloo on CPU (CI runs the same code on CPU).

Groups, created in the same order on every rank (torch.distributed requires it):
- the default (world) group: NCCL / gloo; it is also the EP group (ep == world).
- control: a gloo group over every rank, for barriers (`monitored_barrier` names a
  rank that does not arrive) and host-side handshakes.
- one TP group per DP rank (only when tp > 1).
Every group carries `timeout=collective_timeout`. Lifetime: `init()` .. `destroy()`
(idempotent); the coordinator tears whole processes down after a failure, because NCCL
communicators cannot be repaired.
"""
from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

from parallel.context import ParallelContext
from parallel.dispatch import make_dispatcher
from parallel.topology import RankCoords, Topology


class GroupsError(RuntimeError):
    """Process-group creation or teardown failed, or groups were used before `init()`."""


@dataclass(frozen=True)
class Rendezvous:
    """Where rank 0's TCPStore listens."""

    host: str
    port: int


def default_host() -> str:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def serve_rendezvous(world: int, timeout_s: float, host: Optional[str] = None) -> tuple[Any, Rendezvous]:
    """Rank 0: start the TCPStore server on port 0; returns (store, where it listens). Keep the store alive."""
    store = dist.TCPStore(host or "0.0.0.0", 0, world, is_master=True, timeout=timedelta(seconds=timeout_s),
                          wait_for_workers=False)
    return store, Rendezvous(host or default_host(), int(store.port))


class RankGroups:
    """Owns one rank's process groups and EP dispatcher (lifetime: `init()` .. `destroy()`)."""

    def __init__(self, topo: Topology, rank: int, device: torch.device, timeout_s: float):
        self.topo = topo
        self.coords: RankCoords = topo.coords(rank)
        self.device = device
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        self.timeout = timedelta(seconds=timeout_s)
        self.tp_group: Optional[Any] = None
        self.ep_group: Optional[Any] = None
        self.control: Optional[Any] = None
        self.dispatcher: Optional[Any] = None
        self._store: Optional[Any] = None
        self._initialized = False
        self._destroyed = False

    @property
    def rank(self) -> int:
        return self.coords.rank

    def init(self, rendezvous: Rendezvous, store: Optional[Any] = None) -> None:
        """Join the world (blocks until every rank joined or the timeout passes) and create the groups."""
        if self._initialized:
            raise GroupsError("process groups are already initialised in this process")
        if dist.is_initialized():
            raise GroupsError("torch.distributed is already initialised by someone else in this process")
        world = self.topo.world
        if store is None:
            store = dist.TCPStore(rendezvous.host, rendezvous.port, world, is_master=False, timeout=self.timeout)
        self._store = store
        kwargs: dict[str, Any] = dict(backend=self.backend, store=store, rank=self.rank, world_size=world,
                                      timeout=self.timeout)
        if self.device.type == "cuda":
            kwargs["device_id"] = self.device  # eager NCCL init: no communicator is created inside a capture
        dist.init_process_group(**kwargs)
        self._initialized = True
        self.control = dist.new_group(list(range(world)), backend="gloo", timeout=self.timeout)
        if self.topo.tp > 1:
            for ranks in self.topo.tp_groups():
                g = dist.new_group(ranks, timeout=self.timeout)
                if self.rank in ranks:
                    self.tp_group = g
        if self.topo.ep_enabled:
            self.ep_group = dist.group.WORLD
        self._warm_up()
        self.barrier()

    def _warm_up(self) -> None:
        """One small collective per device group, so communicators exist before any graph capture."""
        x = torch.ones(1, device=self.device)
        for g in (self.tp_group, self.ep_group):
            if g is not None:
                dist.all_reduce(x, group=g)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def barrier(self) -> None:
        """Every rank arrives or a `RuntimeError` names a missing rank after the timeout (gloo)."""
        self._require()
        dist.monitored_barrier(group=self.control, timeout=self.timeout)

    def build_context(self, ep_backend: str = "allgather", model_config: Any = None,
                      max_decode_tokens: int = 0) -> ParallelContext:
        """The `ParallelContext` handed to the model (with the EP dispatcher when ep > 1)."""
        self._require()
        c, t = self.coords, self.topo
        if t.ep_enabled and self.dispatcher is None:
            self.dispatcher = make_dispatcher(
                ep_backend, ep_group=self.ep_group, ep_size=t.ep, ep_rank=c.ep_rank, tp_group=self.tp_group,
                tp_size=t.tp, tp_rank=c.tp_rank, dp_size=t.dp, model_config=model_config,
                max_decode_tokens=max_decode_tokens, barrier_group=self.control)
        return ParallelContext(tp_rank=c.tp_rank, tp_size=t.tp, tp_group=self.tp_group, ep_rank=c.ep_rank,
                               ep_size=t.ep, ep_group=self.ep_group, dp_rank=c.dp_rank, dp_size=t.dp,
                               ep_dispatcher=self.dispatcher)

    def destroy(self) -> None:
        """Destroy the dispatcher's buffers and every group (all ranks call it together). Idempotent."""
        if self._destroyed or not self._initialized:
            self._destroyed = True
            return
        self._destroyed = True
        try:
            if self.dispatcher is not None:
                self.dispatcher.destroy()
        finally:
            self.dispatcher = None
            self.tp_group = self.ep_group = self.control = None
            if dist.is_initialized():
                dist.destroy_process_group()
            self._store = None

    def _require(self) -> None:
        if not self._initialized or self._destroyed:
            raise GroupsError("process groups are not initialised (call init() first) or were destroyed")
