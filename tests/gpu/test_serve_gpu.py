"""`graphline serve` on GPUs with graphs on: qwen3-0.6b on one GPU (Ray coordinator, full decode graphs and
piecewise prefill plans captured at start-up and used while serving), and TP=2 on two GPUs."""
from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from e2e_support import ARTIFACTS, graphline, start_server  # noqa: E402

aiohttp = pytest.importorskip("aiohttp")

# a fixed KV cache (1024 blocks of 64 tokens: 7.5 GB), not half the free memory: the GPU suite runs its files in
# parallel processes on one GPU, and the others capture graphs while this server holds its cache
GPU_ARGS = ["--model", "qwen3-0.6b", "--max-model-len", "2048", "--max-decode-batch", "64", "--pcg-max-tokens", "1024",
            "--pcg-token-stride", "256", "--num-kv-blocks", "1024", "--no-progress", "--port", "0"]


async def _complete(s, url: str, prompt, stream: bool = False, max_tokens: int = 16) -> list[int]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    async with s.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        if not stream:
            return (await r.json())["choices"][0]["token_ids"]
        toks = []
        async for raw in r.content:
            line = raw.decode().strip()
            if line.startswith("data: {"):
                toks += [t for ch in json.loads(line[6:])["choices"] for t in ch["token_ids"]]
        return toks


def _exercise(url: str, nranks: int) -> dict:
    async def main():
        prompts = [[(i * 7919 + j * 104729) % 150000 + 1 for j in range(20 + 3 * i)] for i in range(24)]
        async with aiohttp.ClientSession() as s:
            a = await _complete(s, url, prompts[0])
            b = await _complete(s, url, prompts[0], stream=True)
            many = await asyncio.gather(*[_complete(s, url, p, stream=bool(i % 2)) for i, p in enumerate(prompts)])
            async with s.get(url + "/status") as r:
                st = await r.json()
            async with s.get(url + "/metrics") as r:
                metrics = await r.text()
        return a, b, many, st, metrics

    a, b, many, st, metrics = asyncio.run(asyncio.wait_for(main(), 600))
    assert len(a) == 16 and a == b  # stream == non-stream (same shapes, greedy); batched runs may differ in bf16
    assert all(len(t) == 16 for t in many)
    assert len(st["ranks"]) == nranks
    for r in st["ranks"]:
        cap = r["capture"]
        assert cap["decode_graphs"] > 0 and cap["prefill_plans"] > 0, cap
        assert r["steps"]["full_graph"] > 0, r["steps"]  # decode served by full CUDA graphs
        assert r["steps"]["prefill_graph"] > 0, r["steps"]  # a lone prompt's prefill: one full prefill graph
        assert cap["prefill_graphs"] > 0, cap
        assert r["memory"]["decode_graph_pool_bytes"] > 0
    assert "graphline_runner_steps_total" in metrics
    return st


@pytest.mark.gpu
def test_serve_qwen3_06b_with_graphs():
    srv = start_server(graphline("serve", *GPU_ARGS), timeout=600)
    try:
        st = _exercise(srv.url, 1)
        print(f"start-up to serving: {srv.startup_s:.1f} s; status startup: {st.get('startup')}")
    finally:
        srv.stop()
        ARTIFACTS.mkdir(exist_ok=True)
        (ARTIFACTS / "gpu-serve.log").write_text(srv.output())


@pytest.mark.gpu
@pytest.mark.multigpu
def test_serve_qwen3_06b_tp2():
    srv = start_server(graphline("serve", *GPU_ARGS, "--tp", "2"), timeout=600)
    try:
        st = _exercise(srv.url, 2)
        assert {r["tp_rank"] for r in st["ranks"]} == {0, 1}
    finally:
        srv.stop()
        ARTIFACTS.mkdir(exist_ok=True)
        (ARTIFACTS / "gpu-serve-tp2.log").write_text(srv.output())
