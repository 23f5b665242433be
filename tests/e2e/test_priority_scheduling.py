"""`graphline serve --scheduling-policy priority` on a real server on 127.0.0.1: with one running sequence at a time
and a long request holding it, requests queued together are answered lowest `priority` first, whatever order they
arrived in, and one with a lower value than the running request preempts it; a server with the default policy
refuses a non-zero `priority` with a 400 naming it."""
from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest

from e2e_support import TINY_ARGS, graphline, start_server


def _serve(*extra: str):
    return start_server(graphline("serve", *TINY_ARGS, "--executor", "local", "--port", "0", *extra))


@pytest.fixture(scope="module")
def srv():
    s = _serve("--scheduling-policy", "priority", "--max-num-seqs", "1")
    yield s
    s.stop()


async def _queued_behind_a_long_request(url: str, priorities: list[int]) -> list[int]:
    long = {"prompt": [1, 2, 3], "max_tokens": 80, "temperature": 0, "ignore_eos": True, "stream": True}
    done: list[tuple[float, int]] = []
    async with aiohttp.ClientSession() as s:
        held = await s.post(url + "/v1/completions", json=long)
        assert held.status == 200 and (await held.content.readline()).startswith(b"data: {")

        async def one(p: int) -> None:
            body = {"prompt": [4, 5, 6], "max_tokens": 2, "ignore_eos": True, "priority": p}
            async with s.post(url + "/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
                await r.json()
            done.append((time.monotonic(), p))

        await asyncio.gather(*[one(p) for p in priorities])
        async for _ in held.content:
            pass
        held.release()
    return [p for _, p in sorted(done)]


def test_queued_requests_are_answered_lowest_priority_first(srv):
    order = asyncio.run(asyncio.wait_for(_queued_behind_a_long_request(srv.url, [5, 0, -5, 3]), 120))
    assert order == [-5, 0, 3, 5]


def test_the_default_policy_refuses_a_priority():
    s = _serve()
    try:
        async def main():
            async with aiohttp.ClientSession() as c:
                out = []
                for body in ({"prompt": [1], "max_tokens": 1, "priority": 1},
                             {"prompt": [1], "max_tokens": 1, "priority": "high"},
                             {"prompt": [1], "max_tokens": 1, "priority": 0}):
                    async with c.post(s.url + "/v1/completions", json=body) as r:
                        out.append((r.status, await r.json()))
                return out

        refused, bad, zero = asyncio.run(asyncio.wait_for(main(), 60))
        assert refused[0] == 400 and refused[1]["error"]["param"] == "priority"
        assert "--scheduling-policy priority" in refused[1]["error"]["message"]
        assert bad[0] == 400 and bad[1]["error"]["param"] == "priority" and zero[0] == 200
    finally:
        s.stop()


def test_a_higher_priority_request_preempts_the_running_one(srv):
    """One sequence slot, a long request of priority 0 decoding: a request of priority -1 preempts it and is
    answered while the long one waits (its last tokens arrive after), then the long one recomputes and ends with
    all its tokens."""
    async def main():
        long = {"prompt": [1, 2, 3], "max_tokens": 110, "temperature": 0, "ignore_eos": True, "stream": True}
        async with aiohttp.ClientSession() as s:
            held = await s.post(srv.url + "/v1/completions", json=long)
            assert held.status == 200 and (await held.content.readline()).startswith(b"data: {")
            seen = {"tokens": 0, "last": 0.0}

            async def read_long() -> None:  # as the chunks arrive
                async for line in held.content:
                    if line.startswith(b"data: {"):
                        seen["tokens"] += sum(len(c.get("token_ids") or []) for c in json.loads(line[6:])["choices"])
                        seen["last"] = time.monotonic()

            reader = asyncio.create_task(read_long())
            body = {"prompt": [4, 5, 6], "max_tokens": 2, "ignore_eos": True, "priority": -1}
            async with s.post(srv.url + "/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
                urgent = await r.json()
            urgent_done = time.monotonic()
            await reader
            held.release()
            return urgent, urgent_done, seen

    before = _value(asyncio.run(_metrics(srv.url)), "graphline_preemptions_total")
    urgent, urgent_done, seen = asyncio.run(asyncio.wait_for(main(), 120))
    assert urgent["usage"]["completion_tokens"] == 2 and urgent_done < seen["last"]
    assert seen["tokens"] >= 100  # the rest of the long request's 110 tokens (the first chunk was read before)
    assert _value(asyncio.run(_metrics(srv.url)), "graphline_preemptions_total") == before + 1


async def _metrics(url: str) -> str:
    async with aiohttp.ClientSession() as s:
        async with s.get(url + "/metrics") as r:
            return await r.text()


def _value(text: str, name: str) -> float:
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))
