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

Options: `CommOptions` (`parallel.options`, from the deployment config) says how to communicate. Right after the
control group exists, before any other group and any device collective, every rank all-gathers its options record
(its `CommOptions` plus whatever the caller adds, e.g. the kernel options) over the gloo control group and every
rank raises `OptionsMismatchError` naming the differing fields and ranks when they disagree.

TP all-reduce: with NCCL and tp > 1, `init()` tries the symmetric-memory one-shot
all-reduce (`parallel.symm_setup`) for the TP group and registers it in `parallel.comm`
(small tensors take it, larger ones NCCL). `CommOptions.tp_allreduce` (`GRAPHLINE_TP_ALLREDUCE`)
picks: `auto` (symmetric memory when available), `nccl` (never), `symm` (required:
`GroupsError` with the reason when unavailable). `tp_allreduce_impl` records the outcome
("symm_mem_one_shot", "nccl", "gloo", or "none" when tp == 1) and `tp_allreduce_reason` why.
"""
from __future__ import annotations

import logging
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Mapping, Optional

import torch
import torch.distributed as dist

from parallel import comm
from parallel.context import ParallelContext
from parallel.dispatch import make_dispatcher
from parallel.options import TP_ALLREDUCE_ENV, CommOptions, OptionsMismatchError, check_same_options, options_record
from parallel.symm_allreduce import IMPL_NAME as SYMM_IMPL_NAME
from parallel.symm_allreduce import SymmMemAllReduce
from parallel.symm_setup import try_create_for_group
from parallel.topology import RankCoords, Topology

log = logging.getLogger(__name__)


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

    def __init__(self, topo: Topology, rank: int, device: torch.device, timeout_s: float,
                 options: Optional[CommOptions] = None, fused_probe: Optional[tuple[int, torch.dtype]] = None,
                 before_tp_setup: Optional[Callable[[], None]] = None,
                 check_options: Optional[Mapping[str, Any]] = None):
        """`options`: the deployment's communication options (None: the defaults). `fused_probe`: (hidden size,
        dtype) of the model these groups serve, which the fused TP all-reduce + RMSNorm is probed (and compiled)
        for (`try_create_for_group`); None: every dtype, hidden 1024. `before_tp_setup`: called right before the
        TP all-reduce set-up (to wait for a compile of its kernel on another thread, `actors.kernel_warm_up`).
        `check_options`: more frozen option objects by name (e.g. {"kernels": KernelOptions}) that `init`
        cross-checks over every rank with `options`."""
        self.topo = topo
        self.coords: RankCoords = topo.coords(rank)
        self.device = device
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        self.timeout = timedelta(seconds=timeout_s)
        self.tp_group: Optional[Any] = None
        self.ep_group: Optional[Any] = None
        self.control: Optional[Any] = None
        self.dispatcher: Optional[Any] = None
        self.options = options if options is not None else CommOptions()
        self.tp_allreduce_mode = self.options.tp_allreduce
        self.tp_fused_kind = self.options.tp_fused_kind
        self._check_record = options_record(comm=self.options, **dict(check_options or {}))
        self.fused_probe = fused_probe
        self._before_tp_setup = before_tp_setup
        self.tp_allreduce_impl = "none"
        self.tp_allreduce_reason = "not initialised"
        self._tp_fast: Optional[SymmMemAllReduce] = None
        self._store: Optional[Any] = None
        # seconds per `init` phase and per symmetric-memory set-up stage (within tp_allreduce_setup_s), for start-up
        # reports
        self.timings: dict[str, float] = {}
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
        t0 = time.perf_counter()
        if store is None:
            store = dist.TCPStore(rendezvous.host, rendezvous.port, world, is_master=False, timeout=self.timeout)
        self._store = store
        kwargs: dict[str, Any] = dict(backend=self.backend, store=store, rank=self.rank, world_size=world,
                                      timeout=self.timeout)
        if self.device.type == "cuda":
            kwargs["device_id"] = self.device  # eager NCCL init: no communicator is created inside a capture
        dist.init_process_group(**kwargs)
        self._initialized = True
        t1 = time.perf_counter()
        self.control = dist.new_group(list(range(world)), backend="gloo", timeout=self.timeout)
        try:
            check_same_options(self.control, self._check_record)  # before any device group or collective
        except OptionsMismatchError:
            self.destroy()  # every rank saw the same records, so all of them raise here
            raise
        if self.topo.tp > 1:
            for ranks in self.topo.tp_groups():
                g = dist.new_group(ranks, timeout=self.timeout)
                if self.rank in ranks:
                    self.tp_group = g
        if self.topo.ep_enabled:
            self.ep_group = dist.group.WORLD
        t2 = time.perf_counter()
        self._warm_up()
        t_wait = time.perf_counter()
        if self._before_tp_setup is not None and self.tp_group is not None:
            self._before_tp_setup()
        t3 = time.perf_counter()
        try:
            self._setup_tp_allreduce()
        except GroupsError:
            self.destroy()  # every TP rank reaches the same verdict, so all of them raise here
            raise
        t4 = time.perf_counter()
        self.barrier()
        self.timings.update({"init_process_group_s": t1 - t0, "new_groups_s": t2 - t1,
                             "collective_warm_up_s": t_wait - t2, "wait_compile_s": t3 - t_wait,
                             "tp_allreduce_setup_s": t4 - t3, "barrier_s": time.perf_counter() - t4})

    def _warm_up(self) -> None:
        """One small collective per device group, so communicators exist before any graph capture."""
        x = torch.ones(1, device=self.device)
        for g in (self.tp_group, self.ep_group):
            if g is not None:
                dist.all_reduce(x, group=g)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _setup_tp_allreduce(self) -> None:
        """Pick the TP all-reduce (collective over the TP group; after the warm-up, before any capture)."""
        if self.tp_group is None:
            self.tp_allreduce_impl, self.tp_allreduce_reason = "none", "tp == 1: no TP all-reduce"
            return
        if self.backend != "nccl":
            if self.tp_allreduce_mode == "symm":
                raise GroupsError(f"{TP_ALLREDUCE_ENV}=symm but the backend is {self.backend} (CPU): "
                                  "symmetric memory needs CUDA + NCCL")
            self.tp_allreduce_impl, self.tp_allreduce_reason = self.backend, f"{self.backend} backend"
            return
        if self.tp_allreduce_mode == "nccl":
            self.tp_allreduce_impl, self.tp_allreduce_reason = "nccl", f"{TP_ALLREDUCE_ENV}=nccl"
            return
        impl, why = try_create_for_group(self.tp_group, self.device, fused_kind=self.tp_fused_kind,
                                         fused_norm=self.options.tp_fused_norm, fused_probe=self.fused_probe,
                                         timings=self.timings)
        if impl is None:
            if self.tp_allreduce_mode == "symm":
                raise GroupsError(f"{TP_ALLREDUCE_ENV}=symm but the symmetric-memory all-reduce is "
                                  f"unavailable: {why}")
            log.warning("rank %d: TP all-reduce falls back to NCCL: %s", self.rank, why)
            self.tp_allreduce_impl, self.tp_allreduce_reason = "nccl", f"symmetric memory unavailable: {why}"
            return
        comm.register_fast_all_reduce(self.tp_group, impl)
        self._tp_fast = impl
        self.tp_allreduce_impl, self.tp_allreduce_reason = SYMM_IMPL_NAME, why

    def tp_allreduce_info(self) -> dict[str, Any]:
        """What the TP all-reduce uses, for status pages."""
        info: dict[str, Any] = {"impl": self.tp_allreduce_impl, "mode": self.tp_allreduce_mode,
                                "reason": self.tp_allreduce_reason}
        if self._tp_fast is not None:
            info["max_bytes"] = self._tp_fast.max_bytes
        return info

    def _drop_tp_allreduce(self) -> None:
        """Unregister and free the fast TP all-reduce (never raises)."""
        impl, self._tp_fast = self._tp_fast, None
        if impl is None:
            return
        try:
            comm.clear_fast_all_reduce(self.tp_group)
            impl.close()
        except Exception as e:  # noqa: BLE001 - teardown must go on
            log.warning("rank %d: closing the symmetric-memory all-reduce failed: %s", self.rank, e)

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
                max_decode_tokens=max_decode_tokens, barrier_group=self.control,
                deepep_max_tokens_per_rank=self.options.deepep_max_tokens_per_rank)
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
            self._drop_tp_allreduce()
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
