"""`PipeLoop`: the resident step loop of the pipe step path in a rank (`RankWorker.start_pipe_loop`; the driver's side
is `actors.pipes.PipeStepper`), on a thread of its own. It reads packed requests (`actors.wire`) from the rank's
request FIFO and writes replies to its reply FIFO until the driver closes its end.

Replies go out in request order. A step is launched as soon as its request arrives, even while an earlier one still
runs on the device (the driver may submit ahead, `Coordinator.submit`); its reply is written once its tokens reached
the host. Between the two the loop polls both: the oldest pending step's event and the request pipe. After a step
that found nothing in flight the loop may arm the next decode step behind a gate (`actors.armed`): on its own when no
further request waits, or, when the runtime arms collectively (TP ranks), only when the request says so (ARM_NEXT);
a DISARM frame (no reply) cancels an arm.

The loop drives the rank through a `StepExecutor` (`actors.rank_steps.RankSteps`); the arming calls go to the
runtime (`actors.rank.RankRuntime`), tracing and profiling to a `StepTracer` (`actors.step_tracing`).
"""
from __future__ import annotations

import os
import select
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from actors.errors import RankStepError
from actors.pipes import read_frame, write_all
from actors.protocol import RankArgs
from actors.rank_steps import Launched
from actors.step_tracing import StepTracer
from actors.wire import (
    ARM_NEXT,
    DISARM,
    REPLY_ERROR,
    decode_request,
    encode_reply,
    encode_tokens,
    request_control,
)

PIPE_SPIN_S = 0.003  # how long a GPU rank's step loop polls for the next request before blocking


class StepExecutor(Protocol):
    """The rank side of the loop: launches this rank's steps and waits for them."""

    rank: int | None

    def bind_thread(self) -> None:
        """Make the calling thread the one that runs every later step (device, forward stream)."""

    def launch(self, args: RankArgs, static_tokens: int | None, num_steps: int = 1) -> Launched:
        """Enqueue one step (a decoded request: this rank's (batch, hints), the EP row count, the decode steps)
        without waiting for it; an exception names the rank."""

    def finish(self, step: Launched) -> tuple[Any, float]:
        """Wait for a launched step: (next tokens on TP rank 0 else None, in-rank seconds)."""


class PipeLoop:
    """One per rank, started again for every pipe step path the coordinator sets up. A failed collective arm is
    kept across them: every later step of the rank fails (its peers armed theirs)."""

    def __init__(self, steps: StepExecutor, runtime: Any, tracer: StepTracer, log: Callable[..., None]) -> None:
        self._steps, self._runtime, self._tracer, self._log = steps, runtime, tracer, log
        self._arm_failure: BaseException | None = None

    def start(self, request_path: str, reply_path: str) -> threading.Thread:
        """Open the reply FIFO (the driver already holds its read end) and start the loop's thread."""
        reply = os.open(reply_path, os.O_WRONLY)
        thread = threading.Thread(target=self.run, args=(request_path, reply), daemon=True,
                                  name=f"graphline-step-loop-{self._steps.rank}")
        thread.start()
        return thread

    def run(self, request_path: str, reply: int) -> None:
        import torch

        steps, runtime, tracer = self._steps, self._runtime, self._tracer
        request = os.open(request_path, os.O_RDONLY)  # blocks until the driver opens its end
        steps.bind_thread()  # this thread runs every step on the forward stream
        # A GPU rank polls for the next request for a moment after each reply (the driver usually sends it
        # within a millisecond) instead of sleeping in read(): a wake-up from a blocking read costs tens of
        # microseconds on a busy host. CPU ranks always block (their cores run the model).
        spin_s = PIPE_SPIN_S if runtime.device.type == "cuda" else 0.0
        pending: deque[Any] = deque()  # Launched steps, or reply frames (idle steps, errors), in request order

        def error_frame(e: BaseException) -> bytes:
            text = str(e) if isinstance(e, RankStepError) else f"rank {steps.rank}: {type(e).__name__}: {e}"
            return encode_reply(REPLY_ERROR, 0.0, text.encode("utf-8", "replace")[:4000])

        def reply_ready() -> None:
            while pending and (isinstance(pending[0], bytes) or pending[0].pending.ready()):
                item = pending.popleft()
                trace = None if isinstance(item, bytes) else item.trace
                if trace is not None:
                    tracer.ready(trace)
                if not isinstance(item, bytes):
                    try:
                        item = encode_tokens(*steps.finish(item))
                    except Exception as e:  # noqa: BLE001 - a device error surfaces here
                        item = error_frame(e)
                write_all(reply, item)
                if trace is not None:
                    tracer.written(trace)

        profile = tracer.start_profile()  # bench.step_trace --profile: where this thread's host time goes
        try:
            with torch.inference_mode():  # once for every step this thread runs (`RankRuntime.launch`)
                while True:
                    reply_ready()
                    if pending:  # a step runs: reply when it finishes, unless the next request comes first
                        if not select.select([request], [], [], 0)[0]:
                            continue
                    elif spin_s:
                        deadline = time.perf_counter() + spin_s
                        while time.perf_counter() < deadline and not select.select([request], [], [], 0)[0]:
                            pass
                    body = read_frame(request)
                    if body is None:  # the driver closed the pipe: the step path was torn down
                        return
                    t_read = time.perf_counter()
                    strict = not pending  # nothing in flight: the driver waited for the previous step's tokens
                    control = request_control(body)
                    if control & DISARM:  # no reply: the driver went idle after an arm_next step
                        runtime.disarm()
                        continue
                    try:
                        if self._arm_failure is not None:
                            raise self._arm_failure
                        decoded = decode_request(body)
                        if decoded is None:
                            pending.append(encode_tokens(None, 0.0))
                        elif tracer.enabled:
                            pending.append(tracer.launch(steps.launch, runtime, decoded, t_read))
                        else:
                            pending.append(steps.launch(*decoded))
                    except Exception as e:  # noqa: BLE001 - reported to the driver, which tears the group down
                        pending.append(error_frame(e))
                        continue
                    if decoded is None:
                        continue
                    if runtime.arms_collectively:  # the driver decides, for every rank alike
                        if control & ARM_NEXT:
                            self._arm_next()
                    elif strict and spin_s and not select.select([request], [], [], 0)[0]:
                        self._arm_next()
        except OSError:
            return  # the driver went away mid-write
        finally:
            runtime.disarm()
            tracer.stop_profile(profile, steps.rank)
            os.close(request)
            os.close(reply)

    def _arm_next(self) -> None:
        """The next request will likely wait for the step just launched: enqueue it now behind a gate, while the
        device runs this one (`actors.armed`). A failure to arm is logged and turns arming off; the step
        already launched is not affected."""
        runtime = self._runtime
        try:
            runtime.arm_next()
        except Exception as e:  # noqa: BLE001
            self._log("arming_failed", error=repr(e))
            if runtime.arms_collectively:  # the peers armed: the next cancel would not match theirs
                self._arm_failure = RankStepError(f"rank {self._steps.rank}: arming the next tensor-parallel decode "
                                                  f"step failed ({type(e).__name__}: {e}); its peers armed theirs")
            runtime.stop_arming()
