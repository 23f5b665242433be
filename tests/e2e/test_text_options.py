"""vLLM's text and stream options on a real `graphline serve` of a checkpoint with a real byte-level BPE tokenizer
(random weights), through the official `openai` client (`extra_body`) and raw HTTP, all requests to 127.0.0.1:
`include_stop_str_in_output`, `skip_special_tokens`, `stream_options.continuous_usage_stats` and
`truncate_prompt_tokens`; and the sampling options `bad_words` and `allowed_token_ids`. Every expectation is derived
from another request to the same server (the greedy text without the option, the prompt cut by hand), never written
down."""
from __future__ import annotations

import asyncio

import aiohttp
import pytest

from e2e_support import openai_client, serve_checkpoint
from tests.fixtures.hf_checkpoints import build_checkpoint

openai = pytest.importorskip("openai")
transformers = pytest.importorskip("transformers")

MAX_LEN = 256


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    d = build_checkpoint(tmp_path_factory.mktemp("text-options") / "tiny-chat")
    s = serve_checkpoint(d, "--max-model-len", str(MAX_LEN))
    yield s, transformers.AutoTokenizer.from_pretrained(str(d), local_files_only=True)
    s.stop()


def _complete(client, stream: bool = False, **kw) -> str:
    kw = {"model": "tiny-chat", "prompt": "The quick brown fox", "temperature": 0, "max_tokens": 24, **kw}
    if not stream:
        return client.completions.create(**kw).choices[0].text
    return "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices)


@pytest.mark.parametrize("stream", [False, True])
def test_include_stop_str_in_output_keeps_the_matched_stop_string(served, stream):
    client = openai_client(served[0])
    full = _complete(client)
    stop = full[len(full) // 2:len(full) // 2 + 2]
    assert len(stop) == 2 and stop.strip(), full
    cut = full.index(stop)
    assert _complete(client, stream, stop=[stop]) == full[:cut]
    kept = _complete(client, stream, stop=[stop, stop[0]], extra_body={"include_stop_str_in_output": True})
    first = min(full.index(s) for s in (stop, stop[0]))
    assert kept == full[:first + 1]  # stop[0] occurs no later than stop and is the shorter
    assert _complete(client, stream, stop=[stop], extra_body={"include_stop_str_in_output": True}) == \
        full[:cut + len(stop)]


@pytest.mark.parametrize("stream", [False, True])
def test_skip_special_tokens_false_keeps_their_text(served, stream):
    client, tok = openai_client(served[0]), served[1]
    special = tok.convert_tokens_to_ids("<|im_start|>")
    kw = {"max_tokens": 6, "logit_bias": {str(special): 100}}
    skipped = _complete(client, stream, **kw)
    kept = _complete(client, stream, extra_body={"skip_special_tokens": False}, **kw)
    assert "<|im_start|>" not in skipped and kept.count("<|im_start|>") >= 1
    assert kept.replace("<|im_start|>", "") == skipped


def test_continuous_usage_stats_on_every_chunk(served):
    client = openai_client(served[0])
    chunks = list(client.chat.completions.create(
        model="tiny-chat", messages=[{"role": "user", "content": "Hi"}], max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    with_choices = [c for c in chunks if c.choices]
    assert with_choices and all(c.usage is not None for c in with_choices)
    counts = [c.usage.completion_tokens for c in with_choices]
    assert counts == sorted(counts) and counts[0] == 0
    final = chunks[-1]
    assert not final.choices and final.usage.completion_tokens == counts[-1] == 12
    assert {c.usage.prompt_tokens for c in chunks} == {final.usage.prompt_tokens}
    plain = list(client.chat.completions.create(
        model="tiny-chat", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, stream=True,
        stream_options={"include_usage": True}))
    assert all(c.usage is None for c in plain if c.choices)


def test_truncate_prompt_tokens_keeps_the_last_tokens(served):
    client, tok = openai_client(served[0]), served[1]
    ids = (tok.encode("one two three four five six seven eight nine ten ") * 40)[:MAX_LEN + 40]
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny-chat", prompt=ids, max_tokens=4)
    r = client.completions.create(model="tiny-chat", prompt=ids, max_tokens=8, temperature=0,
                                  extra_body={"truncate_prompt_tokens": 100})
    by_hand = client.completions.create(model="tiny-chat", prompt=ids[-100:], max_tokens=8, temperature=0)
    assert r.usage.prompt_tokens == 100 and r.choices[0].text == by_hand.choices[0].text
    whole = client.completions.create(model="tiny-chat", prompt=ids, max_tokens=1,
                                      extra_body={"truncate_prompt_tokens": -1})
    assert whole.usage.prompt_tokens == MAX_LEN - 1
    text = client.completions.create(model="tiny-chat", prompt="a b c d e f g h", max_tokens=1,
                                     extra_body={"truncate_prompt_tokens": 3})
    assert text.usage.prompt_tokens == 3
    chat = client.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "x " * 300}],
                                          max_tokens=1, extra_body={"truncate_prompt_tokens": 50})
    assert chat.usage.prompt_tokens == 50


@pytest.mark.parametrize("fields, param", [
    ({"include_stop_str_in_output": "yes"}, "include_stop_str_in_output"),
    ({"skip_special_tokens": 0}, "skip_special_tokens"),
    ({"stream": True, "stream_options": {"continuous_usage_stats": "on"}}, "stream_options.continuous_usage_stats"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": "5"}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": 2.0}, "truncate_prompt_tokens"),
    ({"bad_words": "fox"}, "bad_words"),
    ({"bad_words": [" "]}, "bad_words"),
    ({"bad_words": ["fox " * 40]}, "bad_words"),
    ({"bad_words": ["x"] * 65}, "bad_words"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [1, 10**6]}, "allowed_token_ids"),
    ({"allowed_token_ids": ["a"]}, "allowed_token_ids"),
])
def test_bad_text_options_are_400s_naming_the_field(served, fields, param):
    async def main():
        async with aiohttp.ClientSession() as s:
            out = []
            for path, body in (("/v1/completions", {"prompt": "a"}),
                               ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}]})):
                async with s.post(served[0].url + path, json={"model": "tiny-chat", "max_tokens": 2, **body,
                                                              **fields}) as r:
                    out.append((r.status, await r.json()))
            return out

    for status, body in asyncio.run(asyncio.wait_for(main(), 60)):
        assert status == 400 and body["error"]["param"] == param, body
    after = openai_client(served[0]).completions.create(model="tiny-chat", prompt="a", max_tokens=2,
                                                        extra_body={"ignore_eos": True})
    assert after.usage.completion_tokens == 2


def test_usage_reports_the_prompt_tokens_from_the_prefix_cache(served):
    client, tok = openai_client(served[0]), served[1]
    ids = (tok.encode("a fresh prompt about nine quick foxes ") * 12)[:120]
    first = client.completions.create(model="tiny-chat", prompt=ids, max_tokens=2)
    again = client.completions.create(model="tiny-chat", prompt=ids, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < len(ids), again.usage
    chunks = list(client.completions.create(model="tiny-chat", prompt=ids, max_tokens=2, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == cached
    chat = client.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "x"}], max_tokens=1,
                                          n=3, temperature=1.0)
    assert chat.usage.prompt_tokens_details.cached_tokens <= chat.usage.prompt_tokens


def _variants(tok, word: str) -> list[list[int]]:
    """The token sequences `bad_words` bans for `word`: as it starts a text and after a space (vLLM's rule)."""
    return [tok.encode(p + word.lstrip(), add_special_tokens=False) for p in ("", " ")]


def _first_ban(out: list[int], words: list[list[int]]) -> int:
    """The first position of `out` whose token a bad word forbids (its last id after its other ids), else len."""
    for k, t in enumerate(out):
        if any(w[-1] == t and out[max(0, k - len(w) + 1):k] == w[:-1] and k >= len(w) - 1 for w in words):
            return k
    return len(out)


def _contains(out: list[int], w: list[int]) -> bool:
    return any(out[i:i + len(w)] == w for i in range(len(out) - len(w) + 1))


@pytest.mark.parametrize("span", [1, 2])
def test_bad_words_never_appear_in_the_output_tokens(served, span):
    client, tok = openai_client(served[0]), served[1]
    kw = dict(model="tiny-chat", prompt="The quick brown fox", max_tokens=24, temperature=0,
              extra_body={"ignore_eos": True})
    free = client.completions.create(**kw).choices[0].token_ids
    word = tok.decode(free[5:5 + span])
    words = _variants(tok, word)
    k = _first_ban(free, words)
    assert k < len(free), (word, words, free)  # the word's tokens occur in the free output
    banned = client.completions.create(**{**kw, "extra_body": {"ignore_eos": True, "bad_words": [word]}})
    got = banned.choices[0].token_ids
    assert got[:k] == free[:k] and got[k] != free[k] and len(got) == 24
    assert not any(_contains(got, w) for w in words)
    stream = client.completions.create(stream=True, **{**kw, "extra_body": {"ignore_eos": True, "bad_words": [word]}})
    assert [t for c in stream for t in (c.choices[0].token_ids if c.choices else [])] == got


def test_allowed_token_ids_restrict_every_drawn_token(served):
    """Greedy: allowing exactly the free answer's ids changes nothing, allowing all but one of them changes the
    answer where that id came first. Sampled (n = 4, streamed too): every token is an allowed one; chat with one
    allowed id writes that token's text only."""
    client = openai_client(served[0])
    kw = dict(model="tiny-chat", prompt="The quick brown fox", max_tokens=24, temperature=0)
    free = client.completions.create(**kw, extra_body={"ignore_eos": True}).choices[0].token_ids
    same = client.completions.create(**kw, extra_body={"ignore_eos": True, "allowed_token_ids": sorted(set(free))})
    assert same.choices[0].token_ids == free
    k = 3
    fewer = sorted(set(free) - {free[k]})
    got = client.completions.create(**kw, extra_body={"ignore_eos": True, "allowed_token_ids": fewer})
    first = free.index(free[k])
    assert got.choices[0].token_ids[:first] == free[:first] and got.choices[0].token_ids[first] != free[k]
    allowed = [5, 77, 190, 301, 402]
    sampled = client.completions.create(**{**kw, "temperature": 1.0, "n": 4, "seed": 3},
                                        extra_body={"ignore_eos": True, "allowed_token_ids": allowed})
    assert all(set(c.token_ids) <= set(allowed) and len(c.token_ids) == 24 for c in sampled.choices)
    assert len({tuple(c.token_ids) for c in sampled.choices}) > 1
    stream = client.completions.create(stream=True, **{**kw, "temperature": 1.0, "seed": 5},
                                       extra_body={"ignore_eos": True, "allowed_token_ids": allowed})
    assert set(t for c in stream for t in (c.choices[0].token_ids if c.choices else [])) <= set(allowed)
    chat = client.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=12, temperature=1.0,
                                          extra_body={"ignore_eos": True, "allowed_token_ids": [77]})
    assert chat.choices[0].message.content == served[1].decode([77] * 12) and chat.usage.completion_tokens == 12


def test_return_tokens_as_token_ids_and_return_token_ids(served):
    """vLLM's `return_tokens_as_token_ids` writes every logprob token as `token_id:<id>`; `return_token_ids` returns
    the prompt's ids (completions: per choice, streamed in the first chunk; chat: the response's) and each chat
    choice's ids (streamed: each delta's)."""
    client, tok = openai_client(served[0]), served[1]
    kw = dict(model="tiny-chat", prompt="The quick brown fox", max_tokens=6, temperature=0, logprobs=2)
    out = client.completions.create(**kw, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True,
                                                      "return_token_ids": True})
    ch = out.choices[0]
    assert ch.logprobs.tokens == [f"token_id:{t}" for t in ch.token_ids]
    assert all(k.startswith("token_id:") for top in ch.logprobs.top_logprobs for k in top)
    assert ch.model_extra["prompt_token_ids"] == tok.encode("The quick brown fox")
    plain = client.completions.create(**kw, extra_body={"ignore_eos": True})
    assert plain.choices[0].logprobs.tokens == [tok.decode([t]) for t in ch.token_ids]
    assert "prompt_token_ids" not in plain.choices[0].model_extra
    chunks = [c for c in client.completions.create(stream=True, **kw, extra_body={"ignore_eos": True,
                                                                                  "return_token_ids": True})
              if c.choices]
    assert chunks[0].choices[0].model_extra["prompt_token_ids"] == tok.encode("The quick brown fox")
    assert not any("prompt_token_ids" in c.choices[0].model_extra for c in chunks[1:])
    msgs = [{"role": "user", "content": "hello"}]
    chat = client.chat.completions.create(model="tiny-chat", messages=msgs, max_tokens=6, temperature=0,
                                          logprobs=True, top_logprobs=1,
                                          extra_body={"ignore_eos": True, "return_token_ids": True,
                                                      "return_tokens_as_token_ids": True})
    ids = chat.choices[0].model_extra["token_ids"]
    assert len(ids) == chat.usage.completion_tokens == 6
    assert len(chat.model_extra["prompt_token_ids"]) == chat.usage.prompt_tokens
    assert [e.token for e in chat.choices[0].logprobs.content] == [f"token_id:{t}" for t in ids]
    streamed = [t for c in client.chat.completions.create(model="tiny-chat", messages=msgs, max_tokens=6,
                                                          temperature=0, stream=True,
                                                          extra_body={"ignore_eos": True, "return_token_ids": True})
                if c.choices for t in (c.choices[0].model_extra.get("token_ids") or [])]
    assert streamed == ids


@pytest.mark.parametrize("stream", [False, True])
def test_chat_echo_prepends_the_last_message_of_the_answers_role(served, stream):
    """vLLM's chat `echo`: a continuation of an assistant message (no generation prompt) starts with that message;
    with the generation prompt after a user message nothing is prepended."""
    client = openai_client(served[0])

    def answer(messages, **kw) -> str:
        kw = dict(model="tiny-chat", messages=messages, max_tokens=6, temperature=0, **kw)
        if not stream:
            return client.chat.completions.create(**kw).choices[0].message.content
        return "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw)
                       if c.choices)

    cont = [{"role": "user", "content": "tell a story"}, {"role": "assistant", "content": "Once upon"}]
    extra = {"add_generation_prompt": False, "continue_final_message": True, "ignore_eos": True}
    plain = answer(cont, extra_body=extra)
    echoed = answer(cont, extra_body={**extra, "echo": True})
    assert echoed == "Once upon" + plain
    user_last = [{"role": "user", "content": "tell a story"}]
    assert answer(user_last, extra_body={"echo": True, "ignore_eos": True}) == \
        answer(user_last, extra_body={"ignore_eos": True})
