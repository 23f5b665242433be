"""`Coordinator`: the driver-side owner of a deployment's rank group (the engine programs against it).

start():  Ray (init or connect) -> placement group + one `RankWorker` per rank, ranks ordered
          by (node, GPU) -> process groups (rank 0 serves the TCPStore on port 0) -> weights
          -> KV cache (min over ranks of each rank's budget) -> runners -> lock-step capture:
          every rank captures the same decode buckets, then the same piecewise token
          buckets, in the same order, one bucket at a time (all ranks, then the next), with
          a progress bar and per-bucket timing. A failure on any rank resets every rank
          (nothing published) and raises StartupCaptureError.
step():   decides the global phase (`actors.protocol.plan_step`), fans the plan out, returns
          the TP-rank-0 tokens per DP rank. Failures (dead or hung rank, an exception in a
          rank) tear the whole group down and raise RankFailureError; `rebuild()` restarts.
submit() / collect(): the two halves of step(). Up to `MAX_IN_FLIGHT` steps may be submitted
          before the oldest is collected; a later step's token ids may refer to the previous
          step's tokens (`actors.batch.prev_token`), which the ranks fill in on the device. On
          the pipe path each rank launches a step when its request arrives, so the device runs
          step k+1 while the driver handles step k's tokens (other paths run at submit).
reset():  drain (in-flight steps finish; their tickets keep the tokens), then every rank: runner.reset() (graphs, plans) -> DeepEP buffer -> barrier; then
          optional weight reload / KV resize and re-capture.
Options: `DeploymentConfig.comm` (`CommOptions`) and `.runtime.kernels` (`KernelOptions`) travel to every rank,
which cross-check them before any collective; `.driver` (`DriverOptions`) is the driver's own. None is read from
the environment here: `launch/` builds them once (`actors.environment.options_from_environ`).
Step paths (`DeploymentConfig.step_path`, or `DriverOptions.step_path` / `GRAPHLINE_STEP_PATH` which overrides it):
- pipe: packed frames through per-rank named pipes to a resident loop in every rank
  (`actors.pipes`); the default when every rank runs on the driver's host;
- compiled: a Ray compiled graph; the default on multi-host GPU clusters without tensor parallelism;
- plain: one actor call per rank per step; the default on multi-host CPU clusters (compiled-graph
  actors poll their input channel, which costs a core per rank) and for TP > 1 on GPUs across hosts
  (TP ranks see every GPU of their node for the symmetric-memory all-reduce, and Ray's compiled graphs
  need per-actor CUDA_VISIBLE_DEVICES).
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, cast

import numpy as np

from actors.batch import BatchError, StepBatch
from actors.coordinator_health import CoordinatorHealth
from actors.coordinator_lifecycle import CoordinatorLifecycle
from actors.coordinator_paths import CoordinatorStepPaths
from actors.deepep_config import check_deepep_deployment
from actors.errors import CoordinatorStateError, RankFailureError, StartupCaptureError
from actors.options import STEP_PATHS, DriverOptions
from actors.protocol import PipelinedStepper, Stepper, plan_step, with_arm_next
from actors.rank import RuntimeConfig
from actors.rankset import RankCallError, RankFault, RankSet
from actors.watch import RankWatcher
from actors.startup import capture_all, launch_ranks
from parallel.dispatch import KINDS
from parallel.options import CommOptions
from parallel.topology import Topology

MAX_IN_FLIGHT = 2  # submitted and not yet collected steps: one on the device, one queued behind it

__all__ = ["DeploymentConfig", "Coordinator", "StepTicket", "RankFailureError", "StartupCaptureError", "CoordinatorStateError"]


@dataclass(frozen=True)
class DeploymentConfig:
    runtime: RuntimeConfig = RuntimeConfig()
    tp: int = 1
    dp: int = 1
    ep: int = 1
    ep_backend: str = "allgather"  # or "deepep"
    address: Optional[str] = None  # existing Ray cluster; None = ray.init locally
    num_cpus: Optional[int] = None  # for a local ray.init
    use_gpu: Optional[bool] = None  # None = auto (GPUs present)
    collective_timeout_s: float = 60.0
    step_timeout_s: float = 30.0
    step_path: str = "auto"  # auto | pipe | compiled | plain
    comm: CommOptions = CommOptions()  # sent to every rank
    driver: DriverOptions = DriverOptions()  # the driver's own (tracing reaches the ranks' step loops)

    def __post_init__(self) -> None:
        if self.step_path not in STEP_PATHS:
            raise ValueError(f"step_path must be one of {STEP_PATHS}, got {self.step_path!r}")
        Topology.of(tp=self.tp, dp=self.dp, ep=self.ep)  # TopologyError names the bad field
        if self.ep_backend not in KINDS:
            raise ValueError(f"ep_backend must be one of {KINDS}, got {self.ep_backend!r}")
        if self.ep_backend == "deepep" and self.ep > 1:  # DeepEPConfigError (a ValueError) before any rank starts
            check_deepep_deployment(self.runtime, tp=self.tp, ep=self.ep, use_gpu=self.use_gpu,
                                    max_tokens_per_rank=self.comm.deepep_max_tokens_per_rank)
        if self.collective_timeout_s <= 0 or self.step_timeout_s <= 0:
            raise ValueError("collective_timeout_s and step_timeout_s must be positive")

    @property
    def topology(self) -> Topology:
        return Topology.of(tp=self.tp, dp=self.dp, ep=self.ep)


class StepTicket:
    """A step submitted with `Coordinator.submit`; `Coordinator.collect` returns its tokens (oldest first).

    `plan`: the step's plan (None when every DP rank was idle); `outs`: per rank (tokens, in-rank seconds)
    once received (at submit on step paths that cannot run ahead; when a reset drained it)."""

    __slots__ = ("plan", "present", "submitted", "outs")

    def __init__(self, plan: Any, present: tuple[bool, ...]):
        self.plan, self.present, self.submitted = plan, present, time.perf_counter()
        self.outs: Optional[list] = None


@dataclass
class _Counters:
    steps: int = 0
    resets: int = 0
    failures: int = 0
    last_phase: Optional[str] = None
    last_failure: Optional[str] = None
    driver_s: float = 0.0
    in_rank_s: float = 0.0
    phases: dict[str, int] = field(default_factory=dict)


class Coordinator(CoordinatorHealth, CoordinatorStepPaths, CoordinatorLifecycle):
    """The deployment's rank group, driven from the driver (see the module doc). Failure detection, health and
    status live in `actors.coordinator_health`, the step-path choice in `actors.coordinator_paths`, reset, rebuild
    and shutdown in `actors.coordinator_lifecycle`."""

    def __init__(self, cfg: DeploymentConfig) -> None:
        self.cfg = cfg
        self.topo = cfg.topology
        self._state = "new"  # new | starting | serving | failed | shutdown
        self._ranks: Optional[RankSet] = None
        self._stepper: Optional[Stepper] = None  # the step path's driver side (`actors.coordinator_paths`)
        self._model_config: Any = None
        self._num_kv_blocks: Optional[int] = None
        self._sizes: tuple[list[int], list[int]] = ([], [])
        self._owns_ray = False
        self._use_gpu = False
        self._ranks_see_all_gpus = False
        self._startup: dict[str, Any] = {}
        self._last_reset_events: dict[int, list[dict]] = {}
        self._c = _Counters()
        self._in_flight: deque[StepTicket] = deque()
        self._prev_rows: list[int] = [0] * self.topo.dp  # per DP rank: rows its previous step's tokens have
        self._cross_dp = self.topo.collectives_cross_dp
        self._dp_leaders = tuple(self.topo.dp_leaders())
        self._last_collect = 0.0  # perf_counter at the end of the last collect
        self._test_faults: dict[int, dict] = {}  # tests only: rank -> fault options, applied at start()
        self._watcher: Optional[RankWatcher] = None  # heartbeats of the serving group (`actors.watch`)
        self._watch_fault: Optional[RankFault] = None  # what the watcher found (a dead or hung rank), until rebuild
        self._generation = 0  # counts rank groups started: a fault names the group it was found in
        # called (from the watcher's thread) with a one-line reason when a rank of a serving group dies or hangs,
        # so an idle owner can rebuild before any request arrives
        self.fault_listeners: list[Callable[[str, int], None]] = []

    # ------------------------------------------------------------------ properties
    @property
    def model_config(self):
        self._require("serving", "failed")
        return self._model_config

    @property
    def num_kv_blocks(self) -> int:
        self._require("serving")
        return int(self._num_kv_blocks)

    @property
    def block_size(self) -> int:
        return self.cfg.runtime.block_size

    @property
    def dp_size(self) -> int:
        return self.topo.dp

    @property
    def step_path(self) -> Optional[str]:
        return self._stepper.name if self._stepper is not None else None

    # ------------------------------------------------------------------ start-up
    def start(self, progress: bool = True) -> dict:
        self._require("new")
        self._state = "starting"
        try:
            launched = launch_ranks(self.cfg, self.topo, self._test_faults)
        except RankCallError as e:
            self._state = "failed"
            self._c.failures += 1
            self._c.last_failure = f"start-up failed: {e}"
            raise RankFailureError(self._c.last_failure) from None
        except BaseException:
            self._state = "failed"  # launch_ranks already killed every actor
            raise
        self._ranks, self._owns_ray = launched.ranks, launched.owns_ray or self._owns_ray
        self._use_gpu, self._model_config = launched.use_gpu, launched.model_config
        self._ranks_see_all_gpus = launched.ranks_see_all_gpus
        self._num_kv_blocks, self._sizes = launched.num_kv_blocks, launched.sizes
        timings = dict(launched.timings)
        t0 = time.perf_counter()
        per_bucket = self._capture(progress)
        timings["capture_s"] = time.perf_counter() - t0
        timings["per_bucket"] = per_bucket
        self._stepper = self._make_stepper()
        timings["step_path"] = self._stepper.name
        self._startup = timings
        self._generation += 1
        self._watch_fault = None
        self._state = "serving"
        self._start_watcher()
        return timings

    def _capture(self, progress: bool) -> dict[str, float]:
        try:
            return capture_all(self._ranks, *self._sizes, timeout_s=self._capture_timeout(), progress=progress)
        except StartupCaptureError:
            self._state = "failed"
            self._c.failures += 1
            raise

    def _capture_timeout(self) -> float:
        return self.cfg.collective_timeout_s + 300.0

    # ------------------------------------------------------------------ steps
    def step(self, batches: list[StepBatch | None], num_steps: int = 1) -> list[np.ndarray | None]:
        """One step: next tokens int64 `[B]` per DP rank (None for idle ones). `num_steps > 1`: multi-step
        decode (greedy decode batches whose block tables cover `num_steps` more tokens), int64 `[B, num_steps]`."""
        return self.collect(self.submit(batches, num_steps, wait_next=True))

    def submit(self, batches: list[StepBatch | None], num_steps: int = 1, wait_next: bool = False) -> StepTicket:
        """Validate, plan and send one step without waiting for its tokens; `collect` returns them. Negative
        token ids refer to the previous submitted step's tokens of the same DP rank (`prev_token`). At most
        `MAX_IN_FLIGHT` steps may be in flight; a bad batch raises BatchError and sends nothing.
        `wait_next`: the caller will collect this step before it submits anything else (`step` does), so
        tensor-parallel ranks may arm the next decode step behind it (`StepPlan.arm_next`)."""
        if self._state != "serving":
            self._require("serving")
        if self._watch_fault is not None:
            raise self._fail(RankCallError("step", [self._watch_fault], {})) from None
        if len(batches) != self.topo.dp:
            raise ValueError(f"step needs one batch (or None) per DP rank: got {len(batches)}, dp = {self.topo.dp}")
        if len(self._in_flight) >= MAX_IN_FLIGHT:
            raise CoordinatorStateError(f"{len(self._in_flight)} steps are in flight (at most {MAX_IN_FLIGHT}): "
                                        "collect() the oldest first")
        for d, b in enumerate(batches):
            if b is not None:
                self._validate(d, b, num_steps)
        decode_sizes, prefill_sizes = self._sizes
        plan = plan_step(batches, cross_dp=self._cross_dp, decode_buckets=decode_sizes, token_buckets=prefill_sizes,
                         num_steps=num_steps)
        if plan is not None and wait_next and not self._in_flight and num_steps == 1 and self._arms_collectively:
            plan = with_arm_next(plan)
        ticket = StepTicket(plan, tuple([b is not None for b in batches]))
        if plan is not None:
            try:
                stepper = self._stepper
                if stepper.pipelined:  # the tokens come back at collect
                    cast(PipelinedStepper, stepper).send(plan)
                else:
                    ticket.outs = stepper.run(plan, self.cfg.step_timeout_s)
            except RankCallError as e:
                raise self._fail(e) from None
        for d, b in enumerate(batches):
            if b is not None:
                self._prev_rows[d] = b.batch_size
        self._in_flight.append(ticket)
        return ticket

    def collect(self, ticket: StepTicket) -> list[np.ndarray | None]:
        """The tokens of a submitted step, per DP rank (None for idle ones): waits for them. Steps are collected
        in the order they were submitted."""
        if ticket in self._in_flight:
            if self._state != "serving":
                self._require("serving")
            if self._in_flight[0] is not ticket:
                raise CoordinatorStateError("collect() the oldest submitted step first")
            self._receive_oldest()
        elif ticket.outs is None:
            raise CoordinatorStateError("this step is not in flight on this coordinator")
        if ticket.plan is None:
            return [None] * self.topo.dp
        outs, present = ticket.outs, ticket.present
        return [outs[r][0] if present[d] else None for d, r in enumerate(self._dp_leaders)]

    def _receive_oldest(self) -> None:
        """Receive the oldest in-flight step's replies into its ticket's `outs` (`[]` when every DP rank was idle),
        count it, and take it off the in-flight queue."""
        ticket = self._in_flight[0]
        plan = ticket.plan
        if plan is None:
            ticket.outs = []
            self._in_flight.popleft()
            return
        if ticket.outs is None:
            try:
                ticket.outs = cast(PipelinedStepper, self._stepper).receive(plan, self.cfg.step_timeout_s)
            except RankCallError as e:
                raise self._fail(e) from None
        now = time.perf_counter()
        c = self._c
        c.steps += 1
        c.last_phase = plan.phase
        c.phases[plan.phase] = c.phases.get(plan.phase, 0) + 1
        c.driver_s += now - max(ticket.submitted, self._last_collect)
        c.in_rank_s += max([t for _, t in ticket.outs])
        self._last_collect = now
        self._in_flight.popleft()

    def _drain(self) -> None:
        """Receive every in-flight step (their tickets keep the tokens for a later `collect`)."""
        while self._in_flight:
            self._receive_oldest()

    def check_batch(self, dp_rank: int, batch: StepBatch) -> None:
        """Raise BatchError when `batch` (host token ids only) could not run on DP rank `dp_rank`; sends nothing."""
        self._require("serving")
        rt = self.cfg.runtime
        batch.check_runnable(self._model_config.vocab_size, rt.block_size, rt.max_blocks_per_seq, self._num_kv_blocks)

    def _validate(self, dp_rank: int, b: StepBatch, num_steps: int = 1) -> None:
        rt = self.cfg.runtime
        try:
            b.check_runnable(self._model_config.vocab_size, rt.block_size, rt.max_blocks_per_seq, self._num_kv_blocks,
                             prev_rows=self._prev_rows[dp_rank])
            if num_steps != 1:  # check_multi_step(1) checks nothing
                b.check_multi_step(num_steps, rt.block_size)
        except BatchError as e:
            raise BatchError(f"DP rank {dp_rank}: {e}") from None

    def rank_step_times(self, clear: bool = False) -> list[list[float]]:
        """Per rank, the in-rank seconds of its recent `execute` calls (benchmarks: coordinator overhead)."""
        self._require("serving")
        return self._ranks.call("step_times", (clear,), timeout_s=30.0, what="step times")

    # ------------------------------------------------------------------ reset, life cycle: `CoordinatorLifecycle`
    def _require(self, *states: str) -> None:
        if self._state not in states:
            hint = {"new": "call start()", "failed": "call rebuild()", "shutdown": "the coordinator was shut down",
                    "starting": "start() is running"}.get(self._state, "")
            raise CoordinatorStateError(f"coordinator is {self._state!r}, needs {' or '.join(states)}: {hint}")

    def __enter__(self) -> "Coordinator":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
