"""Errors the coordinator raises (re-exported by `actors.coordinator`)."""
from __future__ import annotations


class RankFailureError(RuntimeError):
    """A rank died, hung or raised; the message names the rank and what happened. Every rank was
    torn down (communicators cannot be repaired): `Coordinator.rebuild()` serves again."""


class StartupCaptureError(RuntimeError):
    """Start-up (or re-) capture failed on some rank; every rank was reset, nothing is published."""


class CoordinatorStateError(RuntimeError):
    """A coordinator method was called in the wrong state (not started, failed, shut down)."""


class RankStepError(RuntimeError):
    """A rank's step raised; the message names the rank and its device (raised inside the worker)."""
