"""The pipe step path's rank-side loop (`actors.pipe_loop.PipeLoop`) without Ray or a model: a fake `StepExecutor` and
runtime over real FIFOs. Replies go out in request order while steps are in flight, idle and failed steps get their
frames, a disarm frame gets none, and a failed collective arm fails every later step."""
from __future__ import annotations

import dataclasses
import os
import select
import threading
from types import SimpleNamespace

import numpy as np
import pytest

from actors.batch import StepBatch
from actors.errors import RankStepError
from actors.pipe_loop import PipeLoop, StepExecutor
from actors.pipes import read_frame
from actors.protocol import plan_step
from actors.rank_steps import Launched
from actors.step_tracing import StepTracer
from actors.wire import (
    REPLY_ERROR,
    REPLY_NONE,
    REPLY_OK,
    decode_reply,
    encode_disarm,
    encode_request,
)


class _Pending:
    def __init__(self, tokens: np.ndarray, gate: threading.Event | None = None):
        self.tokens, self.gate = tokens, gate

    def ready(self) -> bool:
        return self.gate is None or self.gate.is_set()

    def result(self) -> np.ndarray:
        return self.tokens


class _Executor:
    """A `StepExecutor`: step k (1-based) returns tokens [k] * batch size; `gates[k]` holds step k back."""

    def __init__(self) -> None:
        self.rank = 3
        self.launched = 0
        self.gates: dict[int, threading.Event] = {}
        self.fail_at: int | None = None
        self.bound = 0

    def bind_thread(self) -> None:
        self.bound += 1

    def launch(self, args: tuple, static_tokens: int | None, num_steps: int = 1) -> Launched:
        self.launched += 1
        if self.launched == self.fail_at:
            raise ValueError("boom")
        batch = args[0]
        return Launched(_Pending(np.full(batch.batch_size, self.launched, np.int64), self.gates.get(self.launched)), 0.0)

    def finish(self, step: Launched) -> tuple[np.ndarray, float]:
        return step.pending.result(), 0.001


class _Runtime:
    def __init__(self, collective: bool = False) -> None:
        self.device = SimpleNamespace(type="cpu")
        self.arms_collectively = collective
        self.calls: list[str] = []
        self.arm_error: Exception | None = None

    def disarm(self) -> None:
        self.calls.append("disarm")

    def arm_next(self) -> None:
        self.calls.append("arm_next")
        if self.arm_error is not None:
            raise self.arm_error

    def stop_arming(self) -> None:
        self.calls.append("stop_arming")


@pytest.fixture
def loop_pipes(tmp_path):
    """Start a loop over fresh FIFOs: yields (start(executor, runtime) -> (send, recv, log), ...) and joins it."""
    state: dict = {}

    def start(executor: StepExecutor, runtime: _Runtime):
        req, resp = str(tmp_path / "req"), str(tmp_path / "resp")
        os.mkfifo(req)
        os.mkfifo(resp)
        reply = os.open(resp, os.O_RDONLY | os.O_NONBLOCK)  # the driver's order: reply read end first
        log: list[tuple[str, dict]] = []
        thread = PipeLoop(executor, runtime, StepTracer(), lambda kind, **d: log.append((kind, d))).start(req, resp)
        request = os.open(req, os.O_WRONLY)
        os.set_blocking(reply, True)
        state.update(thread=thread, request=request, reply=reply)

        def send(frame: bytes) -> None:
            os.write(request, frame)

        def recv(timeout_s: float = 5.0):
            if not select.select([reply], [], [], timeout_s)[0]:
                return None
            body = read_frame(reply)
            return None if body is None else decode_reply(bytes(body))

        return send, recv, log

    yield start
    if "request" in state:
        os.close(state["request"])
        state["thread"].join(timeout=10)
        assert not state["thread"].is_alive()
        assert read_frame(state["reply"]) is None  # the loop closed its end
        os.close(state["reply"])


def _frame(batch_size: int = 2, **replace) -> bytes:
    b = StepBatch.from_sequences([[1]] * batch_size, [4] * batch_size, [[2]] * batch_size)
    plan = plan_step([b], cross_dp=False, decode_buckets=[1, 2, 4], token_buckets=[16])
    return encode_request(dataclasses.replace(plan, **replace) if replace else plan, 0)


def _idle_frame() -> bytes:
    b = StepBatch.from_sequences([[1]], [4], [[2]])
    return encode_request(plan_step([b, None], cross_dp=False, decode_buckets=[1], token_buckets=[16]), 1)


def test_replies_go_out_in_request_order_while_steps_run_ahead(loop_pipes):
    ex, rt = _Executor(), _Runtime()
    gate = ex.gates[1] = threading.Event()
    send, recv, _ = loop_pipes(ex, rt)
    send(_frame(2))
    send(_frame(3))  # launched while step 1 is still on the "device"
    assert recv(0.3) is None  # step 2 is done, but step 1's reply goes first
    assert ex.launched == 2
    gate.set()
    for k, size in ((1, 2), (2, 3)):
        status, seconds, tokens = recv()
        assert status == REPLY_OK and seconds == 0.001 and tokens.tolist() == [k] * size
    assert ex.bound == 1 and "arm_next" not in rt.calls  # CPU ranks never arm


def test_idle_and_failed_steps_get_frames_and_the_loop_goes_on(loop_pipes):
    ex, rt = _Executor(), _Runtime()
    ex.fail_at = 1
    send, recv, _ = loop_pipes(ex, rt)
    send(_frame(1))
    status, _, text = recv()
    assert status == REPLY_ERROR and text == "rank 3: ValueError: boom"
    send(_idle_frame())
    assert recv()[0] == REPLY_NONE
    send(_frame(1))
    assert recv()[2].tolist() == [2]


def test_a_step_error_naming_its_rank_is_sent_as_it_is(loop_pipes):
    ex, rt = _Executor(), _Runtime()

    def launch(args, static_tokens, num_steps=1):
        raise RankStepError("rank 3 (cpu): RuntimeError: device lost")

    ex.launch = launch
    send, recv, _ = loop_pipes(ex, rt)
    send(_frame(1))
    assert recv()[1:] == (0.0, "rank 3 (cpu): RuntimeError: device lost")


def test_collective_arming_follows_the_request_and_a_failed_arm_fails_every_later_step(loop_pipes):
    ex, rt = _Executor(), _Runtime(collective=True)
    send, recv, log = loop_pipes(ex, rt)
    send(_frame(1))  # no ARM_NEXT: a collectively arming rank does not arm on its own
    assert recv()[0] == REPLY_OK and "arm_next" not in rt.calls
    send(_frame(1, arm_next=True))
    assert recv()[0] == REPLY_OK and rt.calls == ["arm_next"]
    send(encode_disarm())  # no reply
    assert recv(0.3) is None and rt.calls == ["arm_next", "disarm"]
    rt.arm_error = RuntimeError("no gate")
    send(_frame(1, arm_next=True))
    assert recv()[0] == REPLY_OK  # the step already launched is not affected
    assert rt.calls[-2:] == ["arm_next", "stop_arming"]
    assert [kind for kind, _ in log] == ["arming_failed"] and "no gate" in log[0][1]["error"]
    for frame in (_frame(1), _idle_frame()):
        send(frame)
        status, _, text = recv()
        assert status == REPLY_ERROR and text.startswith("rank 3: arming the next tensor-parallel decode step failed")
    assert ex.launched == 3
