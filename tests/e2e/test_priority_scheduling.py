"""`graphline serve --scheduling-policy priority` on a real server on 127.0.0.1: with one running sequence at a time
and a long request holding it, requests queued together are answered lowest `priority` first, whatever order they
arrived in; a server with the default policy refuses a non-zero `priority` with a 400 naming it."""
from __future__ import annotations

import asyncio
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
