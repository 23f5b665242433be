"""Fuzzing a live server on 127.0.0.1: 1,000 generated malformed or extreme requests (wrong types, out-of-range
values, NaN / Infinity / 1e400 as raw JSON tokens, integers like 2**70 and 2**64-1 in seed / top_k / max_tokens /
token ids, deep nesting, oversized bodies, wrong content types, bad UTF-8, wrong methods and paths, cross-site admin
posts) with bounded concurrency, while 8 well-formed streaming requests run alongside. Every bad request gets a 4xx
with an OpenAI error body; every bystander gets the tokens it gets alone; afterwards `/status` shows no failure, no
rebuild, no reset, and every DP rank's free KV blocks back at the total minus the reserved block. A second, smaller
run does the same against a server with a real tokenizer and chat template (text, chat and stop-string fields)."""
from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import aiohttp
import pytest

from chat_fixture import build_checkpoint
from e2e_support import graphline, start_server

NUM_CASES = 1000
CONCURRENCY = 16
SEED = 20240611
VOCAB = 512
MAX_MODEL_LEN = 128
HUGE = [2**70, 18446744073709551615, 2**63, 2**64, -(2**63) - 1, 10**30]


@dataclass
class Raw:
    """A raw JSON token written into the body as it is (NaN, Infinity, 1e400 ...)."""

    text: str


@dataclass
class Case:
    name: str
    method: str = "POST"
    path: str = "/v1/completions"
    body: bytes = b""
    headers: dict = field(default_factory=lambda: {"Content-Type": "application/json"})


def _dumps(doc: Any) -> bytes:
    raws: list[str] = []

    def walk(x: Any) -> Any:
        if isinstance(x, Raw):
            raws.append(x.text)
            return f"__RAW{len(raws) - 1}__"
        if isinstance(x, dict):
            return {k: walk(v) for k, v in x.items()}
        if isinstance(x, list):
            return [walk(v) for v in x]
        return x

    text = json.dumps(walk(doc))
    for i, r in enumerate(raws):
        text = text.replace(f'"__RAW{i}__"', r)
    return text.encode()


RAW_BAD_NUMBERS = [Raw("NaN"), Raw("Infinity"), Raw("-Infinity"), Raw("1e400"), Raw("-1e400")]
WRONG_TYPES = ["x", [1], {"a": 1}, True, False]


def bad_values(tokenizer: bool) -> dict[str, list]:
    """Per field, values that are invalid for it (whatever else the request holds)."""
    nums = RAW_BAD_NUMBERS + ["1", [0.5], {"v": 1}, True]
    out = {
        "model": [5, [], {}, True, "gpt-5", "x" * 300, "qwen3-tiny\u0000"],
        "prompt": [{}, 5, True, [], [[]], [1.5], [True], [1, "a"], [VOCAB], [-1], [[1], [VOCAB + 7]], [1] * 200,
                   [[1]] * 300, [[[1]]], [Raw("NaN")], *[[h] for h in HUGE], [[2, 3], [h for h in HUGE[:2]]]],
        "max_tokens": ["10", 0, -1, 1.5, True, 2**31, *HUGE, [1], {}, 200, *RAW_BAD_NUMBERS],
        "temperature": [-0.5, 100.5, 2**70, *nums],
        "top_p": [0, -0.1, 1.01, 1e-50, *nums],
        "top_k": [-2, 1.5, 2**31, *HUGE, *nums],
        "seed": [-1, 1.0, *HUGE, *nums],
        "min_p": [-0.1, 1.1, *nums],
        "presence_penalty": [2.5, -3, *nums],
        "frequency_penalty": [2.01, -2.5, *nums],
        "repetition_penalty": [0, -1, 3, *nums],
        "logit_bias": [[1, 2], "x", 5, {"a": 1}, {"1": 1000}, {"1": Raw("NaN")}, {str(2**70): 1},
                       {str(i): 1 for i in range(301)}, {"-5": 1}, {"1": True}],
        "min_tokens": [-1, 2**31, "1", *HUGE],
        "ignore_eos": [1, "true", [], {}, Raw("NaN")],
        "logprobs": [-1, 21, True, "1", 2**70, 1.5],
        "stop": [5, [1], [""], ["a"] * 5, ["x" * 300], {"s": 1}, [None]] + ([] if tokenizer else ["ok", ["a", "b"]]),
        "stop_token_ids": [5, "1", [1, "x"], [VOCAB], [-1], [1] * 300, [1.0], [True], *[[h] for h in HUGE]],
        "stream": ["yes", 1, [], {}, Raw("NaN")],
        "stream_options": [{"continuous_usage_stats": "on"}, {"include_usage": 1}, [True]],
        "n": [17, 0, -1, "1", True, *HUGE],
        "best_of": [2, 0, 1.5],
        "include_stop_str_in_output": ["yes", 1, [], Raw("NaN")],
        "skip_special_tokens": [0, "false", {}],
        "truncate_prompt_tokens": [0, -2, 1.5, "3", True, *HUGE, *RAW_BAD_NUMBERS],
        "priority": [1, -1, 1.5, "0", True, 2**31, *RAW_BAD_NUMBERS],
        "bad_words": ["x", [5], [""], {"a": 1}] + (["w " * 100] if tokenizer else [["ok"]]),
        "allowed_token_ids": [[], [VOCAB], [-1], "1", [1.0], 5, [True], {"1": 1}, *[[h] for h in HUGE]],
        "echo": ["yes", 1, [True]],
        "prompt_logprobs": [21, -1, True, "1", 1.5, *HUGE],
        "return_tokens_as_token_ids": ["yes", 1],
        "return_token_ids": [0, "true"],
        "suffix": ["x"],
    }
    if tokenizer:
        out["prompt"] += ["a" * 1_000_001, "a\ud800", ["ok", 5]]
    return out


def bad_chat_values() -> dict[str, list]:
    msg = {"role": "user", "content": "hi"}
    return {
        "messages": [None, [], "hi", [5], [{"role": "wizard", "content": "x"}], [{"role": "user"}],
                     [{"role": "user", "content": 5}], [{"role": "user", "content": [{"type": "image_url"}]}],
                     [{"role": "user", "content": [{"type": "text"}]}], [{"role": "user", "content": "\udc00"}],
                     [{"role": "assistant", "content": "first"}], [msg] * 1025,
                     [{"role": "user", "content": "w " * 300}]],
        "chat_template_kwargs": [[1], "x", {"tokenize": False}, {"a-b": 1}, {"x": {"y": 1}},
                                 {f"k{i}": 1 for i in range(17)}],
        "top_logprobs": [21, -1, "2", 2**70],
        "logprobs": [3, "true"],
        "max_completion_tokens": [0, -5, "4", *HUGE],
        "add_generation_prompt": ["no", 1],
        "continue_final_message": [True],
        "echo": ["no", 1],
        "prompt_logprobs": [21, -1, "0"],
        "tools": [[{"type": "function"}]],
        "tool_choice": ["required", "always", {"type": "function"}, {"type": "function", "function": {"name": "f"}},
                        {"function": {"name": 5}}],
        "parallel_tool_calls": ["no", 0, [True]],
        "response_format": [{"type": "xml"}, "json", {"type": "json_schema"},
                            {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}],
        "structured_outputs": [{"regex": "("}, {"choice": []}, [1]],
    }


def bad_responses_values() -> dict[str, list]:
    return {
        "input": [None, [], 5, [5], [{"role": "wizard", "content": "x"}], [{"type": "function_call"}],
                  [{"role": "user", "content": [{"type": "input_image"}]}], [{"type": "computer_call"}], "w " * 300],
        "instructions": [5, ["x"]],
        "max_output_tokens": [0, -1, "4", *HUGE],
        "text": ["json", {"format": {"type": "xml"}}, {"format": {"type": "json_schema", "schema": 5}}],
        "tools": [[{"type": "web_search"}], [{"type": "function"}], {"x": 1}],
        "tool_choice": [{"type": "function", "name": "nope"}, "always"],
        "previous_response_id": ["resp_1"],
        "background": [True],
        "truncation": ["middle", 1, True],
    }


def generate_cases(n: int, seed: int, tokenizer: bool) -> list[Case]:
    rng = random.Random(seed)
    fields = bad_values(tokenizer)
    chat_fields = bad_chat_values()
    responses_fields = bad_responses_values()
    good_extra = {"temperature": 0.5, "top_k": 10, "top_p": 0.9, "seed": 3, "max_tokens": 3, "stream": False}
    cases: list[Case] = []
    kinds = ["field"] * 40 + ["chat"] * (12 if tokenizer else 6) + ["responses"] * (6 if tokenizer else 2) \
        + ["nesting"] * 4 + ["ctype"] * 6 + ["utf8"] * 5 \
        + ["malformed"] * 8 + ["route"] * 4 + ["admin"] * 3 + ["nochat"] * (0 if tokenizer else 3) + ["oversize"]
    oversize_left = 3
    while len(cases) < n:
        kind = rng.choice(kinds)
        if kind == "oversize" and not oversize_left:
            continue
        if kind == "field":
            body: dict = {"prompt": [1, 2, 3], "max_tokens": 4}
            for k in rng.sample(sorted(good_extra), rng.randint(0, 3)):
                body[k] = good_extra[k]
            bad = rng.sample(sorted(fields), rng.randint(1, 3))
            for k in bad:
                body[k] = rng.choice(fields[k])
            if "stream" in body and body["stream"] is False and rng.random() < 0.3:
                body["stream"] = True  # streamed requests are validated before the stream opens too
            cases.append(Case(f"field {','.join(bad)}", body=_dumps(body)))
        elif kind == "chat":
            body = {"messages": [{"role": "user", "content": "hi there"}], "max_tokens": 4}
            bad = rng.sample(sorted(chat_fields), rng.randint(1, 2))
            for k in bad:
                body[k] = rng.choice(chat_fields[k])
            if "continue_final_message" in bad:
                body.pop("add_generation_prompt", None)
            cases.append(Case(f"chat {','.join(bad)}", path="/v1/chat/completions", body=_dumps(body)))
        elif kind == "responses":
            body = {"input": "hi there", "max_output_tokens": 4}
            bad = rng.sample(sorted(responses_fields), rng.randint(1, 2))
            for k in bad:
                body[k] = rng.choice(responses_fields[k])
            cases.append(Case(f"responses {','.join(bad)}", path="/v1/responses", body=_dumps(body)))
        elif kind == "nochat":  # a well-formed chat request to a model without a tokenizer
            cases.append(Case("chat without tokenizer", path="/v1/chat/completions",
                              body=_dumps({"messages": [{"role": "user", "content": "hi"}]})))
        elif kind == "nesting":
            d = rng.choice([33, 40, 100, 1000, 5000, 100_000, 400_000])
            inner = b"[" * d + b"]" * d
            body_bytes = inner if rng.random() < 0.5 else b'{"prompt": ' + inner + b"}"
            cases.append(Case(f"nesting {d}", body=body_bytes,
                              path=rng.choice(["/v1/completions", "/v1/chat/completions"])))
        elif kind == "ctype":
            ct = rng.choice(["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                             "application/xml", "application/jsonx", "text/json", None])
            headers = {} if ct is None else {"Content-Type": ct}
            cases.append(Case(f"content type {ct}", body=_dumps({"prompt": [1, 2], "max_tokens": 2}),
                              headers=headers))
        elif kind == "utf8":
            junk = rng.choice([b"\xff", b"\xc0\xaf", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80", b"\x80", b"\xe2\x82"])
            where = rng.choice([b'{"prompt": "a' + junk + b'"}', b'{"mod' + junk + b'el": "x", "prompt": [1]}',
                                b'{"prompt": [1], "stop": ["' + junk + b'"]}'])
            cases.append(Case("bad utf-8", body=where, path=rng.choice(["/v1/completions", "/v1/chat/completions"])))
        elif kind == "malformed":
            good = _dumps({"prompt": [1, 2, 3], "max_tokens": 3, "temperature": 0})
            body_bytes = rng.choice([good[:rng.randint(0, len(good) - 1)], good + b" garbage", b"{'prompt': [1]}",
                                     b"", b"   ", b"null", b"true", b"5", b'"prompt"', b"[]", b"[1, 2, 3]",
                                     b'{"prompt": [1], /* c */ "max_tokens": 2}', b'{"prompt": [01]}',
                                     b'{"prompt": [1,]}', b'{"seed": ' + b"9" * 5000 + b"}"])
            cases.append(Case("malformed", body=body_bytes,
                              path=rng.choice(["/v1/completions", "/v1/chat/completions"])))
        elif kind == "route":
            method, path = rng.choice([("GET", "/v1/completions"), ("PUT", "/v1/completions"),
                                       ("DELETE", "/v1/chat/completions"), ("POST", "/v1/nope"),
                                       ("GET", "/v1/models/gpt-5"), ("POST", "/v1/models"), ("GET", "/admin/reset"),
                                       ("PATCH", "/status")])
            cases.append(Case(f"route {method} {path}", method=method, path=path, body=b"{}"))
        elif kind == "admin":  # never a valid reset: cross-site or not JSON
            headers = rng.choice([{"Content-Type": "text/plain"}, {"Content-Type": "application/x-www-form-urlencoded"},
                                  {"Content-Type": "application/json", "Origin": "http://evil.example"},
                                  {"Content-Type": "application/json", "Origin": "null"}, {}])
            cases.append(Case("admin cross-site", path="/admin/reset", body=b"{}", headers=headers))
        elif kind == "oversize":
            oversize_left -= 1
            size = 16 * 1024 * 1024 + rng.randint(1, 1 << 20)
            body_bytes = b'{"prompt": [' + b"1," * (size // 2) + b"1]}"
            cases.append(Case("oversized", body=body_bytes))
    return cases


def test_generator_is_seeded_and_covers_every_category():
    a, b = generate_cases(NUM_CASES, SEED, False), generate_cases(NUM_CASES, SEED, False)
    assert [(c.name, c.body) for c in a] == [(c.name, c.body) for c in b] and len(a) == NUM_CASES
    names = " ".join(c.name for c in a)
    for needle in ("field", "chat", "nesting", "content type", "bad utf-8", "malformed", "route", "admin", "oversized"):
        assert needle in names, needle
    bodies = b" ".join(c.body[:5000] for c in a)
    for token in (b"NaN", b"Infinity", b"1e400", str(2**70).encode(), b"18446744073709551615"):
        assert token in bodies, token


async def _status(s: aiohttp.ClientSession, url: str) -> dict:
    async with s.get(url + "/status") as r:
        return await r.json()


async def _stream_tokens(s: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int) -> list[int]:
    toks, done = [], False
    async with s.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                                     "stream": True}) as r:
        assert r.status == 200, await r.text()
        async for raw in r.content:
            line = raw.decode().strip()
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                doc = json.loads(line[6:])
                assert "error" not in doc, doc
                toks += [t for ch in doc["choices"] for t in ch["token_ids"]]
    assert done
    return toks


async def _send(s: aiohttp.ClientSession, url: str, case: Case) -> tuple[int, Optional[dict]]:
    async with s.request(case.method, url + case.path, data=case.body, headers=case.headers,
                         skip_auto_headers=["Content-Type"]) as r:
        text = await r.text()
        try:
            return r.status, json.loads(text)
        except ValueError:
            return r.status, None


async def _quiescent(s: aiohttp.ClientSession, url: str) -> dict:
    for _ in range(100):
        st = await _status(s, url)
        eng = st["engine"]
        if eng["in_flight"] == 0 and eng["running"] == 0 and eng["waiting"] == 0 and \
                all(d["free_kv_blocks"] == d["num_kv_blocks"] - 1 for d in eng["dp_ranks"]):
            return st
        await asyncio.sleep(0.1)
    return st


def fuzz(url: str, cases: list[Case], bystander_prompts: list[list[int]], max_tokens: int) -> dict:
    async def main():
        conn = aiohttp.TCPConnector(limit=CONCURRENCY + len(bystander_prompts) + 4)
        timeout = aiohttp.ClientTimeout(total=60)
        async with aiohttp.ClientSession(connector=conn, timeout=timeout) as s:
            alone = [await _stream_tokens(s, url, p, max_tokens) for p in bystander_prompts]
            before = await _quiescent(s, url)
            sent = 0
            sem = asyncio.Semaphore(CONCURRENCY)

            async def one(case: Case):
                nonlocal sent
                async with sem:
                    sent += 1
                    return case, *(await _send(s, url, case))

            async def bystander(i: int, prompt: list[int]):
                while sent < i * len(cases) // (len(bystander_prompts) + 1):
                    await asyncio.sleep(0.005)
                return await _stream_tokens(s, url, prompt, max_tokens)

            t0 = time.monotonic()
            results, together = await asyncio.gather(
                asyncio.gather(*[one(c) for c in cases]),
                asyncio.gather(*[bystander(i, p) for i, p in enumerate(bystander_prompts)]))
            seconds = time.monotonic() - t0
            after = await _quiescent(s, url)
            async with s.get(url + "/health") as r:
                health = r.status
        return {"alone": alone, "together": together, "results": results, "before": before, "after": after,
                "seconds": seconds, "health": health}

    return asyncio.run(asyncio.wait_for(main(), 240))


def _check(out: dict, n_cases: int) -> None:
    bad = [(c.name, status, (body or {}).get("error")) for c, status, body in out["results"]
           if not 400 <= status < 500 or not isinstance(body, dict) or not (body.get("error") or {}).get("message")]
    assert not bad, bad[:10]
    assert len(out["results"]) == n_cases
    assert out["together"] == out["alone"] and all(len(t) > 0 for t in out["alone"])
    before, after = out["before"], out["after"]
    eng = after["engine"]
    assert out["health"] == 200 and after["health"] == "ok"
    assert after["num_failures"] == before["num_failures"] == 0 and eng["executor_failures"] == 0
    assert eng["requests_failed"] == 0 and after["num_resets"] == before["num_resets"]
    assert eng["in_flight"] == 0 and eng["running"] == 0 and eng["waiting"] == 0
    assert [d["free_kv_blocks"] for d in eng["dp_ranks"]] == [d["num_kv_blocks"] - 1 for d in eng["dp_ranks"]]


def _bystander_prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, VOCAB) for _ in range(rng.randint(4, 16))] for _ in range(8)]


def test_fuzz_the_shared_server(server):
    cases = generate_cases(NUM_CASES, SEED, tokenizer=False)
    out = fuzz(server.url, cases, _bystander_prompts(SEED), max_tokens=40)
    _check(out, NUM_CASES)
    assert out["seconds"] < 60, out["seconds"]
    statuses = {status for _, status, _ in out["results"]}
    assert {400, 404, 405, 413, 415} <= statuses, statuses


@pytest.fixture(scope="module")
def chat_server(tmp_path_factory):
    pytest.importorskip("transformers")
    ckpt = build_checkpoint(tmp_path_factory.mktemp("fuzz") / "tiny-chat")
    srv = start_server(graphline("serve", "--model", str(ckpt), "--executor", "local", "--device", "cpu",
                                 "--max-model-len", str(MAX_MODEL_LEN), "--block-size", "16", "--num-kv-blocks", "24",
                                 "--max-decode-batch", "4", "--pcg-max-tokens", "0", "--no-progress", "--port", "0"))
    yield srv
    srv.stop()


def test_fuzz_a_server_with_tokenizer_and_chat_template(chat_server):
    n = 300
    cases = generate_cases(n, SEED + 1, tokenizer=True)
    for c in cases:  # the model's name here is the checkpoint's
        c.body = c.body.replace(b'"model": "qwen3-tiny\\u0000"', b'"model": "tiny-chat\\u0000"')
    out = fuzz(chat_server.url, cases, _bystander_prompts(SEED + 1), max_tokens=24)
    _check(out, n)
