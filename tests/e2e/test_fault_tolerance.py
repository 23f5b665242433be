"""Rank failures on a live `graphline serve` (DP=2 Ray ranks on the CPU, Ray started by graphline itself with its
defaults: token authentication, servers on loopback). Traffic goes to 127.0.0.1 only.

- a process without the cluster's token cannot submit work to the Ray cluster graphline started (and one with
  it can: the refusal is the token's doing);
- a rank killed while idle is detected within 1 s (/health 503 naming it) and the group is rebuilt before any
  request arrives;
- kill -9 of a rank under 8 streaming requests: all 8 complete, with the greedy tokens of a run without the kill;
- SIGSTOP of a rank: /health 503 within 1 s, /metrics and /status answer within 100 ms during the hang, and the
  server serves again within the step timeout (the stopped rank is declared hung and the group rebuilt).
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import numpy as np
import pytest

from e2e_support import REPO, graphline, start_server

STEP_TIMEOUT_S = 12.0
ARGS = ["--model", "qwen3-tiny", "--device", "cpu", "--dp", "2", "--max-model-len", "256", "--block-size", "16",
        "--num-kv-blocks", "160", "--max-decode-batch", "8", "--pcg-max-tokens", "32", "--pcg-token-stride", "32",
        "--step-timeout-s", str(STEP_TIMEOUT_S), "--no-progress", "--port", "0"]
PROMPTS = [np.random.default_rng(7).integers(1, 512, 6 + i).tolist() for i in range(8)]
MAX_TOKENS = 160


@pytest.fixture(scope="module")
def srv():
    s = start_server(graphline("serve", *ARGS), timeout=300)
    yield s
    code = s.stop()
    (REPO / "artifacts").mkdir(exist_ok=True)
    (REPO / "artifacts" / "e2e-fault-tolerance.log").write_text(s.output())
    assert code == 0


def run(coro, timeout: float = 240):
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def _get(s: aiohttp.ClientSession, url: str) -> tuple[int, dict, float]:
    t0 = time.perf_counter()
    async with s.get(url) as r:
        body = await (r.json() if r.content_type == "application/json" else r.text())
        return r.status, body, time.perf_counter() - t0


async def _ranks(s, url) -> list[dict]:
    return (await _get(s, url + "/status"))[1]["ranks"]


async def _wait_healthy(s, url, timeout: float = 60.0) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if (await _get(s, url + "/health"))[0] == 200:
            return time.monotonic() - t0
        await asyncio.sleep(0.05)
    raise AssertionError("the server did not become healthy again")


async def _stream(s, url, prompt, first: asyncio.Event | None = None) -> list[int]:
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    toks = []
    async with s.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            toks += chunk["choices"][0]["token_ids"]
            if first is not None and toks:
                first.set()
    return toks


def test_a_process_without_the_token_cannot_submit_work(srv):
    async def main():
        async with aiohttp.ClientSession() as s:
            return (await _get(s, srv.url + "/status"))[1]["executor_status"]["ray_address"]

    address = run(main())
    assert address and address.startswith("127.0.0.1:"), address  # graphline's own Ray listens on loopback
    child = ("import ray, sys\n"
             "ray.init(address=sys.argv[1], include_dashboard=False, log_to_driver=False)\n"
             "@ray.remote(num_cpus=0)\n"
             "def f():\n"
             "    return 42\n"
             "print('RAN', ray.get(f.remote(), timeout=30))\n")
    base = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    base["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # reach the loopback address as it is
    refused = subprocess.run([sys.executable, "-c", child, address], capture_output=True, text=True, timeout=120,
                             env={**base, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 64})
    assert refused.returncode != 0 and "RAN" not in refused.stdout
    token = Path.home() / ".ray" / "auth_token"  # where Ray keeps the token of the cluster it started
    allowed = subprocess.run([sys.executable, "-c", child, address], capture_output=True, text=True, timeout=120,
                             env={**base, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)})
    assert "RAN 42" in allowed.stdout, allowed.stderr[-3000:]


def test_an_idle_rank_killed_is_detected_within_a_second_and_rebuilt(srv):
    async def main():
        async with aiohttp.ClientSession() as s:
            await _wait_healthy(s, srv.url)
            victim = next(r for r in await _ranks(s, srv.url) if r["rank"] == 1)
            t0 = time.monotonic()
            os.kill(victim["pid"], signal.SIGKILL)
            while True:
                status, body, _ = await _get(s, srv.url + "/health")
                if status == 503:
                    seen = time.monotonic() - t0
                    break
                assert time.monotonic() - t0 < 5
                await asyncio.sleep(0.02)
            rebuilt = await _wait_healthy(s, srv.url)
            for _ in range(100):  # the status thread reads the rebuilt group's status right after the rebuild
                after = await _ranks(s, srv.url)
                if all("pid" in r for r in after):
                    break
                await asyncio.sleep(0.05)
        return seen, body, rebuilt, victim, after

    seen, body, rebuilt, victim, after = run(main())
    assert seen < 1.0, seen
    assert "rank 1" in body["reason"], body
    assert victim["pid"] not in [r["pid"] for r in after] and all(r["alive"] for r in after)
    assert '"event": "rank_failure"' in srv.output() and '"event": "rebuild"' in srv.output()


def test_a_rank_killed_under_8_streams_loses_no_request(srv):
    async def main():
        async with aiohttp.ClientSession() as s:
            await _wait_healthy(s, srv.url)
            calm = await asyncio.gather(*[_stream(s, srv.url, p) for p in PROMPTS])
            firsts = [asyncio.Event() for _ in PROMPTS]
            tasks = [asyncio.create_task(_stream(s, srv.url, p, e)) for p, e in zip(PROMPTS, firsts)]
            await asyncio.wait_for(asyncio.gather(*[e.wait() for e in firsts]), 60)
            victim = next(r for r in await _ranks(s, srv.url) if r["rank"] == 0)
            os.kill(victim["pid"], signal.SIGKILL)
            stormy = await asyncio.gather(*tasks)
            st = (await _get(s, srv.url + "/status"))[1]
        return calm, stormy, st

    calm, stormy, st = run(main())
    assert all(len(t) == MAX_TOKENS for t in calm)
    assert stormy == calm
    assert st["engine"]["requests_requeued"] >= 1 and st["engine"]["requests_failed"] == 0


def test_a_stopped_rank_is_unhealthy_within_a_second_and_serving_resumes_within_the_step_timeout(srv):
    async def main():
        async with aiohttp.ClientSession() as s:
            await _wait_healthy(s, srv.url)
            first = asyncio.Event()
            task = asyncio.create_task(_stream(s, srv.url, PROMPTS[0], first))
            await asyncio.wait_for(first.wait(), 60)
            victim = next(r for r in await _ranks(s, srv.url) if r["rank"] == 1)
            t0 = time.monotonic()
            os.kill(victim["pid"], signal.SIGSTOP)
            try:
                unhealthy = None
                slowest = 0.0
                while time.monotonic() - t0 < 3.0:
                    status, _, _ = await _get(s, srv.url + "/health")
                    if status == 503 and unhealthy is None:
                        unhealthy = time.monotonic() - t0
                    for path in ("/metrics", "/status"):
                        slowest = max(slowest, (await _get(s, srv.url + path))[2])
                    await asyncio.sleep(0.05)
                first_again = asyncio.Event()
                again = asyncio.create_task(_stream(s, srv.url, PROMPTS[1], first_again))  # waits for the rebuild
                await asyncio.wait_for(first_again.wait(), 60)
                serving_after = time.monotonic() - t0
                served, streamed = await again, await task
            finally:
                try:
                    os.kill(victim["pid"], signal.SIGKILL)  # never leave a stopped process behind
                except ProcessLookupError:
                    pass
        return unhealthy, slowest, served, serving_after, streamed

    unhealthy, slowest, served, serving_after, streamed = run(main())
    assert unhealthy is not None and unhealthy < 1.0, unhealthy
    assert slowest < 0.1, slowest
    assert len(served) == MAX_TOKENS and len(streamed) == MAX_TOKENS
    assert serving_after < STEP_TIMEOUT_S, serving_after  # declared hung after 3 s of silence, then rebuilt
