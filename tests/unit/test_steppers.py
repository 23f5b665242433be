"""The step paths and executors declare what they do (`actors.protocol.Stepper` / `PipelinedStepper`,
`engine.executor.RebuildableExecutor`), and the coordinator and engine act on those declarations: a pipelined
stepper is sent to at submit and received from at collect, any other runs the whole step at submit; only an
executor that can rebuild is rebuilt."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from actors.batch import StepBatch
from actors.coordinator import Coordinator, DeploymentConfig
from actors.pipes import PipeStepper
from actors.protocol import PipelinedStepper, StepHints, StepPlan, Stepper
from actors.rank import RuntimeConfig
from actors.rankset import CompiledStepper, PlainStepper
from engine.executor import LocalEngineExecutor, RebuildableExecutor
from engine.testing import PagedToyExecutor


@pytest.mark.parametrize("cls, pipelined", [(PipeStepper, True), (PlainStepper, False), (CompiledStepper, False)])
def test_every_step_path_declares_its_protocol_and_implements_it(cls, pipelined):
    proto = PipelinedStepper if pipelined else Stepper
    assert proto in cls.__mro__ and cls.pipelined is pipelined and cls.name in ("pipe", "plain", "compiled")
    members = ("run", "teardown") + (("send", "receive") if pipelined else ())
    for m in members:  # its own code, not the protocol's stub
        assert getattr(cls, m) is not getattr(proto, m), (cls.__name__, m)
    if not pipelined:
        assert not hasattr(cls, "send") and not hasattr(cls, "receive")


class _Recording:
    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def _outs(self, plan: StepPlan) -> list[tuple[Any, float]]:
        b = plan.batches[0]
        return [(np.full(b.batch_size, 7, np.int64), 0.001)]  # one rank's tokens

    def teardown(self) -> None:
        self.calls.append(("teardown", None))


class _Pipelined(_Recording, PipelinedStepper):
    name = "pipe"

    def run(self, plan: StepPlan, timeout_s: float) -> list[tuple[Any, float]]:
        raise AssertionError("the coordinator sends and receives on a pipelined stepper")

    def send(self, plan: StepPlan) -> None:
        self.calls.append(("send", plan))

    def receive(self, plan: StepPlan, timeout_s: float) -> list[tuple[Any, float]]:
        self.calls.append(("receive", plan))
        return self._outs(plan)


class _Whole(_Recording, Stepper):
    name = "plain"

    def run(self, plan: StepPlan, timeout_s: float) -> list[tuple[Any, float]]:
        self.calls.append(("run", plan))
        return self._outs(plan)


def _serving(stepper: Stepper) -> Coordinator:
    """A serving coordinator without Ray (the state `start()` leaves behind) over `stepper`."""
    coord = Coordinator(DeploymentConfig(runtime=RuntimeConfig(block_size=4, max_model_len=64, num_kv_blocks=32)))
    coord._state, coord._stepper = "serving", stepper
    coord._model_config = SimpleNamespace(vocab_size=100)
    coord._num_kv_blocks, coord._sizes = 32, ([1, 2, 4], [16])
    return coord


def test_a_pipelined_stepper_is_sent_at_submit_and_received_at_collect():
    st = _Pipelined()
    coord = _serving(st)
    batch = StepBatch.from_sequences([[1, 2, 3]], [0], [[1]])
    ticket = coord.submit([batch])
    assert [c for c, _ in st.calls] == ["send"] and ticket.outs is None
    plan = st.calls[0][1]
    assert plan.hints == StepHints() and plan.batches == (batch,)
    assert coord.collect(ticket)[0].tolist() == [7]
    assert [c for c, _ in st.calls] == ["send", "receive"] and st.calls[1][1] is plan


def test_any_other_stepper_runs_the_whole_step_at_submit():
    st = _Whole()
    coord = _serving(st)
    ticket = coord.submit([StepBatch.from_sequences([[1, 2], [3]], [0, 0], [[1], [2]])])
    assert [c for c, _ in st.calls] == ["run"] and ticket.outs is not None
    assert coord.collect(ticket)[0].tolist() == [7, 7]
    assert [c for c, _ in st.calls] == ["run"]


def test_only_an_executor_that_rebuilds_is_a_rebuildable_one():
    assert issubclass(PagedToyExecutor, RebuildableExecutor) and isinstance(PagedToyExecutor(), RebuildableExecutor)
    assert not issubclass(LocalEngineExecutor, RebuildableExecutor)
    assert hasattr(Coordinator, "rebuild")  # structurally one (actors cannot import the engine's protocol)
    assert isinstance(Coordinator(DeploymentConfig()), RebuildableExecutor)
