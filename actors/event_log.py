"""`EventLog`: a rank's protocol event log (start-up captures, reset phases, arming failures; wall-clock `t`), which the
coordinator (`Coordinator.event_logs`, `Coordinator.reset`) and the tests read to check the lock-step capture and
the reset ordering: graphs (`runner.reset`) -> DeepEP buffer (the runner's reset hook) -> barrier.
"""
from __future__ import annotations

import time
from typing import Any


class EventLog:
    def __init__(self) -> None:
        self._events: list[dict[str, Any]] = []

    def log(self, kind: str, **detail: Any) -> None:
        self._events.append({"t": time.time(), "kind": kind, **detail})

    def __len__(self) -> int:
        return len(self._events)

    def since(self, n: int) -> list[dict[str, Any]]:
        """The events after the first n."""
        return self._events[n:]

    def all(self) -> list[dict[str, Any]]:
        return list(self._events)

    def runner_reset(self, runner: Any) -> None:
        """The runner's reset hook: runs inside `runner.reset()` after every graph and plan was dropped, so the
        DeepEP buffer (whose addresses the graphs captured) is destroyed strictly after them."""
        snap = runner.stats.snapshot()
        self.log("reset_graphs", decode_graphs=snap["captured_decode"], prefill_plans=snap["captured_prefill"])
        from parallel.deepep import destroy_deepep_buffer

        self.log("reset_deepep", status=destroy_deepep_buffer())  # collective destroy + barrier, or skipped

    def reset_without_runner(self) -> None:
        """A reset before any runner was built: the DeepEP buffer still goes (its destroy is collective)."""
        from parallel.deepep import destroy_deepep_buffer

        self.log("reset_graphs", decode_graphs=0, prefill_plans=0, note="no runner")
        self.log("reset_deepep", status=destroy_deepep_buffer())

    def reset_ran_hook(self, n: int) -> bool:
        """Whether the runner's reset hook logged since the first n events."""
        return any(e["kind"] == "reset_graphs" for e in self._events[n:])
