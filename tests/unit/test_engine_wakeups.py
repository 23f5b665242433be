"""How `AsyncLLMEngine`'s threads wake each other: `Wakeup` (binary semaphore), `submit(wake=False)` + `wake()`,
and the first-token hand-off (the event loop has the first token before the engine thread's next step)."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from engine import AsyncLLMEngine, EngineConfig, LLMEngine
from engine.async_engine import HANDOFF_MAX_OUTPUTS
from engine.streams import Wakeup
from engine.testing import PagedToyExecutor


def test_wakeup_keeps_a_set_before_the_wait_and_counts_several_as_one():
    w = Wakeup()
    assert not w.wait(0.01)  # not set: times out
    w.set()
    w.set()  # idempotent until the next wait
    assert w.wait(0.01)
    assert not w.wait(0.01)  # the two sets were one
    t = threading.Timer(0.05, w.set)
    t.start()
    assert w.wait(5)  # set from another thread while waiting
    t.join()


class _TimedToy(PagedToyExecutor):
    """Records when each step starts (engine thread)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.step_starts: list[float] = []

    def step(self, batches, num_steps=1):
        self.step_starts.append(time.perf_counter())
        return super().step(batches, num_steps)


def _engine(handoff_s: float = 0.001, **kw) -> tuple[AsyncLLMEngine, _TimedToy]:
    ex = _TimedToy(num_kv_blocks=64, block_size=4, **kw)
    return AsyncLLMEngine(LLMEngine(ex, EngineConfig(max_num_seqs=16)), first_token_handoff_s=handoff_s), ex


def test_submit_without_wake_waits_for_wake_and_then_completes():
    async def main():
        aeng, ex = _engine()
        aeng.start()
        try:
            stream = aeng.submit(aeng.make_request([1, 2, 3], max_tokens=4), wake=False)
            await asyncio.sleep(0.2)
            assert ex.step_starts == [] and aeng.engine.num_unfinished == 0  # queued, the engine thread asleep
            aeng.wake()
            toks = [t async for out in stream for t in out.new_token_ids]
            assert toks == ex.reference([1, 2, 3], 4)
            # another submission wakes the engine thread for one queued without a wake too
            s1 = aeng.submit(aeng.make_request([4, 5], max_tokens=2), wake=False)
            s2 = aeng.submit(aeng.make_request([6, 7], max_tokens=2))
            assert [t async for out in s1 for t in out.new_token_ids] == ex.reference([4, 5], 2)
            assert [t async for out in s2 for t in out.new_token_ids] == ex.reference([6, 7], 2)
        finally:
            aeng.shutdown()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_first_token_reaches_the_event_loop_before_the_next_step():
    """With the hand-off (a long bound, so that only the event loop can end the wait) the consumer has each request's
    first token before the engine thread starts the step after the one that produced it."""
    async def main():
        aeng, ex = _engine(handoff_s=30.0)
        aeng.start()
        try:
            for prompt in ([1, 2, 3], [9, 8, 7, 6, 5]):
                got_first = None
                async for out in aeng.generate(aeng.make_request(prompt, max_tokens=3)):
                    if got_first is None:
                        got_first = time.perf_counter()
                        n_steps = len(ex.step_starts)
                await asyncio.sleep(0)
                assert len(ex.step_starts) > n_steps  # the later steps ran, all after the first token arrived
                assert all(t > got_first for t in ex.step_starts[n_steps:])
        finally:
            aeng.shutdown()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_no_hand_off_for_a_large_batch_or_when_disabled():
    """Steps of more than `HANDOFF_MAX_OUTPUTS` requests (and any step with the hand-off off) never wait for the
    event loop: with a loop that is blocked, the engine thread still runs every step."""
    async def main(n, handoff):
        aeng, ex = _engine(handoff_s=handoff)
        aeng.start()
        try:
            streams = [aeng.submit(aeng.make_request([1 + i, 2, 3], max_tokens=3), wake=False) for i in range(n)]
            aeng.wake()  # all in one first step
            deadline = time.monotonic() + 20
            while aeng.engine.num_unfinished or not ex.step_starts:  # the event loop blocked: nobody dispatches
                assert time.monotonic() < deadline, "the engine thread waited for the event loop"
                time.sleep(0.01)
            for s in streams:
                assert sum([len(o.new_token_ids) async for o in s]) == 3
        finally:
            aeng.shutdown()

    asyncio.run(asyncio.wait_for(main(HANDOFF_MAX_OUTPUTS + 1, 30.0), 60))
    asyncio.run(asyncio.wait_for(main(1, 0.0), 60))


def test_first_token_handoff_bound_is_checked():
    ex = _TimedToy(num_kv_blocks=64, block_size=4)
    for bad in (-0.001, float("nan"), float("inf"), "1", True):
        with pytest.raises(ValueError, match="first_token_handoff_s"):
            AsyncLLMEngine(LLMEngine(ex, EngineConfig(max_num_seqs=16)), first_token_handoff_s=bad)
