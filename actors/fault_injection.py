"""Test-only hooks of a `RankWorker`: injected faults (the CPU tests' failure scenarios) and a recorder of the
step's fp32 logits. Product code never sets either: tests pass faults through `Coordinator._test_faults`
(applied at start-up) or call the worker's `_test_*` methods.

Faults (`FaultInjector`): fail_capture_at=N (raise in the N-th capture), exit_in_step=N (os._exit in the N-th
step), raise_in_step=N (raise in the N-th step), hang_in_step=N (sleep forever in the N-th step), step_delay_s=x
(sleep in each step), kernels_override=KernelOptions (what `init_groups` cross-checks in place of the config's).
"""
from __future__ import annotations

import os
import time
from typing import Any


class InjectedFault(RuntimeError):
    """An injected failure (tests only)."""


class FaultInjector:
    """The faults one rank was started with or given later. `active`: any fault is set (the step path checks it
    before calling `in_step`)."""

    def __init__(self, faults: dict | None = None) -> None:
        self._faults = dict(faults or {})
        self.active = bool(self._faults)

    def update(self, **faults: Any) -> None:
        self._faults.update(faults)
        self.active = bool(self._faults)

    def kernels(self, configured: Any) -> Any:
        """The kernel options this rank cross-checks with its peers: `kernels_override` when set, else `configured`."""
        return self._faults.get("kernels_override", configured)

    def in_capture(self, n: int, what: str) -> None:
        """The rank's n-th capture (of bucket `what`) begins."""
        if self._faults.get("fail_capture_at") == n:
            raise InjectedFault(f"injected failure in capture #{n} ({what})")

    def in_step(self, n: int) -> None:
        """The rank's n-th step is being launched."""
        f = self._faults
        if f.get("step_delay_s"):
            time.sleep(float(f["step_delay_s"]))
        if f.get("exit_in_step") == n:
            os._exit(17)
        if f.get("raise_in_step") == n:
            raise InjectedFault(f"injected failure in step #{n}")
        if f.get("hang_in_step") == n:
            while True:
                time.sleep(3600)


class LogitsRecorder:
    """Keeps the fp32 logits of every step of a runtime while recording (the runtime's logits observer)."""

    def __init__(self) -> None:
        self.last: Any = None  # numpy, the last step's logits

    def start(self, runtime: Any) -> None:
        runtime.logits_observer = self._record

    @staticmethod
    def stop(runtime: Any) -> None:
        """Drop the observer (greedy steps take the greedy LM head again)."""
        runtime.logits_observer = None

    def _record(self, logits: Any) -> None:
        self.last = logits.detach().float().cpu().numpy()
