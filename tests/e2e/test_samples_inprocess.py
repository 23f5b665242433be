"""`n > 1` through the real aiohttp app in-process (127.0.0.1) over the paged toy executor, whose steps the test
pauses: while 4 seeded samples decode, `/status` shows the prompt's full blocks referenced four times (shared, not
copied) and the samples' own blocks once each; afterwards every block is free and the samples equal the toy's
reference with their derived seeds."""
from __future__ import annotations

import asyncio
import contextlib
import threading

from aiohttp.test_utils import TestClient, TestServer

from engine import AsyncLLMEngine, EngineConfig, LLMEngine
from engine.samples import derive_seed
from engine.testing import PagedToyExecutor
from launch.metrics import ServerMetrics
from launch.server import ServerState, build_app

BS = 4
PROMPT = list(range(5, 31))  # 26 tokens: 6 full blocks before the last token


class PausingToy(PagedToyExecutor):
    """Steps block while `gate` is clear, from step `pause_at` on (`paused` is set when one waits)."""

    def __init__(self, pause_at: int, **kw):
        super().__init__(**kw)
        self.gate, self.paused, self.pause_at = threading.Event(), threading.Event(), pause_at
        self.count = 0

    def step(self, batches, num_steps=1):
        self.count += 1
        if self.count >= self.pause_at and not self.gate.is_set():
            self.paused.set()
            self.gate.wait(60)
        return super().step(batches, num_steps)


@contextlib.asynccontextmanager
async def serve(executor):
    metrics = ServerMetrics()
    state = ServerState(engine=AsyncLLMEngine(LLMEngine(executor, EngineConfig(max_num_seqs=8)), metrics),
                        metrics=metrics, model_name="toy")
    state.engine.start()
    try:
        async with TestClient(TestServer(build_app(state), host="127.0.0.1")) as client:
            yield client
    finally:
        executor.gate.set()
        state.engine.shutdown()


def test_n_samples_reference_the_prompts_blocks_in_status():
    ex = PausingToy(pause_at=4, num_kv_blocks=64, block_size=BS, max_model_len=128)  # 1: prompt, 2: forks, 3: decode

    async def main():
        async with serve(ex) as c:
            post = asyncio.create_task(c.post("/v1/completions", json={
                "prompt": PROMPT, "n": 4, "max_tokens": 10, "temperature": 1.0, "seed": 5}))
            while not ex.paused.is_set():
                await asyncio.sleep(0.01)
            for _ in range(100):  # the engine thread publishes its figures after the step that started the forks
                st = await (await c.get("/status")).json()
                if st["engine"]["running"] == 4:
                    break
                await asyncio.sleep(0.02)
            ex.gate.set()
            r = await post
            body = await r.json()
            for _ in range(100):
                after = await (await c.get("/status")).json()
                if after["engine"]["running"] == 0:
                    break
                await asyncio.sleep(0.02)
            return st, body, after

    st, body, after = asyncio.run(asyncio.wait_for(main(), 120))
    d = st["engine"]["dp_ranks"][0]
    assert st["engine"]["running"] == 4
    assert d["shared_kv_blocks"] == 6  # the prompt's full blocks, one copy referenced by the four samples
    assert d["referenced_kv_blocks"] == 6 + 4 * 1  # + each sample's own last block (26 + 2 tokens: 7 blocks each)
    assert d["prefix_cache"]["hits"] == 3 * 6 * BS
    samples = [c["token_ids"] for c in body["choices"]]
    assert samples == [ex.reference(PROMPT, 10, temperature=1.0, seed=derive_seed(5, i)) for i in range(4)]
    assert len({tuple(t) for t in samples}) == 4
    a = after["engine"]["dp_ranks"][0]
    assert a["referenced_kv_blocks"] == 0 and a["free_kv_blocks"] == 63 and a["prefix_cache"]["cached_blocks"] > 0
