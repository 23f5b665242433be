"""The official `openai` Python client against a live `graphline serve` on 127.0.0.1: completions (token ids, on
the shared `server` fixture: local executor and DP=2 through Ray), `/v1/models[/{id}]`, errors; chat completions,
stop strings (split across tokens and across streamed chunks) and text for token-id prompts on a server of the
tiny chat checkpoint (real byte-level BPE tokenizer and Jinja chat template). Expected values come from raw HTTP
requests and from the tokenizer itself, not from the client under test."""
from __future__ import annotations

import asyncio

import aiohttp
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("transformers")

from chat_fixture import build_checkpoint  # noqa: E402
from e2e_support import graphline, start_server  # noqa: E402

PROMPT = [17, 4, 250, 31, 8, 77]
REPLACEMENT = "\ufffd"


def client(url: str) -> "openai.OpenAI":
    return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)


def raw_post(url: str, path: str, body: dict) -> dict:
    async def main():
        async with aiohttp.ClientSession() as s:
            async with s.post(url + path, json=body) as r:
                assert r.status == 200, await r.text()
                return await r.json()

    return asyncio.run(asyncio.wait_for(main(), 120))


# ---- completions and models on the shared servers (qwen3-tiny preset: token ids, no tokenizer)
def test_completions_with_the_openai_client(server):
    c = client(server.url)
    expected = raw_post(server.url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "temperature": 0})
    r = c.completions.create(model="qwen3-tiny", prompt=PROMPT, max_tokens=8, temperature=0)
    assert r.object == "text_completion" and r.model == "qwen3-tiny" and r.id.startswith("cmpl-")
    ch = r.choices[0]
    assert ch.model_extra["token_ids"] == expected["choices"][0]["token_ids"] and len(ch.model_extra["token_ids"]) == 8
    assert ch.finish_reason == "length" and ch.text == "" and ch.logprobs is None
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(PROMPT), 8)

    chunks = list(c.completions.create(model="qwen3-tiny", prompt=PROMPT, max_tokens=8, temperature=0, stream=True,
                                       stream_options={"include_usage": True}))
    streamed = [t for k in chunks for x in k.choices for t in x.model_extra["token_ids"]]
    assert streamed == ch.model_extra["token_ids"] and len(chunks) >= 3
    assert [x.finish_reason for k in chunks for x in k.choices if x.finish_reason] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8

    seeded = [c.completions.create(model="qwen3-tiny", prompt=[PROMPT, PROMPT[:3]], max_tokens=6, temperature=0.9,
                                   seed=77, extra_body={"top_k": 40}) for _ in range(2)]
    assert [x.index for x in seeded[0].choices] == [0, 1]
    assert [x.model_extra["token_ids"] for x in seeded[0].choices] == \
        [x.model_extra["token_ids"] for x in seeded[1].choices]


@pytest.mark.parametrize("kwargs, param, needle", [
    ({"seed": -1}, "seed", "seed"),
    ({"n": 17}, "n", "at most 16"),
    ({"best_of": 2}, "best_of", "not supported"),
    ({"temperature": 101}, "temperature", "temperature"),
    ({"max_tokens": 2**40}, "max_tokens", "max_tokens"),
    ({"stop": "x"}, "stop", "tokenizer"),
    ({"extra_body": {"top_k": 2**70}}, "top_k", "top_k"),
    ({"presence_penalty": 3.0}, "presence_penalty", "presence_penalty"),
    ({"logprobs": 50}, "logprobs", "logprobs"),
])
def test_bad_completions_raise_bad_request(server, kwargs, param, needle):
    with pytest.raises(openai.BadRequestError) as err:
        client(server.url).completions.create(**{"model": "qwen3-tiny", "prompt": PROMPT, "max_tokens": 4, **kwargs})
    assert err.value.param == param and needle in err.value.message


def test_models_with_the_openai_client(server):
    c = client(server.url)
    assert [m.id for m in c.models.list().data] == ["qwen3-tiny"]
    m = c.models.retrieve("qwen3-tiny")
    assert m.id == "qwen3-tiny" and m.object == "model" and m.owned_by == "graphline"
    assert m.model_extra["max_model_len"] == 128 and m.model_extra["generation_defaults"] == {}
    with pytest.raises(openai.NotFoundError) as err:
        c.models.retrieve("gpt-5")
    assert err.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="gpt-5", prompt=PROMPT, max_tokens=2)
    with pytest.raises(openai.BadRequestError) as err:  # no tokenizer, no chat
        c.chat.completions.create(model="qwen3-tiny", messages=[{"role": "user", "content": "hi"}])
    assert err.value.code == "no_tokenizer"


# ---- the chat checkpoint
@pytest.fixture(scope="module")
def chat_ckpt(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("chat") / "tiny-chat")


@pytest.fixture(scope="module")
def chat_server(chat_ckpt):
    srv = start_server(graphline("serve", "--model", str(chat_ckpt), "--executor", "local", "--device", "cpu",
                                 "--max-model-len", "128", "--block-size", "16", "--max-decode-batch", "4",
                                 "--pcg-max-tokens", "0", "--no-progress", "--port", "0"))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def tok(chat_ckpt):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(chat_ckpt), local_files_only=True)


MESSAGES = [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "Say something."}]


def test_chat_with_the_openai_client(chat_server, tok):
    c = client(chat_server.url)
    prompt_ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    r = c.chat.completions.create(model="tiny-chat", messages=MESSAGES, max_tokens=12, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    msg = r.choices[0].message
    assert msg.role == "assistant" and isinstance(msg.content, str) and msg.content
    assert r.choices[0].finish_reason in ("length", "stop") and r.usage.prompt_tokens == len(prompt_ids)

    chunks = list(c.chat.completions.create(model="tiny-chat", messages=MESSAGES, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert chunks[0].object == "chat.completion.chunk" and chunks[0].choices[0].delta.role == "assistant"
    assert all(x.delta.role is None for k in chunks[1:] for x in k.choices)
    assert "".join(x.delta.content or "" for k in chunks for x in k.choices) == msg.content
    assert [x.finish_reason for k in chunks for x in k.choices if x.finish_reason] == [r.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    assert len(chunks) >= 4

    parts = [MESSAGES[0], {"role": "user", "content": [{"type": "text", "text": "Say something."}]}]
    same = c.chat.completions.create(model="tiny-chat", messages=parts, max_tokens=12, temperature=0)
    assert same.choices[0].message.content == msg.content and same.usage.prompt_tokens == len(prompt_ids)

    nothink = c.chat.completions.create(model="tiny-chat", messages=MESSAGES, max_completion_tokens=3,
                                        temperature=0, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    want = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False,
                                   enable_thinking=False)
    assert nothink.usage.prompt_tokens == len(want) > len(prompt_ids) and nothink.usage.completion_tokens <= 3

    lp = c.chat.completions.create(model="tiny-chat", messages=MESSAGES, max_tokens=2, logprobs=True, top_logprobs=2)
    content = lp.choices[0].logprobs.content  # the sampler's values, chat shape
    assert len(content) == 2 and all(len(x.top_logprobs) == 2 and x.logprob <= 0 for x in content)
    s1, s2 = (c.chat.completions.create(model="tiny-chat", messages=MESSAGES, max_tokens=8, temperature=0.9, seed=5)
              for _ in range(2))
    assert s1.choices[0].message.content == s2.choices[0].message.content

    with pytest.raises(openai.BadRequestError) as err:
        c.chat.completions.create(model="tiny-chat", messages=[{"role": "assistant", "content": "hi"}])
    assert err.value.code == "template_error"
    with pytest.raises(openai.BadRequestError) as err:
        c.chat.completions.create(model="tiny-chat", messages=MESSAGES, top_logprobs=3)
    assert err.value.param == "top_logprobs"


def _stop_across_tokens(tok, ids: list[int]) -> tuple[str, int]:
    """A stop string that straddles two generated tokens (from the 3rd token on), and the number of tokens up to
    the one that completes it."""
    text = tok.decode(ids)
    for j in range(2, len(ids) - 2):
        head = tok.decode(ids[:j])
        a, b = tok.decode(ids[j - 1:j]), tok.decode(ids[j:j + 1])
        if len(a) < 2 or len(b) < 2 or REPLACEMENT in text[:len(head) + 2] or not text.startswith(head):
            continue
        stop = head[-2:] + text[len(head):len(head) + 2]
        complete = next(k for k in range(1, len(ids) + 1) if stop in tok.decode(ids[:k]))
        if complete == j + 1:
            return stop, complete
    raise AssertionError(f"no stop string straddles two tokens of {text!r}")


def test_stop_strings_on_completions(chat_server, tok):
    c = client(chat_server.url)
    extra = {"ignore_eos": True}
    ref = raw_post(chat_server.url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 40, "temperature": 0,
                                                        **extra})["choices"][0]["token_ids"]
    text = tok.decode(ref)
    stop, complete = _stop_across_tokens(tok, ref)  # its last character comes with token `complete - 1`
    start = text.index(stop)

    r = c.completions.create(model="tiny-chat", prompt=PROMPT, max_tokens=40, temperature=0, stop=stop,
                             extra_body=extra)
    ch = r.choices[0]
    assert ch.finish_reason == "stop" and ch.text == text[:start] and stop not in ch.text
    assert ch.model_extra["token_ids"] == ref[:complete] and r.usage.completion_tokens == complete

    split = 0
    for _ in range(5):  # chunks coalesce when the client lags: retry until the stop string spans two chunks
        chunks = list(c.completions.create(model="tiny-chat", prompt=PROMPT, max_tokens=40, temperature=0,
                                           stop=[stop, "never-in-this-text"], stream=True,
                                           stream_options={"include_usage": True}, extra_body=extra))
        assert "".join(x.text for k in chunks for x in k.choices) == text[:start]
        assert [x.finish_reason for k in chunks for x in k.choices if x.finish_reason] == ["stop"]
        assert chunks[-1].usage.completion_tokens == complete
        per_chunk = [x.model_extra["token_ids"] for k in chunks for x in k.choices]
        assert [t for ids in per_chunk for t in ids] == ref[:complete]
        ends = [sum(len(ids) for ids in per_chunk[:i + 1]) for i in range(len(per_chunk))]
        chunk_of = [next(i for i, e in enumerate(ends) if e > pos) for pos in (complete - 2, complete - 1)]
        split += chunk_of[0] < chunk_of[1]  # the stop string's two tokens arrived in different chunks
        if split:
            break
    assert split

    free = c.completions.create(model="tiny-chat", prompt=PROMPT, max_tokens=40, temperature=0,
                                stop="never-in-this-text", extra_body=extra)
    assert free.choices[0].text == text and free.choices[0].finish_reason == "length"


def test_stop_strings_on_chat(chat_server, tok):
    c = client(chat_server.url)
    kw = dict(model="tiny-chat", messages=MESSAGES, max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
    ref = c.chat.completions.create(**kw)
    full = ref.choices[0].message.content
    prompt_ids = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    ids = raw_post(chat_server.url, "/v1/completions", {"prompt": prompt_ids, "max_tokens": 40, "temperature": 0,
                                                        "ignore_eos": True})["choices"][0]["token_ids"]
    assert tok.decode(ids) == full  # chat = the template's prompt through completions
    stop, complete = _stop_across_tokens(tok, ids)
    r = c.chat.completions.create(**kw, stop=[stop])
    assert r.choices[0].message.content == full[:full.index(stop)] and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == complete
    chunks = list(c.chat.completions.create(**kw, stop=stop, stream=True, stream_options={"include_usage": True}))
    assert "".join(x.delta.content or "" for k in chunks for x in k.choices) == full[:full.index(stop)]
    assert chunks[-1].usage.completion_tokens == complete


def test_text_is_filled_for_token_id_prompts(chat_server, tok):
    c = client(chat_server.url)
    r = c.completions.create(model="tiny-chat", prompt=PROMPT, max_tokens=10, temperature=0)
    ids = r.choices[0].model_extra["token_ids"]
    assert ids and r.choices[0].text == tok.decode(ids, skip_special_tokens=True)
    chunks = list(c.completions.create(model="tiny-chat", prompt=[PROMPT, PROMPT[:2]], max_tokens=10, temperature=0,
                                       stream=True))
    text0 = "".join(x.text for k in chunks for x in k.choices if x.index == 0)
    assert text0 == r.choices[0].text
    m = c.models.retrieve("tiny-chat")
    assert m.model_extra["generation_defaults"] == {}
