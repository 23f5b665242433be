"""Prefix caching and `n > 1` through a live `graphline serve` on 127.0.0.1 (the shared `server` fixture: the local
executor on CPU, and DP=2 through Ray, where placement must send a repeated prompt to the rank that cached it):
a repeated prompt is served from the cache, visibly in `/metrics` and `/status`, with the same tokens; n seeded
samples are distinct, reproducible, streamed equal to non-streamed, counted in usage, and reuse the prompt's blocks
(the forks' hits); n beyond the KV capacity or best_of get a 400 naming the field."""
from __future__ import annotations

import asyncio
import json

import aiohttp
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

BLOCK = 16  # TINY_ARGS --block-size
PROMPT = np.random.default_rng(77).integers(1, 512, 50).tolist()  # 3 full blocks before its last token
TOTALS = {"prompt_tokens": 50, "completion_tokens": 80, "total_tokens": 130, "prompt_tokens_details": None}


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 240))


def _counter(text: str, name: str) -> float:
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    return sum(s.value for s in fams[name].samples if s.name == name + "_total" or s.name == name)


async def _metrics(s: aiohttp.ClientSession, url: str) -> str:
    async with s.get(url + "/metrics") as r:
        assert r.status == 200
        return await r.text()


async def _post(s: aiohttp.ClientSession, url: str, body: dict) -> tuple[int, dict]:
    async with s.post(url + "/v1/completions", json=body) as r:
        return r.status, await r.json()


def test_a_repeated_prompt_hits_the_prefix_cache_visibly_in_metrics(server):
    prompt = PROMPT[:-3] + [5, 6, 7]  # its own last block, so earlier tests' cached blocks do not change the count

    async def main():
        async with aiohttp.ClientSession() as s:
            before = await _metrics(s, server.url)
            outs = []
            for _ in range(2):
                status, body = await _post(s, server.url, {"prompt": prompt, "max_tokens": 6, "temperature": 0})
                assert status == 200, body
                outs.append(body["choices"][0]["token_ids"])
            after = await _metrics(s, server.url)
            async with s.get(server.url + "/status") as r:
                st = await r.json()
            return before, after, outs, st

    before, after, outs, st = run(main())
    assert outs[0] == outs[1] and len(outs[0]) == 6
    hits = _counter(after, "graphline_prefix_cache_hits") - _counter(before, "graphline_prefix_cache_hits")
    queries = _counter(after, "graphline_prefix_cache_queries") - _counter(before, "graphline_prefix_cache_queries")
    assert queries == 2 * len(prompt)
    assert hits >= 3 * BLOCK  # the second request reused at least the three full blocks the first computed
    assert _counter(after, "graphline_prefix_cache_blocks") >= 3
    pc = st["engine"]["prefix_cache"]
    assert pc["enabled"] and pc["hits"] > 0 and 0 < pc["hit_rate"] <= 1 and pc["cached_blocks"] >= 3
    assert len(st["engine"]["dp_ranks"]) == (1 if server.kind == "local" else 2)
    assert all("prefix_cache" in d and "shared_kv_blocks" in d for d in st["engine"]["dp_ranks"])


def test_n_seeded_samples_are_distinct_reproducible_and_share_the_prompt(server):
    body = {"prompt": PROMPT, "max_tokens": 20, "temperature": 1.0, "seed": 4321, "n": 4}

    async def stream(s: aiohttp.ClientSession) -> dict[int, list[int]]:
        got: dict[int, list[int]] = {}
        async with s.post(server.url + "/v1/completions", json={**body, "stream": True,
                                                                  "stream_options": {"include_usage": True}}) as r:
            assert r.status == 200
            usage = None
            async for raw in r.content:
                line = raw.decode().strip()
                if not line or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                for c in chunk["choices"]:
                    got.setdefault(c["index"], []).extend(c["token_ids"])
                usage = chunk.get("usage") or usage
        assert usage | {"prompt_tokens_details": None} == TOTALS
        return got

    async def main():
        async with aiohttp.ClientSession() as s:
            before = await _metrics(s, server.url)
            runs = [await _post(s, server.url, body) for _ in range(2)]
            after = await _metrics(s, server.url)
            streamed = await stream(s)
            one = await _post(s, server.url, {**body, "n": 1})
            return before, runs, after, streamed, one

    before, runs, after, streamed, one = run(main())
    for status, b in runs:
        assert status == 200, b
        assert [c["index"] for c in b["choices"]] == [0, 1, 2, 3]
        assert b["usage"] | {"prompt_tokens_details": None} == TOTALS
    samples = [c["token_ids"] for c in runs[0][1]["choices"]]
    assert samples == [c["token_ids"] for c in runs[1][1]["choices"]]  # reproducible
    assert runs[1][1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 3 * BLOCK}  # the first run's blocks
    assert len({tuple(t) for t in samples}) == 4 and all(len(t) == 20 for t in samples)  # distinct
    assert [streamed[i] for i in range(4)] == samples
    assert one[1]["choices"][0]["token_ids"] == samples[0]  # sample 0 is the n = 1 sample
    hits = _counter(after, "graphline_prefix_cache_hits") - _counter(before, "graphline_prefix_cache_hits")
    assert hits >= 2 * 3 * 3 * BLOCK  # per request, each of the 3 forks reused the prompt's 3 full blocks


def test_n_beyond_the_kv_capacity_and_best_of_get_a_400(server):
    async def main():
        async with aiohttp.ClientSession() as s:
            # 16 blocks of 16 tokens (15 usable): 4 samples of 50 + 70 tokens need 3 + 4 * 5 = 23 blocks
            big = await _post(s, server.url, {"prompt": PROMPT, "max_tokens": 70, "n": 4})
            fits = await _post(s, server.url, {"prompt": PROMPT, "n": 4, "temperature": 0})  # default max_tokens
            best = await _post(s, server.url, {"prompt": PROMPT, "best_of": 2})
            many = await _post(s, server.url, {"prompt": PROMPT, "n": 17})
            return big, fits, best, many

    big, fits, best, many = run(main())
    assert big[0] == 400 and big[1]["error"]["param"] == "n" and big[1]["error"]["code"] == "kv_capacity_exceeded"
    assert fits[0] == 200 and len(fits[1]["choices"]) == 4
    assert len({tuple(c["token_ids"]) for c in fits[1]["choices"]}) == 1  # greedy samples agree
    assert best[0] == 400 and best[1]["error"]["param"] == "best_of"
    assert many[0] == 400 and many[1]["error"]["param"] == "n"
