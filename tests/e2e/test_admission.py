"""Admission control (`graphline serve --max-concurrent-requests N`) on a real server on 127.0.0.1: with N engine
requests in flight (a request's n choices count n), the next one is refused with 429, `Retry-After` and an OpenAI
error body, before anything is queued; the requests in flight finish untouched, and once they have, requests are
served again. `/status` (`admission`) and `/metrics` (`graphline_requests_in_flight`,
`graphline_max_concurrent_requests`) show the requests held and the bound. A bound below 1 is a one-line start-up
error."""
from __future__ import annotations

import asyncio
import json
import subprocess

import aiohttp
import pytest

from e2e_support import REPO, TINY_ARGS, clean_env, graphline, openai_client, start_server

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def srv():
    s = start_server(graphline("serve", *TINY_ARGS, "--executor", "local", "--max-decode-batch", "4",
                               "--pcg-max-tokens", "0", "--no-progress", "--port", "0",
                               "--max-concurrent-requests", "2"))
    yield s
    s.stop()


async def _lines(first: bytes, rest):
    yield first
    async for raw in rest:
        yield raw


async def _hold_two_and_knock(url: str) -> tuple[list, list]:
    long = {"prompt": [1, 2, 3], "max_tokens": 100, "temperature": 0, "ignore_eos": True, "stream": True}
    async with aiohttp.ClientSession() as s:
        held = [await s.post(url + "/v1/completions", json=long) for _ in range(2)]
        firsts = []
        for r in held:
            firsts.append(await r.content.readline())
            assert r.status == 200 and firsts[-1].startswith(b"data: {")
        async with s.get(url + "/status") as r:
            admission = (await r.json())["admission"]
        async with s.get(url + "/metrics") as r:
            exposition = await r.text()
        assert admission == {"in_flight": 2, "max_in_flight": 2}, admission
        assert "graphline_requests_in_flight 2.0" in exposition and "graphline_max_concurrent_requests 2.0" in \
            exposition
        knocks = []
        for body in ({"prompt": [4, 5], "max_tokens": 2}, {"prompt": [4, 5], "max_tokens": 2, "stream": True}):
            async with s.post(url + "/v1/completions", json=body) as r:
                knocks.append((r.status, r.headers.get("Retry-After"), await r.json()))
        tokens = []
        for r, first in zip(held, firsts):
            ids = []
            async for raw in _lines(first, r.content):
                line = raw.decode().strip()
                if line.startswith("data: {"):
                    ids += [t for c in json.loads(line[6:])["choices"] for t in c["token_ids"]]
            tokens.append(len(ids))
            r.release()
        return knocks, tokens


def test_a_full_server_refuses_with_429_and_serves_again(srv):
    knocks, tokens = asyncio.run(asyncio.wait_for(_hold_two_and_knock(srv.url), 120))
    for status, retry, body in knocks:
        assert status == 429 and retry == "1", body
        assert body["error"]["code"] == "server_busy" and "--max-concurrent-requests" in body["error"]["message"]
    assert tokens == [100, 100]  # the requests in flight were not disturbed
    client = openai_client(srv)
    with pytest.raises(openai.RateLimitError):  # n = 3 choices never fit a bound of 2
        client.completions.create(model="qwen3-tiny", prompt=[1, 2], max_tokens=2, n=3, temperature=1.0)
    ok = client.completions.create(model="qwen3-tiny", prompt=[1, 2], max_tokens=2, n=2, temperature=1.0,
                                   extra_body={"ignore_eos": True})
    assert [c.finish_reason for c in ok.choices] == ["length", "length"]


def test_a_bound_below_one_is_a_start_up_error():
    r = subprocess.run(graphline("serve", *TINY_ARGS, "--executor", "local", "--max-concurrent-requests", "0"),
                       cwd=REPO, capture_output=True, text=True, timeout=60, env=clean_env())
    errors = [ln for ln in r.stderr.splitlines() if "--max-concurrent-requests" in ln]
    assert r.returncode != 0 and len(errors) == 1, r.stderr[-2000:]
