"""Structured outputs on one GPU: the chat fixture (`tests.fixtures.hf_checkpoints`: real BPE tokenizer, random
weights) served by `graphline serve --device cuda` with CUDA graphs, so the allowed-token masks go through the rank's
Triton sampler (the processed path) beside free-text rows in the same decode steps.

- constrained chat answers (greedy, sampled `n` = 4, streamed) all end with `stop` and parse into the schema's
  finite shape (`tests/e2e/test_structured_outputs.py`'s `ANSWER`), which a random-weight model never writes alone;
- free-text completions sent together with constrained ones give the text they give alone (greedy and seeded).
"""
from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from e2e_support import graphline, openai_client, start_server  # noqa: E402

pytestmark = pytest.mark.gpu
pytest.importorskip("llguidance")
pytest.importorskip("openai")
aiohttp = pytest.importorskip("aiohttp")

SERVE_ARGS = ["--device", "cuda", "--dtype", "float32", "--max-model-len", "256", "--num-kv-blocks", "128",
              "--max-decode-batch", "16", "--pcg-max-tokens", "256", "--pcg-token-stride", "128", "--no-progress",
              "--port", "0"]


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    from tests.fixtures.hf_checkpoints import build_checkpoint

    d = build_checkpoint(tmp_path_factory.mktemp("structured_gpu") / "tiny-chat")
    s = start_server(graphline("serve", "--model", str(d), *SERVE_ARGS), timeout=400)
    yield s
    s.stop()


def test_constrained_rows_through_the_triton_sampler(srv):
    from test_structured_outputs import FORMAT, MESSAGES, _check_answer

    client = openai_client(srv)
    greedy = client.chat.completions.create(model="tiny-chat", messages=MESSAGES, max_tokens=64, temperature=0,
                                            response_format=FORMAT)
    assert greedy.choices[0].finish_reason == "stop"
    _check_answer(greedy.choices[0].message.content)
    sampled = client.chat.completions.create(model="tiny-chat", messages=MESSAGES, max_tokens=64, temperature=1.0,
                                             top_p=0.9, n=4, seed=11, response_format=FORMAT)
    assert [c.finish_reason for c in sampled.choices] == ["stop"] * 4
    for c in sampled.choices:
        _check_answer(c.message.content)
    stream = client.chat.completions.create(model="tiny-chat", messages=MESSAGES, max_tokens=64, temperature=1.0,
                                            top_p=0.9, seed=11, stream=True, response_format=FORMAT)
    text = "".join(c.delta.content or "" for chunk in stream for c in chunk.choices)
    assert text == sampled.choices[0].message.content


def test_free_rows_beside_constrained_rows_are_unchanged(srv):
    from test_structured_outputs import FORMAT, _check_answer

    free = {"model": "tiny-chat", "prompt": "The quick brown fox", "max_tokens": 32, "temperature": 0}
    sampled = {**free, "temperature": 1.0, "seed": 3}
    constrained = {"model": "tiny-chat", "prompt": "The answer:", "max_tokens": 64, "temperature": 1.0, "seed": 9,
                   "response_format": FORMAT}

    async def post_all(bodies):
        async with aiohttp.ClientSession() as s:
            async def one(body):
                async with s.post(srv.url + "/v1/completions", json=body) as r:
                    assert r.status == 200, await r.text()
                    return (await r.json())["choices"][0]
            return await asyncio.gather(*[one(b) for b in bodies])

    alone = asyncio.run(post_all([free, sampled]))
    mixed = asyncio.run(post_all([constrained, free, constrained, sampled, constrained, constrained]))
    assert mixed[1]["text"] == alone[0]["text"] and mixed[3]["text"] == alone[1]["text"]
    for i in (0, 2, 4, 5):
        assert mixed[i]["finish_reason"] == "stop"
        _check_answer(mixed[i]["text"])
