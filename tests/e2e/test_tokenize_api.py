"""`POST /tokenize` and `/detokenize` on a real `graphline serve` of a checkpoint with a real tokenizer and chat
template (`tests.fixtures.hf_checkpoints.build_checkpoint`), all requests to 127.0.0.1. Expected ids come from the
tokenizer itself (transformers, not the server) and from the completions' own `usage.prompt_tokens`; bad fields are
400s naming them; a preset without a tokenizer says so; with an API key both need it."""
from __future__ import annotations

import asyncio

import aiohttp
import pytest

from e2e_support import TINY_ARGS, graphline, openai_client, serve_checkpoint, start_server
from tests.fixtures.hf_checkpoints import build_checkpoint

transformers = pytest.importorskip("transformers")
pytest.importorskip("openai")

TEXT = "Café, naïve: the quick brown fox 🙂 jumps"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why is the fox quick?"}]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = build_checkpoint(tmp_path_factory.mktemp("tok") / "tiny-chat")
    return d, transformers.AutoTokenizer.from_pretrained(str(d), local_files_only=True)


@pytest.fixture(scope="module")
def srv(ckpt):
    s = serve_checkpoint(ckpt[0], "--max-model-len", "256")
    yield s
    s.stop()


def _post(url: str, calls: list[tuple[str, dict]], headers: dict | None = None) -> list[tuple[int, dict]]:
    async def main():
        out = []
        async with aiohttp.ClientSession(headers=headers) as s:
            for path, body in calls:
                async with s.post(url + path, json=body) as r:
                    out.append((r.status, await r.json()))
        return out

    return asyncio.run(asyncio.wait_for(main(), 120))


def test_tokenize_matches_the_tokenizer_and_the_completions(srv, ckpt):
    _, tok = ckpt
    (s1, text), (s2, plain), (s3, chat), (s4, no_think), (s5, back) = _post(srv.url, [
        ("/tokenize", {"prompt": TEXT}),
        ("/tokenize", {"prompt": TEXT, "add_special_tokens": False, "model": "tiny-chat"}),
        ("/tokenize", {"messages": MESSAGES}),
        ("/tokenize", {"messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": False}}),
        ("/detokenize", {"tokens": tok.encode(TEXT, add_special_tokens=False)}),
    ])
    assert (s1, s2, s3, s4, s5) == (200, 200, 200, 200, 200)
    assert text["tokens"] == tok.encode(TEXT) and text["count"] == len(text["tokens"]) and text["max_model_len"] == 256
    assert plain["tokens"] == tok.encode(TEXT, add_special_tokens=False)
    expected = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert chat["tokens"] == list(expected) and chat["count"] == len(expected)
    assert no_think["count"] > chat["count"]  # the template's empty think block
    assert back["prompt"] == tok.decode(tok.encode(TEXT, add_special_tokens=False)) == TEXT
    c = openai_client(srv)
    r = c.chat.completions.create(model="tiny-chat", messages=MESSAGES, max_tokens=2)
    assert r.usage.prompt_tokens == chat["count"]  # the same count chat completions use
    r = c.completions.create(model="tiny-chat", prompt=TEXT, max_tokens=2)
    assert r.usage.prompt_tokens == text["count"]


@pytest.mark.parametrize("path, body, status, param", [
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": MESSAGES}, 400, "messages"),
    ("/tokenize", {"prompt": [1, 2, 3]}, 400, "prompt"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, 400, "add_special_tokens"),
    ("/tokenize", {"messages": MESSAGES, "add_special_tokens": True}, 400, "add_special_tokens"),
    ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages"),
    ("/tokenize", {"messages": MESSAGES, "chat_template_kwargs": {"tokenize": True}}, 400, "chat_template_kwargs"),
    ("/tokenize", {"prompt": "a", "model": "other"}, 404, "model"),
    ("/tokenize", {"prompt": "\ud800"}, 400, "prompt"),
    ("/detokenize", {}, 400, "tokens"),
    ("/detokenize", {"tokens": [1, "2"]}, 400, "tokens"),
    ("/detokenize", {"tokens": [1, True]}, 400, "tokens"),
    ("/detokenize", {"tokens": [1, 10**6]}, 400, "tokens"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/detokenize", {"tokens": "1 2"}, 400, "tokens"),
])
def test_bad_fields_are_named(srv, path, body, status, param):
    (got, out), (ok, _) = _post(srv.url, [(path, body), ("/tokenize", {"prompt": "still fine"})])
    assert got == status and out["error"]["param"] == param, out
    assert ok == 200  # the server goes on


def test_a_preset_has_no_tokenizer_and_a_key_guards_both(tmp_path):
    srv = start_server(graphline("serve", *TINY_ARGS, "--executor", "local", "--port", "0", "--api-key", "k3y"))
    try:
        auth = {"Authorization": "Bearer k3y"}
        (s1, t), (s2, d) = _post(srv.url, [("/tokenize", {"prompt": "a"}), ("/detokenize", {"tokens": [1]})], auth)
        (s3, u), (s4, v) = _post(srv.url, [("/tokenize", {"prompt": "a"}), ("/detokenize", {"tokens": [1]})])
    finally:
        srv.stop()
    assert (s1, t["error"]["code"], t["error"]["param"]) == (400, "no_tokenizer", "prompt")
    assert (s2, d["error"]["code"], d["error"]["param"]) == (400, "no_tokenizer", "tokens")
    assert (s3, u["error"]["code"]) == (s4, v["error"]["code"]) == (401, "invalid_api_key")


def test_detokenize_takes_exactly_the_vocabulary(srv):
    async def vocab():
        async with aiohttp.ClientSession() as s, s.get(srv.url + "/status") as r:
            return (await r.json())["engine"]["limits"]["vocab_size"]

    v = asyncio.run(vocab())
    (ok, _), (bad, out) = _post(srv.url, [("/detokenize", {"tokens": [0, v - 1]}), ("/detokenize", {"tokens": [v]})])
    assert ok == 200 and bad == 400 and f"[0, {v})" in out["error"]["message"]
