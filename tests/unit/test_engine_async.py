"""`AsyncLLMEngine`: streaming, many concurrent requests, aborts, reset mid-flight, executor failures."""
from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from engine import AsyncLLMEngine, EngineConfig, EngineFailedError, EngineObserver, FinishReason, LLMEngine
from engine.testing import PagedToyExecutor


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def _engine(**kw) -> tuple[AsyncLLMEngine, PagedToyExecutor]:
    ex = PagedToyExecutor(**{"num_kv_blocks": 64, "block_size": 4, **kw})
    return AsyncLLMEngine(LLMEngine(ex, EngineConfig(max_num_seqs=16))), ex


async def _collect(aeng: AsyncLLMEngine, prompt, max_tokens=8, **kw):
    toks, chunks, last = [], 0, None
    async for out in aeng.generate(aeng.make_request(prompt, max_tokens=max_tokens, **kw)):
        toks.extend(out.new_token_ids)
        chunks += 1
        last = out
    return toks, chunks, last


def test_streams_tokens_as_they_come_and_equals_offline():
    async def main():
        aeng, ex = _engine()
        aeng.start()
        toks, chunks, last = await _collect(aeng, [1, 2, 3], 8)
        aeng.shutdown()
        return toks, chunks, last, ex

    toks, chunks, last, ex = _run(main())
    assert toks == ex.reference([1, 2, 3], 8) == last.token_ids
    assert chunks == 8 and last.finished and last.finish_reason is FinishReason.LENGTH


def test_many_concurrent_requests_under_memory_pressure():
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 97, int(rng.integers(2, 10))).tolist() for _ in range(40)]

    async def main():
        aeng, ex = _engine(num_kv_blocks=20, dp_size=2)
        aeng.start()
        res = await asyncio.gather(*[_collect(aeng, p, 12) for p in prompts])
        stats = aeng.stats()
        aeng.shutdown()
        return res, ex, stats

    res, ex, stats = _run(main())
    assert [r[0] for r in res] == [ex.reference(p, 12) for p in prompts]
    assert stats["preemptions"] > 0 and stats["in_flight"] == 0 and stats["running"] == 0


def test_consumer_leaving_early_aborts_the_request():
    async def main():
        aeng, ex = _engine(step_delay_s=0.002)
        aeng.start()
        agen = aeng.generate(aeng.make_request([1, 2], max_tokens=200))
        async for _ in agen:
            break
        await agen.aclose()
        for _ in range(100):
            if not aeng.engine.has_unfinished():
                break
            await asyncio.sleep(0.01)
        stats = aeng.stats()
        aeng.shutdown()
        return stats

    stats = _run(main())
    assert stats["requests_aborted"] == 1 and stats["running"] == 0 and stats["in_flight"] == 0
    assert stats["dp_ranks"][0]["free_kv_blocks"] == 63


def test_reset_mid_flight_keeps_outputs_identical():
    class Obs(EngineObserver):
        resets = []

        def on_reset(self, result):
            self.resets.append(result)

    async def main():
        ex = PagedToyExecutor(num_kv_blocks=64, block_size=4, step_delay_s=0.002)
        obs = Obs()
        aeng = AsyncLLMEngine(LLMEngine(ex, EngineConfig()), obs)
        aeng.start()
        tasks = [asyncio.create_task(_collect(aeng, [i + 1, i + 2], 30)) for i in range(4)]
        await asyncio.sleep(0.03)
        result = await aeng.reset(num_kv_blocks=48)
        res = await asyncio.gather(*tasks)
        st = aeng.stats()
        aeng.shutdown()
        return res, ex, result, st, obs

    res, ex, result, st, obs = _run(main())
    assert [r[0] for r in res] == [ex.reference([i + 1, i + 2], 30) for i in range(4)]
    assert ex.resets == 1 and result["preempted"] >= 1 and obs.resets
    assert st["limits"]["num_kv_blocks"] == 48 and st["dp_ranks"][0]["free_kv_blocks"] == 47


def test_executor_failure_requeues_in_flight_requests_and_they_complete_unchanged():
    class Obs(EngineObserver):
        failures = []

        def on_failure(self, message):
            self.failures.append(message)

    async def main():
        ex = PagedToyExecutor(num_kv_blocks=64, block_size=4)
        obs = Obs()
        aeng = AsyncLLMEngine(LLMEngine(ex, EngineConfig()), obs)
        aeng.start()
        ex.fail_next = 1
        survived, _, _ = await _collect(aeng, [1, 2, 3], 5)  # requeued after the failure, recomputed, completed
        ex.fail_next = 2  # two failures in a row: the request was requeued once already, so it fails
        with pytest.raises(EngineFailedError, match="failed twice"):
            await _collect(aeng, [4, 5, 6], 5)
        toks, _, _ = await _collect(aeng, [1, 2, 3], 5)  # rebuilt, serving again
        aeng.shutdown()
        return survived, toks, ex, obs

    survived, toks, ex, obs = _run(main())
    assert survived == toks == ex.reference([1, 2, 3], 5)
    assert ex.rebuilds == 3 and len(obs.failures) == 3


def test_dead_engine_refuses_requests():
    async def main():
        ex = PagedToyExecutor()

        def broken():
            raise RuntimeError("cluster gone")

        ex.rebuild = broken
        aeng = AsyncLLMEngine(LLMEngine(ex, EngineConfig()))
        aeng.start()
        ex.fail_next = 1
        with pytest.raises(EngineFailedError):
            await _collect(aeng, [1], 3)
        with pytest.raises(EngineFailedError, match="could not be restarted"):
            aeng.submit(aeng.make_request([1], max_tokens=2))
        dead = aeng.dead
        aeng.shutdown()
        return dead

    assert "could not be restarted" in _run(main())


def test_executor_status_is_read_by_the_status_thread_and_answers_during_a_slow_step():
    async def main():
        ex = PagedToyExecutor(num_kv_blocks=64, block_size=4, step_delay_s=1.5)
        aeng = AsyncLLMEngine(LLMEngine(ex, EngineConfig()))
        aeng.status_interval_s = 0.05
        calls = []
        orig = ex.status

        def status():
            import threading

            calls.append(threading.current_thread().name)
            return orig()

        ex.status = status
        aeng.start()
        task = asyncio.create_task(_collect(aeng, [1, 2, 3], 2))  # each step takes 1.5 s
        await asyncio.sleep(0.3)
        t0 = time.perf_counter()
        during = await aeng.executor_status()
        health = aeng.health()
        stats = aeng.stats()
        answered_s = time.perf_counter() - t0
        await task
        aeng.shutdown()
        return during, health, stats, answered_s, calls

    during, health, stats, answered_s, calls = _run(main())
    assert answered_s < 0.1 and during and health["ok"] and stats["waiting"] + stats["running"] == 1
    # the first read at start(), before any step; every later one on the status thread, never the engine thread
    assert calls[0] == "MainThread" and set(calls[1:]) == {"graphline-status"} and len(calls) > 3


def test_a_failed_reset_requeues_in_flight_requests_and_rebuilds():
    async def main():
        ex = PagedToyExecutor(num_kv_blocks=64, block_size=4, step_delay_s=0.002)

        def broken_reset(**kw):
            raise RuntimeError("rank 1 died during reset")

        ex.reset = broken_reset
        aeng = AsyncLLMEngine(LLMEngine(ex, EngineConfig()))
        aeng.start()
        task = asyncio.create_task(_collect(aeng, [1, 2, 3], 50))
        await asyncio.sleep(0.02)
        with pytest.raises(EngineFailedError, match="reset failed"):
            await aeng.reset()
        survived, _, _ = await task  # preempted by the reset, requeued, recomputed after the rebuild
        toks, _, _ = await _collect(aeng, [1, 2, 3], 5)
        log = list(aeng.failure_log)
        aeng.shutdown()
        return survived, toks, ex, log

    survived, toks, ex, log = _run(main())
    assert survived == ex.reference([1, 2, 3], 50) and toks == ex.reference([1, 2, 3], 5)
    assert ex.rebuilds == 1 and "reset failed" in log[0]["message"]
