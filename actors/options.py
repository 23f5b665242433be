"""`DriverOptions`: how the driver runs steps (step path, polling, tracing). Built once on the driver
(`actors.environment.options_from_environ` reads the `GRAPHLINE_*` variables) into
`actors.coordinator.DeploymentConfig.driver`; the ranks get what they need of it (tracing, profiling) as arguments
of the step loop they start, so no rank reads its environment."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

STEP_PATHS = ("auto", "pipe", "compiled", "plain")
STEP_PATH_ENV = "GRAPHLINE_STEP_PATH"
DRIVER_POLL_ENV = "GRAPHLINE_DRIVER_POLL_S"
STEP_TRACE_ENV = "GRAPHLINE_STEP_TRACE"
STEP_PROFILE_ENV = "GRAPHLINE_STEP_PROFILE"


class DriverOptionsError(ValueError):
    """A driver option (or the variable it came from) has a value outside its choices."""


def check_step_path(path: str) -> str:
    """`path` if it names a step path, else ValueError naming the choices (wording kept from the variable's)."""
    if path not in STEP_PATHS:
        raise DriverOptionsError(f"{STEP_PATH_ENV} must be one of {STEP_PATHS}, got {path!r}")
    return path


@dataclass(frozen=True)
class DriverOptions:
    """step_path: overrides `DeploymentConfig.step_path` when set ("auto", "pipe", "compiled", "plain").
    poll_s: how long the driver polls past a step's expected end before it blocks; None: 0.002 s on GPUs, 0 on CPU.
    step_trace: per-step timestamps on the driver and in each rank's step loop (`bench.step_trace`).
    step_profile: with step_trace, each rank's step loop is profiled (cProfile) into `<path>.rank<N>`."""

    step_path: Optional[str] = None
    poll_s: Optional[float] = None
    step_trace: bool = False
    step_profile: Optional[str] = None

    def __post_init__(self) -> None:
        if self.step_path is not None:
            check_step_path(self.step_path)
        p = self.poll_s
        if p is not None and (isinstance(p, bool) or not isinstance(p, (int, float)) or not math.isfinite(p) or p < 0):
            raise DriverOptionsError(f"{DRIVER_POLL_ENV}={p!r} must be a number of seconds >= 0")
        if not isinstance(self.step_trace, bool):
            raise DriverOptionsError(f"step_trace ({STEP_TRACE_ENV}) must be a bool, got {self.step_trace!r}")
        if self.step_profile is not None and not (isinstance(self.step_profile, str) and self.step_profile):
            raise DriverOptionsError(f"{STEP_PROFILE_ENV}={self.step_profile!r} must be a non-empty path")
