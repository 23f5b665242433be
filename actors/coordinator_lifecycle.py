"""The reset and life-cycle part of `actors.coordinator.Coordinator` (a mixin: the coordinator owns the state these
methods change): `reset` (drain, then every rank's runner reset -> DeepEP buffer -> barrier, with optional weight
reload, KV resize and re-capture), `rebuild`, `shutdown`, and `_teardown` (kill every rank, drop the step path),
which failure handling (`actors.coordinator_health`) uses too.
"""
from __future__ import annotations

import time

from actors.errors import RankFailureError
from actors.rankset import RankCallError


class CoordinatorLifecycle:
    """Mixed into `Coordinator`; uses its `cfg`, `topo`, `_state`, `_ranks`, `_stepper`, `_watcher`, `_in_flight`,
    `_prev_rows`, `_num_kv_blocks`, `_last_reset_events`, `_owns_ray`, `_c`, and `_require`, `_drain`, `_capture`,
    `_fail` and `start`."""

    # ------------------------------------------------------------------ reset
    def reset(self, recapture: bool = True, num_kv_blocks: int | None = None, reload_weights: bool = False) -> dict:
        """Drain the steps in flight, then on every rank: graphs (runner.reset) -> DeepEP buffer -> barrier; then
        optionally reload the weights, resize the KV cache (`num_kv_blocks`) and capture again. Returns seconds per
        phase and each rank's reset events; a rank failure tears the group down (RankFailureError)."""
        self._require("serving")
        if num_kv_blocks is not None and num_kv_blocks < 2:
            raise ValueError(f"num_kv_blocks must be >= 2 (block 0 is reserved), got {num_kv_blocks}")
        self._drain()
        self._prev_rows = [0] * self.topo.dp  # the ranks drop their previous-step tokens
        ranks, out = self._ranks, {}
        timeout = self.cfg.collective_timeout_s + 60.0
        t0 = time.perf_counter()
        try:
            events = ranks.call("reset", timeout_s=timeout, what="reset")
            self._last_reset_events = {r: ev for r, ev in enumerate(events)}
            out["reset_s"] = time.perf_counter() - t0
            if reload_weights:
                t1 = time.perf_counter()
                ranks.call("reload_weights", timeout_s=timeout + 600.0, what="weight reload")
                out["weights_s"] = time.perf_counter() - t1
            if num_kv_blocks is not None:
                t1 = time.perf_counter()
                ranks.call("allocate_kv_cache", (num_kv_blocks,), timeout_s=timeout, what="KV resize")
                self._num_kv_blocks = num_kv_blocks
                out["kv_s"] = time.perf_counter() - t1
            ranks.call("prepare_dispatcher", timeout_s=timeout, what="dispatcher prepare")
        except RankCallError as e:
            raise self._fail(e, "reset") from None
        self._c.resets += 1
        if recapture:
            t1 = time.perf_counter()
            out["per_bucket"] = self._capture(progress=False)
            out["capture_s"] = time.perf_counter() - t1
        out["events"] = {r: [ev["kind"] for ev in evs] for r, evs in self._last_reset_events.items()}
        return out

    # ------------------------------------------------------------------ life cycle
    def rebuild(self) -> None:
        """Tear everything down (whatever state) and start again with the same config."""
        self._teardown()
        self._state = "new"
        self.start(progress=False)

    def shutdown(self) -> None:
        if self._state == "shutdown":
            return
        if self._watcher is not None:
            self._watcher.stop()
            self._watcher = None
            if self._ranks is not None:
                self._ranks.watcher = None
        if self._ranks is not None and not self._ranks.killed and self._state == "serving":
            try:
                self._drain()
            except RankFailureError:
                pass  # torn down already
        if self._ranks is not None and not self._ranks.killed and self._state == "serving":
            if self._stepper is not None:
                self._stepper.teardown()
                self._stepper = None
            try:
                self._ranks.call("shutdown", timeout_s=min(30.0, self.cfg.collective_timeout_s), what="shutdown")
            except RankCallError:
                pass
        self._teardown()
        self._state = "shutdown"
        if self._owns_ray:
            import ray

            ray.shutdown()
            self._owns_ray = False

    def _teardown(self) -> None:
        if self._watcher is not None:
            self._watcher.stop()
            self._watcher = None
        self._in_flight.clear()
        self._prev_rows = [0] * self.topo.dp
        if self._ranks is not None:
            self._ranks.kill()
        if self._stepper is not None:
            self._stepper.teardown()
        self._stepper = None
        self._ranks = None
