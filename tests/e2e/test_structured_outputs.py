"""Structured outputs (`response_format`) on a real `graphline serve` of a checkpoint with a real byte-level BPE
tokenizer (`tests.fixtures.hf_checkpoints.build_checkpoint`, random weights), through the official `openai` client
and raw HTTP, all requests to 127.0.0.1.

A random-weight model never writes JSON by itself, so every parsed answer below is the grammar's doing: the schema
`ANSWER` has a finite language (no whitespace, two fixed keys), so a constrained choice must end with `stop` within a
few dozen tokens and parse into exactly that shape. Free-text requests beside constrained ones must be unchanged."""
from __future__ import annotations

import asyncio
import json
import re

import aiohttp
import pytest

from e2e_support import metric_counts, openai_client, serve_checkpoint
from tests.fixtures.hf_checkpoints import build_checkpoint

pytest.importorskip("transformers")
pytest.importorskip("openai")
pytest.importorskip("llguidance")

ANSWER = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]},
                                           "digit": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["answer", "digit"], "additionalProperties": False,
          "x-guidance": {"whitespace_flexible": False}}
FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER, "strict": True}}
MESSAGES = [{"role": "user", "content": "Is the fox quick? Answer yes or no and a digit."}]


def _check_answer(text: str) -> None:
    got = json.loads(text)
    assert set(got) == {"answer", "digit"} and got["answer"] in ("yes", "no"), text
    assert type(got["digit"]) is int and 0 <= got["digit"] <= 9, text


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    d = build_checkpoint(tmp_path_factory.mktemp("structured") / "tiny-chat")
    s = serve_checkpoint(d, "--max-model-len", "256")
    yield s
    s.stop()


def check_constrained_chat(client, **sampling) -> None:
    """Greedy, `n` = 4 sampled and streamed constrained chat answers all end with `stop` and parse into `ANSWER`; the
    stream equals sample 0 (the request's own seed). `sampling`: extra fields of the sampled requests. Shared with
    tests/gpu/test_structured_gpu.py."""
    greedy = client.chat.completions.create(model="tiny-chat", messages=MESSAGES, max_tokens=64, temperature=0,
                                            response_format=FORMAT)
    assert greedy.choices[0].finish_reason == "stop"
    _check_answer(greedy.choices[0].message.content)
    sampled = client.chat.completions.create(model="tiny-chat", messages=MESSAGES, max_tokens=64, temperature=1.0,
                                             n=4, seed=11, response_format=FORMAT, **sampling)
    assert [c.finish_reason for c in sampled.choices] == ["stop"] * 4
    for c in sampled.choices:
        _check_answer(c.message.content)
    stream = client.chat.completions.create(model="tiny-chat", messages=MESSAGES, max_tokens=64, temperature=1.0,
                                            seed=11, stream=True, response_format=FORMAT, **sampling)
    parts, reasons = [], []
    for chunk in stream:
        for c in chunk.choices:
            parts.append(c.delta.content or "")
            reasons.append(c.finish_reason)
    assert reasons[-1] == "stop"
    _check_answer("".join(parts))
    assert "".join(parts) == sampled.choices[0].message.content  # sample 0 has the request's own seed


def test_json_schema_chat_greedy_sampled_and_streamed(srv):
    check_constrained_chat(openai_client(srv))


def test_json_object_and_completions(srv):
    client = openai_client(srv)
    out = client.chat.completions.create(model="tiny-chat", messages=MESSAGES, max_tokens=48, temperature=1.0, n=3,
                                         seed=5, response_format={"type": "json_object"})
    for c in out.choices:
        text = c.message.content
        assert text.lstrip().startswith("{"), text
        if c.finish_reason == "stop":
            assert isinstance(json.loads(text), dict), text
    comp = client.completions.create(model="tiny-chat", prompt="The answer:", max_tokens=64, temperature=0,
                                     extra_body={"response_format": FORMAT})
    assert comp.choices[0].finish_reason == "stop"
    _check_answer(comp.choices[0].text)
    plain = client.completions.create(model="tiny-chat", prompt="The answer:", max_tokens=24, temperature=0)
    with pytest.raises(ValueError):
        _check_answer(plain.choices[0].text)  # without the grammar this model writes no such JSON


def test_vllm_structured_outputs_choice_regex_and_grammar(srv):
    client = openai_client(srv)
    choices = ["yes", "no", "maybe later"]
    out = client.completions.create(model="tiny-chat", prompt="Well?", max_tokens=16, temperature=1.0, n=4, seed=2,
                                    extra_body={"structured_outputs": {"choice": choices}})
    assert all(c.text in choices and c.finish_reason == "stop" for c in out.choices), out.choices
    out = client.chat.completions.create(model="tiny-chat", messages=MESSAGES, max_tokens=16, temperature=1.0, n=3,
                                         seed=4, extra_body={"structured_outputs": {"regex": "[0-9]{3}-[a-c]{2}"}})
    for c in out.choices:
        assert re.fullmatch(r"[0-9]{3}-[a-c]{2}", c.message.content) and c.finish_reason == "stop", c
    out = client.completions.create(model="tiny-chat", prompt="Count:", max_tokens=24, temperature=0,
                                    extra_body={"structured_outputs": {"grammar": 'start: "n=" D D ";"\nD: /[0-9]/'}})
    assert re.fullmatch(r"n=[0-9][0-9];", out.choices[0].text) and out.choices[0].finish_reason == "stop", out


def _post_all(url: str, bodies: list[dict]) -> list[tuple[int, dict]]:
    async def one(s, body):
        async with s.post(url + "/v1/completions", json=body) as r:
            return r.status, await r.json()

    async def main():
        async with aiohttp.ClientSession() as s:
            return await asyncio.gather(*[one(s, b) for b in bodies])

    return asyncio.run(asyncio.wait_for(main(), 180))


def check_free_beside_constrained(url: str, free_tokens: int, constrained_rows: int) -> None:
    """Free completions (greedy and seeded) sent together with `constrained_rows` constrained ones return the text
    they return alone; every constrained one ends with `stop` and parses into `ANSWER`. Shared with
    tests/gpu/test_structured_gpu.py."""
    free = {"model": "tiny-chat", "prompt": "The quick brown fox", "max_tokens": free_tokens, "temperature": 0}
    sampled = {**free, "temperature": 1.0, "seed": 3}
    constrained = {"model": "tiny-chat", "prompt": "The answer:", "max_tokens": 64, "temperature": 1.0, "seed": 9,
                   "response_format": FORMAT}
    alone = _post_all(url, [free, sampled])
    mixed = _post_all(url, [constrained, free, constrained, sampled] + [constrained] * (constrained_rows - 2))
    assert all(status == 200 for status, _ in alone + mixed), alone + mixed
    texts = [body["choices"][0]["text"] for _, body in mixed]
    assert texts[1] == alone[0][1]["choices"][0]["text"] and texts[3] == alone[1][1]["choices"][0]["text"]
    for i in [0, 2, *range(4, len(mixed))]:
        assert mixed[i][1]["choices"][0]["finish_reason"] == "stop"
        _check_answer(texts[i])


def test_free_text_beside_constrained_requests_is_unchanged(srv):
    check_free_beside_constrained(srv.url, free_tokens=24, constrained_rows=3)


@pytest.mark.parametrize("fmt, param", [
    ("json", "response_format"),
    ({"type": "xml"}, "response_format.type"),
    ({"type": "json_schema"}, "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": {"name": "a b", "schema": ANSWER}}, "response_format.json_schema.name"),
    ({"type": "json_schema", "json_schema": {"schema": ANSWER, "strict": "yes"}}, "response_format.json_schema.strict"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}, "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}},
     "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nowhere"}}},
     "response_format.json_schema.schema"),
    ({"structured_outputs": {"regex": "("}}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": "start: nothing"}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"json": "not json"}}, "structured_outputs.json"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "structured_outputs"),
])
def test_bad_response_formats_are_400s_naming_the_field(srv, fmt, param):
    fields = fmt if isinstance(fmt, dict) and "structured_outputs" in fmt else {"response_format": fmt}

    async def main():
        async with aiohttp.ClientSession() as s:
            out = []
            for path, body in (("/v1/chat/completions", {"messages": MESSAGES}), ("/v1/completions", {"prompt": "a"})):
                async with s.post(srv.url + path, json={**body, "model": "tiny-chat", "max_tokens": 4,
                                                        **fields}) as r:
                    out.append((r.status, await r.json()))
            return out

    for status, body in asyncio.run(asyncio.wait_for(main(), 60)):
        assert status == 400 and body["error"]["param"] == param and len(body["error"]["message"]) < 320, body
    ok = openai_client(srv).completions.create(model="tiny-chat", prompt="still serving", max_tokens=2)
    assert ok.choices[0].finish_reason == "length"


def test_metrics_count_accepted_grammars_by_kind(srv):
    def counts() -> dict:
        return metric_counts(srv.url, "graphline_structured_requests", "kind")

    before = counts()
    client = openai_client(srv)
    client.completions.create(model="tiny-chat", prompt="x", max_tokens=4, extra_body={"response_format": FORMAT})
    client.completions.create(model="tiny-chat", prompt="x", max_tokens=4,
                              extra_body={"structured_outputs": {"choice": ["a", "b"]}})
    client.completions.create(model="tiny-chat", prompt="x", max_tokens=4)
    after = counts()
    assert after.get("json_schema", 0) == before.get("json_schema", 0) + 1
    assert after.get("choice", 0) == before.get("choice", 0) + 1


def test_bench_compares_constrained_with_free_requests(srv, tmp_path):
    import subprocess

    from e2e_support import REPO, clean_env, graphline

    out = tmp_path / "bench.json"
    run = subprocess.run(graphline("bench", "--url", srv.url, "--concurrency", "1,3", "--requests-per-client", "2",
                                   "--prompt-len", "8", "--max-tokens", "12", "--temperature", "1.0",
                                   "--response-format", "json_object", "--out", str(out)),
                         cwd=REPO, capture_output=True, text=True, timeout=300, env=clean_env())
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(out.read_text())
    levels = {(lv["sampling"], lv["clients"]): lv for lv in result["levels"]}
    assert set(levels) == {(m, c) for m in ("constrained", "sampled") for c in (1, 3)}
    assert all(lv["requests"] == 2 * lv["clients"] and lv["output_tokens"] > 0 for lv in levels.values())
    rows = result["constrained_vs_free"]
    assert [r["clients"] for r in rows] == [1, 3] and all(r["tpot_median_ratio"] > 0 for r in rows)
    assert "constrained / free, completions, 3 clients" in run.stdout
