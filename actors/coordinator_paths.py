"""The step-path part of `actors.coordinator.Coordinator` (a mixin: the coordinator owns the state): which path
carries the steps of a rank group (pipe, compiled graph, plain calls; see the coordinator's module doc) and the
driver-side stepper of each (`actors.protocol.Stepper`; the pipe path's is a `PipelinedStepper`)."""
from __future__ import annotations

from typing import Optional

from actors.options import check_step_path
from actors.pipes import DRIVER_POLL_S, PipeStepper, all_local
from actors.protocol import Stepper
from actors.rankset import CompiledStepper, PlainStepper
from actors.startup import requested_step_path


class CoordinatorStepPaths:
    """Mixed into `Coordinator`; uses its `cfg`, `topo`, `_ranks`, `_use_gpu`, `_ranks_see_all_gpus`, `_stepper`,
    `_require` and `_drain`."""

    def _resolve_step_path(self, path: Optional[str] = None) -> str:
        """"pipe" | "compiled" | "plain" for this rank group, or ValueError naming why `path` cannot serve it."""
        path = check_step_path(path or requested_step_path(self.cfg))
        local = all_local(self._ranks.places)
        if path == "auto":  # compiled graphs need per-actor CUDA_VISIBLE_DEVICES, which TP ranks on GPUs give up
            path = "pipe" if local else ("compiled" if self._use_gpu and not self._ranks_see_all_gpus else "plain")
        if path == "pipe" and not local:
            raise ValueError("the pipe step path needs every rank on the driver's host")
        if path == "compiled" and self._ranks_see_all_gpus:
            raise ValueError("the compiled step path needs Ray's per-actor CUDA_VISIBLE_DEVICES, but these TP "
                             "ranks see every GPU (for the symmetric-memory all-reduce): start the deployment "
                             "with step_path='compiled' instead")
        return path

    def _make_stepper(self, path: Optional[str] = None) -> Stepper:
        """The driver side of the step path `path` (None: the deployment's): a `PipelinedStepper` for "pipe"."""
        path = self._resolve_step_path(path)
        if path == "pipe":
            dp_of = [self.topo.coords(r).dp_rank for r in range(len(self._ranks))]
            drv = self.cfg.driver
            poll_s = drv.poll_s if drv.poll_s is not None else (DRIVER_POLL_S if self._use_gpu else 0.0)
            return PipeStepper(self._ranks, dp_of, timeout_s=self.cfg.collective_timeout_s, poll_s=poll_s,
                               disarm_after_s=self.cfg.runtime.armed_decode_wait_ms / 1e3 if self._arms_collectively
                               else 0.0, trace=drv.step_trace, profile=drv.step_profile)
        if path == "compiled":
            return CompiledStepper(self._ranks)
        return PlainStepper(self._ranks)

    def idle(self) -> None:
        """The caller has no step to run for now: ranks that armed a decode step behind the last one
        (`actors.armed`) cancel it at once (the pipe path's disarm frame), so the next request does not wait
        behind its padded replay. A no-op off the pipe path, with arming off, or with a step in flight."""
        if (self._state == "serving" and isinstance(self._stepper, PipeStepper) and self.topo.ep == 1
                and self.cfg.runtime.armed_decode_wait_ms > 0):
            self._stepper.disarm_now()

    @property
    def _arms_collectively(self) -> bool:
        """Whether the ranks arm decode steps only when told (`StepPlan.arm_next`): tensor parallelism on GPUs,
        no expert parallelism, arming on (`actors.armed`)."""
        return (self._use_gpu and self.topo.tp > 1 and self.topo.ep == 1
                and self.cfg.runtime.armed_decode_wait_ms > 0)

    def _switch_step_path(self, path: str) -> None:
        """Benchmarks/tests: replace the step path ("pipe" | "compiled" | "plain") on the live rank group."""
        self._require("serving")
        path = self._resolve_step_path(path)  # a path that cannot serve raises before the current one is dropped
        self._drain()
        if self._stepper is not None:
            self._stepper.teardown()
        self._stepper = self._make_stepper(path)
