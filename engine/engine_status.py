"""The health, status and statistics reads of `engine.async_engine.AsyncLLMEngine` (a mixin: the engine owns the
state), all answered outside the engine thread so that none waits for a step: `health()` reads the executor's
watcher, `stats()` the snapshot the engine thread publishes, `executor_status()` the document a status thread
refreshes."""
from __future__ import annotations

import asyncio
import time


class EngineStatus:
    """Mixed into `AsyncLLMEngine`; uses its `engine`, `dead`, `recovering`, `running`, `_thread`, `_streams`,
    `_status`, `_status_thread`, `_status_wake`, `_status_stop`, `status_interval_s`, `_stats`, `_stats_at` and
    `last_step_time`."""

    async def executor_status(self, max_age_s: float = 0.1, max_wait_s: float = 0.05) -> dict:
        """The executor's status as the status thread read it. When that is older than `max_age_s`, the thread
        is asked for a new read and this waits up to `max_wait_s` for it; it never waits for a step (a hung rank
        only leaves the document older)."""
        at, status = self._status
        if time.monotonic() - at > max_age_s and self._status_thread is not None and self._status_thread.is_alive():
            self._status_wake.set()
            deadline = time.monotonic() + max_wait_s
            while self._status[0] == at and time.monotonic() < deadline:
                await asyncio.sleep(0.002)
            at, status = self._status
        if self.dead is not None:
            return {**status, "error": self.dead}
        return status

    def _refresh_status(self) -> None:
        """The status thread: read the executor's status every `status_interval_s` (its own calls to the ranks
        have deadlines; the engine thread is never involved)."""
        while self._thread is not None and self._thread.is_alive():
            try:
                status = self.engine.executor.status()
            except Exception as exc:  # noqa: BLE001 - a broken executor still gets a status document
                status = {"error": f"{type(exc).__name__}: {exc}"}
            self._status = (time.monotonic(), status)
            self._status_wake.wait(self.status_interval_s)
            self._status_wake.clear()
            if self._status_stop.is_set():
                return

    def health(self) -> dict:
        """{"ok", "reason", "ranks"}: ok only when the engine thread runs and every rank can serve (the
        executor's `health()`, read without waiting for a step)."""
        if self.dead is not None or not self.running:
            return {"ok": False, "reason": self.dead or "the engine thread stopped", "ranks": []}
        if self.recovering is not None:
            return {"ok": False, "reason": f"rebuilding after a failure: {self.recovering}", "ranks": []}
        probe = getattr(self.engine.executor, "health", None)
        if probe is None:
            return {"ok": True, "reason": None, "ranks": []}
        h = probe()
        return {"ok": bool(h.get("ok")), "reason": h.get("reason"), "ranks": h.get("ranks", [])}

    def stats(self) -> dict:
        """The engine's counters and queues as the engine thread last published them (no lock on the engine)."""
        s = dict(self._stats)
        s["in_flight"] = len(self._streams)
        s["dead"] = self.dead
        s["recovering"] = self.recovering
        s["last_step_age_s"] = None if self.last_step_time is None else time.monotonic() - self.last_step_time
        return s

    def _publish_stats(self) -> None:
        self._stats = self.engine.stats()
        self._stats_at = time.monotonic()
