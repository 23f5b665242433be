"""`StepTracer`: the pipe loop's per-step trace records (`DriverOptions.step_trace`, read back by `bench.step_trace`
through `RankWorker.step_trace`) and the loop thread's profiler (`DriverOptions.step_profile`). Off by default: the
rank's timing events cost a few microseconds per step.

A record (perf_counter seconds): `read` (request read), `decoded` (the traced launch began), `call` (timing events
made, the launch called), `launched` (it returned), `ready` (the tokens reached the host), `written` (the reply
went out); `lane_steps` / `armed_steps` (the runtime's counters after the launch); on read-back `device_s`, the
forward stream's time from before the launch to after the tokens' copy (not for a step an armed replay took: its
device work was enqueued before the request came).
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

from actors.rank_steps import Launched


class StepTracer:
    def __init__(self) -> None:
        self.enabled = False
        self.profile: str | None = None
        self._records: deque[dict[str, Any]] = deque(maxlen=4096)  # oldest first

    def configure(self, trace: bool, profile: str | None) -> None:
        """`trace` / `profile`: `DriverOptions.step_trace` / `step_profile` (profiling only with tracing on)."""
        self.enabled, self.profile = trace, profile

    def launch(self, launch: Callable[..., Launched], runtime: Any, decoded: tuple, t_read: float) -> Launched:
        """`launch(*decoded)` with a trace record on the step (`Launched.trace`)."""
        import torch

        t_decoded = time.perf_counter()
        timed = runtime.device.type == "cuda"
        if timed:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(runtime.stream)
        armed_before = runtime.armed_steps
        t_call = time.perf_counter()
        step = launch(*decoded)
        step.trace = {"read": t_read, "decoded": t_decoded, "call": t_call, "launched": time.perf_counter(),
                      "lane_steps": float(runtime.lane_steps), "armed_steps": float(runtime.armed_steps)}
        if timed and runtime.armed_steps == armed_before:  # an armed step's work was enqueued before `start`
            end.record(runtime.stream)
            step.trace["events"] = (start, end)
        return step

    def ready(self, record: dict[str, Any]) -> None:
        """The step's tokens reached the host; keep its record (before the reply: a driver that has the reply may
        read the trace)."""
        record["ready"] = time.perf_counter()
        self._records.append(record)

    @staticmethod
    def written(record: dict[str, Any]) -> None:
        record["written"] = time.perf_counter()

    def read(self, clear: bool = False) -> list[dict[str, float]]:
        """The records of the steps whose replies went out, oldest first, with `device_s`."""
        out = []
        for rec in self._records:
            if "written" not in rec:  # its reply is being written
                continue
            rec = dict(rec)
            events = rec.pop("events", None)
            if events is not None:
                rec["device_s"] = events[0].elapsed_time(events[1]) / 1e3
            out.append(rec)
        if clear:
            self._records.clear()
        return out

    def start_profile(self) -> tuple[Any, str] | None:
        """(a running cProfile profiler of the calling thread, its path) when tracing with a profile path, else None."""
        if not (self.enabled and self.profile):
            return None
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
        return profiler, self.profile

    @staticmethod
    def stop_profile(started: tuple[Any, str] | None, rank: int | None) -> None:
        """Stop what `start_profile` started (None: nothing) and write it to `<path>.rank<rank>`."""
        if started is not None:
            profiler, path = started
            profiler.disable()
            profiler.dump_stats(f"{path}.rank{rank}")
