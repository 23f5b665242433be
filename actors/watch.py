"""`RankWatcher`: a driver thread that watches every rank of a group, whether or not a step runs.

Every `interval_s` it sends each rank a heartbeat (`RankWorker.heartbeat`, its own concurrency group, so a long
step or a status call never delays it); a rank gets a new heartbeat only once it answered the last one. What it
learns:
- a heartbeat that fails with `RayActorError`: the rank's process is gone (`died`), seen within about one
  interval of the death, idle or not;
- no answer for `unresponsive_after_s`: the rank is unresponsive (`/health` says so at once);
- no answer for `hang_after_s`: the rank is declared `hung`.
On `died` or `hung` the watcher calls `on_fault(fault)` once and stops: the owner (the coordinator) tears the
group down, which also ends any step waiting on the rank. `snapshot()` is safe to call from any thread.

Lifetime: one watcher per rank group (`start()` after the group serves, `stop()` before it is torn down).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import ray
from ray.exceptions import RayActorError, RayTaskError

from actors.rankset import RankFault, RankSet, _death_text


@dataclass
class RankBeat:
    """What the watcher last knew of one rank (monotonic seconds)."""

    rank: int
    last_answer: float
    alive: bool = True
    phase: str = "?"
    phase_s: float = 0.0
    steps: int = 0


class RankWatcher:
    def __init__(self, ranks: RankSet, on_fault: Callable[[RankFault], None], *, interval_s: float = 0.25,
                 unresponsive_after_s: float = 0.5, hang_after_s: float = 15.0):
        if not 0 < interval_s < unresponsive_after_s <= hang_after_s:
            raise ValueError("need 0 < interval_s < unresponsive_after_s <= hang_after_s")
        self.ranks = ranks
        self.on_fault = on_fault
        self.interval_s, self.unresponsive_after_s, self.hang_after_s = interval_s, unresponsive_after_s, hang_after_s
        now = time.monotonic()
        self._beats = [RankBeat(r, now) for r in range(len(ranks))]
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.fault: Optional[RankFault] = None
        self._thread: Optional[threading.Thread] = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="graphline-rank-watcher", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def snapshot(self) -> dict[str, Any]:
        """{"ok": every rank answers, "reason": why not (None when ok), "ranks": [per rank: alive, silent_s,
        phase, phase_s, steps]}."""
        now = time.monotonic()
        with self._lock:
            beats = [RankBeat(**vars(b)) for b in self._beats]
            fault = self.fault
        ranks, reasons = [], []
        for b in beats:
            silent = now - b.last_answer
            state = "dead" if not b.alive else ("unresponsive" if silent >= self.unresponsive_after_s else "ok")
            if state != "ok":
                reasons.append(f"rank {b.rank} {state}" + (f" for {silent:.1f} s" if b.alive else ""))
            ranks.append({"rank": b.rank, "state": state, "silent_s": round(silent, 3), "phase": b.phase,
                          "phase_s": round(b.phase_s, 3), "steps": b.steps})
        if fault is not None:
            reasons.insert(0, str(fault))
        return {"ok": not reasons, "reason": "; ".join(reasons) or None, "ranks": ranks}

    def _run(self) -> None:
        workers = self.ranks.workers
        pending: dict[Any, int] = {}  # heartbeat ref -> rank; at most one per rank
        while not self._stop.is_set():
            t0 = time.monotonic()
            asked = set(pending.values())
            for r, w in enumerate(workers):
                if r not in asked:
                    try:
                        pending[w.heartbeat.remote()] = r
                    except Exception:  # noqa: BLE001 - the actor handle is gone with the group
                        return
            ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=self.interval_s)
            now = time.monotonic()
            fault = None
            for ref in ready:
                r = pending.pop(ref)
                try:
                    h = ray.get(ref, timeout=0)
                except RayActorError as e:
                    fault = fault or RankFault(r, "died", _death_text(e))
                    with self._lock:
                        self._beats[r].alive = False
                    continue
                except RayTaskError:  # a heartbeat cannot raise; treat it as silence
                    continue
                with self._lock:
                    b = self._beats[r]
                    b.last_answer, b.phase, b.phase_s, b.steps = now, h["phase"], h["phase_s"], h["steps"]
            if fault is None:
                with self._lock:
                    silent = [(now - b.last_answer, b.rank) for b in self._beats if b.alive]
                worst = max(silent, default=(0.0, -1))
                if worst[0] >= self.hang_after_s:
                    b = self._beats[worst[1]]
                    fault = RankFault(b.rank, "hung", f"no heartbeat for {worst[0]:.1f}s (last seen in '{b.phase}')")
            if fault is not None:
                with self._lock:
                    self.fault = fault
                self.on_fault(fault)
                return
            self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - t0)))
