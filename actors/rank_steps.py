"""`RankSteps`: one rank's steps on its device, for every step path (`RankWorker.execute_step` on the plain and
compiled paths, `actors.pipe_loop.PipeLoop` on the pipe path): `launch` enqueues a step (`RankRuntime.launch`),
`finish` waits for its tokens. It owns the step count the heartbeat reports, the steps in flight (the pipe loop
may run two at once; the rank's phase is "execute" while any is) and the recent in-rank step times.

An exception from a launch names the rank (compiled-graph errors do not carry the actor): `RankStepError`.
"""
from __future__ import annotations

import contextlib
import time
from collections import deque
from typing import Any

from actors.errors import RankStepError
from actors.fault_injection import FaultInjector
from actors.protocol import RankArgs
from actors.rank_phase import RankPhase


class Launched:
    """A step enqueued on the rank's device: its `PendingTokens` and when its launch began (perf_counter); `trace`:
    its trace record when the pipe loop traces (`actors.step_tracing`)."""

    __slots__ = ("pending", "t0", "trace")

    def __init__(self, pending: Any, t0: float):
        self.pending, self.t0, self.trace = pending, t0, None


class RankSteps:
    """Implements `actors.pipe_loop.StepExecutor`. `phase`: the worker's (a step binds the calling thread to the
    rank's device first); `attach` gives the runtime once it is built."""

    def __init__(self, phase: RankPhase, faults: FaultInjector) -> None:
        self._phase, self._faults = phase, faults
        self.runtime: Any = None  # actors.rank.RankRuntime, from attach
        self.rank: int | None = None
        self._tp_rank = 0
        self.count = 0  # steps launched, ever
        self._in_flight = 0  # steps launched and not yet finished
        self._times: deque[float] = deque(maxlen=4096)  # in-rank seconds of the recent steps

    def attach(self, runtime: Any, rank: int, tp_rank: int) -> None:
        self.runtime, self.rank, self._tp_rank = runtime, rank, tp_rank

    def bind_thread(self) -> None:
        """This thread runs every later step (the pipe loop's): on a GPU, bind it to the rank's forward stream."""
        if self.runtime.device.type == "cuda":
            self._phase.enter("execute")
            self.runtime.bind_stream()
            self._phase.leave()

    def run(self, args: RankArgs, static_tokens: int | None, num_steps: int = 1) -> tuple[Any, float]:
        """Launch and finish one step: (next tokens on TP rank 0 else None, in-rank seconds)."""
        return self.finish(self.launch(args, static_tokens, num_steps))

    def launch(self, args: RankArgs, static_tokens: int | None, num_steps: int = 1) -> Launched:
        """Enqueue one step on the rank's device without waiting for it: `args` (batch, hints) of this rank's share
        of the plan, `static_tokens` the EP dispatcher's row count. An exception names the rank."""
        self._phase.enter("execute")
        self._in_flight += 1
        t0 = time.perf_counter()
        try:
            self.count += 1
            if self._faults.active:
                self._faults.in_step(self.count)
            batch, hints = args
            disp = self.runtime.ctx.ep_dispatcher
            cm = disp.static_tokens(static_tokens) if disp is not None else contextlib.nullcontext()
            with cm:
                try:
                    # validated: the coordinator checked the batch
                    pending = self.runtime.launch(batch, hints, validated=True, num_steps=num_steps)
                except Exception as e:  # name the rank: compiled-graph errors do not carry the actor
                    raise RankStepError(f"rank {self.rank} ({self.runtime.device}): {type(e).__name__}: {e}") from e
            return Launched(pending, t0)
        except BaseException:
            self._done()
            raise

    def finish(self, step: Launched) -> tuple[Any, float]:
        """Wait for a launched step: (next tokens on TP rank 0 else None, seconds since its launch began)."""
        try:
            out = step.pending.result()
            dt = time.perf_counter() - step.t0
            self._times.append(dt)
            return (out if self._tp_rank == 0 else None), dt
        finally:
            self._done()

    def _done(self) -> None:
        self._in_flight -= 1
        if self._in_flight == 0:
            self._phase.leave()

    def times(self, clear: bool = False) -> list[float]:
        """The in-rank seconds of the recent steps, oldest first."""
        out = list(self._times)
        if clear:
            self._times.clear()
        return out
