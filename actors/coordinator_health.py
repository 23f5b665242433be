"""The failure-detection, health and status part of `actors.coordinator.Coordinator` (a mixin: the coordinator owns
the state these methods read): the heartbeat watcher of a serving rank group (`actors.watch`), what a rank failure
does to the group, and the JSON status."""
from __future__ import annotations

from typing import Any

from actors.errors import RankFailureError
from actors.rankset import RankCallError, RankFault
from actors.startup import summarize_status
from actors.watch import RankWatcher


class CoordinatorHealth:
    """Mixed into `Coordinator`; uses its `_ranks`, `_state`, `_generation`, `_watcher`, `_watch_fault`, `_c`,
    `fault_listeners`, `cfg` and `_teardown`."""

    def _start_watcher(self) -> None:
        # A rank's heartbeat thread answers within milliseconds whatever its step does, so a quarter of the step
        # timeout of silence (1.5 to 5 s) means a stopped or wedged process: it is declared hung, and the group
        # torn down and rebuilt within the step timeout. A stuck step whose rank still answers (a collective
        # waiting on a peer) is caught by the step deadline.
        hang = min(5.0, max(1.5, self.cfg.step_timeout_s / 4))
        gen = self._generation
        self._watcher = RankWatcher(self._ranks, lambda fault: self._on_watch_fault(fault, gen),
                                    interval_s=0.25, unresponsive_after_s=min(0.5, hang), hang_after_s=hang)
        self._ranks.watcher = self._watcher
        self._watcher.start()

    def _on_watch_fault(self, fault: RankFault, generation: int) -> None:
        """The watcher's thread: a rank of group `generation` died or hung. Kill every rank process at once (a
        step waiting on them ends with an error); the group is torn down and rebuilt by the owner's thread."""
        ranks = self._ranks
        if generation != self._generation or ranks is None or self._state != "serving":
            return
        self._watch_fault = fault
        ranks.kill_processes()
        reason = f"{fault}"
        for listener in list(self.fault_listeners):
            try:
                listener(reason, generation)
            except Exception:  # noqa: BLE001 - a listener never stops failure handling
                pass

    def health(self) -> dict[str, Any]:
        """Whether every rank can serve, from any thread: {"ok", "state", "reason", "ranks", "generation"}."""
        state, watcher, fault = self._state, self._watcher, self._watch_fault
        snap = watcher.snapshot() if watcher is not None and state == "serving" else {"ok": False, "reason": None,
                                                                                       "ranks": []}
        ok = state == "serving" and fault is None and snap["ok"]
        reason = None if ok else (str(fault) if fault is not None else snap["reason"] or f"coordinator {state}")
        return {"ok": ok, "state": state, "reason": reason, "ranks": snap["ranks"], "generation": self._generation}

    @property
    def generation(self) -> int:
        return self._generation

    def _fail(self, e: RankCallError, during: str = "step") -> RankFailureError:
        """Tear every rank down (communicators are not repairable) and build the caller's error. A fault the
        watcher found first (it killed the group, so the step saw pipes close) is the one reported."""
        self._c.failures += 1
        faults = [self._watch_fault] if self._watch_fault is not None else e.faults
        msg = f"{during} failed: " + "; ".join(str(f) for f in faults)
        if sum(f.kind == "hung" for f in faults) > 1:
            msg += " (a rank waiting in a collective for a stuck peer shows as hung too)"
        msg += "; every rank was torn down"
        self._c.last_failure = msg
        self._teardown()
        self._state = "failed"
        return RankFailureError(msg)

    def status(self) -> dict:
        infos = self._ranks.probe() if self._ranks is not None else []
        return summarize_status(self, infos)

    def event_logs(self) -> dict[int, list[dict]]:
        """Every rank's protocol event log (captures, resets) with timestamps; {} when not running."""
        if self._ranks is None or self._ranks.killed:
            return {}
        return {r: ev for r, ev in enumerate(self._ranks.probe(method="event_log")) if ev is not None}
