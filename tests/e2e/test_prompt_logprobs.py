"""Prompt log-probabilities over HTTP on a real `graphline serve` (the chat fixture: a real byte-level BPE tokenizer,
random weights; prompts chunked 24 tokens a step), through the official `openai` client and raw HTTP, to 127.0.0.1:
completions' `echo` with `logprobs` (what lm-evaluation-harness' loglikelihood requests send: token-id prompts,
`max_tokens: 1`, `logprobs: 1`, `echo: true`) and vLLM's `prompt_logprobs`.

The reference for a prompt token's log-probability is another request to the same server: the prompt's prefix
with `allowed_token_ids` = that token, whose returned logprob is of the raw logits (the mask changes only the draw).
"""
from __future__ import annotations

import asyncio

import aiohttp
import numpy as np
import pytest

from e2e_support import openai_client, serve_checkpoint
from tests.fixtures.hf_checkpoints import build_checkpoint

openai = pytest.importorskip("openai")
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    d = build_checkpoint(tmp_path_factory.mktemp("prompt-logprobs") / "tiny-chat")
    s = serve_checkpoint(d, "--max-num-batched-tokens", "24", max_model_len=256)
    yield s, transformers.AutoTokenizer.from_pretrained(str(d), local_files_only=True)
    s.stop()


def _prompt(tok, seed: int, n: int = 70) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(0, len(tok) - 8, n)]


def _reference(client, prefix: list[int], token: int) -> float:
    out = client.completions.create(model="tiny-chat", prompt=prefix, max_tokens=1, temperature=0, logprobs=0,
                                    extra_body={"allowed_token_ids": [token], "ignore_eos": True})
    assert out.choices[0].token_ids == [token]
    return out.choices[0].logprobs.token_logprobs[0]


def test_echo_with_logprobs_is_the_loglikelihood_request(served):
    srv, tok = served
    client = openai_client(srv)
    prompt = _prompt(tok, 0)
    kw = dict(model="tiny-chat", prompt=prompt, max_tokens=1, temperature=0, logprobs=1, echo=True,
              extra_body={"ignore_eos": True})
    out = client.completions.create(**kw)
    c = out.choices[0]
    lp = c.logprobs
    texts = [tok.decode([t]) for t in prompt]
    assert c.text.startswith("".join(texts)) and len(lp.tokens) == len(prompt) + 1
    assert lp.tokens[:len(prompt)] == texts and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset[:3] == [0, len(texts[0]), len(texts[0]) + len(texts[1])]
    assert lp.text_offset[-1] == len("".join(texts))
    for p in (1, 2, 23, 24, 25, 47, 69):  # across the 24-token chunks
        assert lp.token_logprobs[p] == pytest.approx(_reference(client, prompt[:p], prompt[p]), abs=2e-4), p
    for p in range(1, len(prompt)):
        (best,) = lp.top_logprobs[p].values()
        assert best >= lp.token_logprobs[p] - 1e-6 and lp.token_logprobs[p] <= 0
    plain = client.completions.create(**{**kw, "echo": False})
    assert lp.token_logprobs[-1] == pytest.approx(plain.choices[0].logprobs.token_logprobs[0], abs=1e-5)
    assert c.text == "".join(texts) + plain.choices[0].text
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(prompt), 1)
    assert out.usage.prompt_tokens_details.cached_tokens == 0 < plain.usage.prompt_tokens_details.cached_tokens
    again = client.completions.create(**kw)  # the prompt is in the prefix cache now: its positions are computed again
    assert again.choices[0].logprobs.token_logprobs == pytest.approx(lp.token_logprobs, abs=1e-5)
    scored = client.completions.create(**{**kw, "max_tokens": 0})  # the prompt alone
    sc = scored.choices[0]
    assert sc.text == "".join(texts) and sc.token_ids == [] and sc.finish_reason == "length"
    assert sc.logprobs.tokens == texts and sc.logprobs.token_logprobs == pytest.approx(lp.token_logprobs[:-1], abs=1e-5)
    assert scored.usage.completion_tokens == 0 and scored.usage.prompt_tokens == len(prompt)
    streamed = list(client.completions.create(stream=True, **kw))
    assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == c.text
    tokens = [t for ch in streamed if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.tokens]
    assert tokens == lp.tokens


def test_vllm_prompt_logprobs_on_completions_and_chat(served):
    srv, tok = served
    client = openai_client(srv)
    prompt = _prompt(tok, 1, 30)
    echo = client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=2, temperature=0, logprobs=2,
                                     echo=True, n=2, extra_body={"ignore_eos": True})
    out = client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=2, temperature=0, n=2,
                                    extra_body={"ignore_eos": True, "prompt_logprobs": 2})
    for ch in out.choices:
        pl = ch.prompt_logprobs
        assert len(pl) == len(prompt) and pl[0] is None
        for p in range(1, len(prompt)):
            entry = pl[p][str(prompt[p])]
            assert entry["logprob"] == pytest.approx(echo.choices[ch.index].logprobs.token_logprobs[p], abs=1e-5)
            assert entry["decoded_token"] == tok.decode([prompt[p]])
            ranks = sorted(v["rank"] for k, v in pl[p].items() if k != str(prompt[p]))
            assert ranks == [r for r in (1, 2) if r != entry["rank"]][:len(ranks)] and len(pl[p]) in (2, 3)
            assert (entry["rank"] == 1) == (max(v["logprob"] for v in pl[p].values()) == entry["logprob"])
        assert ch.logprobs is None
    streamed = [c for c in client.completions.create(model="tiny-chat", prompt=prompt, max_tokens=2, temperature=0,
                                                      stream=True, extra_body={"ignore_eos": True,
                                                                               "prompt_logprobs": 2})
                if c.choices]
    firsts = [c.choices[0].model_extra.get("prompt_logprobs") for c in streamed]
    assert firsts[0] == [None, *(out.choices[0].prompt_logprobs[1:])] and not any(firsts[1:])
    chat = client.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "hello there"}],
                                          max_tokens=2, extra_body={"prompt_logprobs": 0})
    pl = chat.model_extra["prompt_logprobs"]
    assert pl[0] is None and len(pl) == chat.usage.prompt_tokens and all(len(d) == 1 for d in pl[1:])


@pytest.mark.parametrize("path, fields, param", [
    ("/v1/completions", {"prompt_logprobs": 21}, "prompt_logprobs"),
    ("/v1/completions", {"prompt_logprobs": -1}, "prompt_logprobs"),
    ("/v1/completions", {"prompt_logprobs": True}, "prompt_logprobs"),
    ("/v1/chat/completions", {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ("/v1/completions", {"echo": "yes"}, "echo"),
    ("/v1/chat/completions", {"echo": 1}, "echo"),
    ("/v1/chat/completions", {"prompt_logprobs": 1.5}, "prompt_logprobs"),
])
def test_bad_prompt_logprob_fields_are_400s_naming_them(served, path, fields, param):
    body = {"prompt": [1, 2, 3]} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "a"}]}

    async def main():
        async with aiohttp.ClientSession() as s:
            async with s.post(served[0].url + path, json={"model": "tiny-chat", "max_tokens": 2, **body,
                                                          **fields}) as r:
                return r.status, await r.json()

    status, out = asyncio.run(asyncio.wait_for(main(), 60))
    assert status == 400 and out["error"]["param"] == param, out
    after = openai_client(served[0]).completions.create(model="tiny-chat", prompt=[1, 2], max_tokens=2,
                                                        extra_body={"ignore_eos": True})
    assert after.usage.completion_tokens == 2
