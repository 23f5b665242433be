"""`tool_choice` "required" and a named function on a real `graphline serve` (no tool-call parser) of a checkpoint
with a real byte-level BPE tokenizer and random weights, through the official `openai` client and raw HTTP, all
requests to 127.0.0.1.

A random-weight model never writes a tool call by itself, so every call below is the grammar's doing: the tools'
parameter schemas have finite languages (enums, no extra keys), so a forced choice must end within a few dozen tokens
with arguments that parse into its tool's schema. Streamed, the deltas join to the calls of the same seeded request
unstreamed."""
from __future__ import annotations

import json

import pytest

from e2e_support import http_json, metric_counts, openai_client, serve_checkpoint
from tests.fixtures.hf_checkpoints import build_checkpoint

openai = pytest.importorskip("openai")
pytest.importorskip("transformers")
pytest.importorskip("llguidance")

SCHEMAS = {
    "get_weather": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                                                     "unit": {"type": "string", "enum": ["C", "F"]}},
                    "required": ["city", "unit"], "additionalProperties": False},
    "get_time": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
                 "required": ["zone"], "additionalProperties": False},
}
TOOLS = [{"type": "function", "function": {"name": n, "description": f"{n} of a place", "parameters": s}}
         for n, s in SCHEMAS.items()]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris, and the time?"}]


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    d = build_checkpoint(tmp_path_factory.mktemp("forced") / "tiny-chat", max_position_embeddings=1024)
    s = serve_checkpoint(d, "--max-model-len", "1024")
    yield s
    s.stop()


def _check_call(name: str, arguments: str) -> dict:
    args = json.loads(arguments)
    schema = SCHEMAS[name]
    assert set(args) == set(schema["required"]), arguments
    for k, v in args.items():
        assert v in schema["properties"][k]["enum"], arguments
    return args


def _stream(client, **kw) -> tuple[list[tuple[str, str]], list]:
    """(name, arguments) of the streamed calls in index order, and the finish reasons sent."""
    calls: dict[int, list] = {}
    reasons = []
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            assert not c.delta.content, c.delta
            for tc in c.delta.tool_calls or []:
                if tc.index not in calls:
                    assert tc.id.startswith("call_") and tc.function.name, tc
                    calls[tc.index] = [tc.function.name, ""]
                calls[tc.index][1] += tc.function.arguments or ""
            if c.finish_reason:
                reasons.append(c.finish_reason)
    return [tuple(calls[i]) for i in sorted(calls)], reasons


def test_a_named_function_is_called_with_arguments_of_its_schema(srv):
    client = openai_client(srv)
    kw = dict(model="tiny-chat", messages=MESSAGES, tools=TOOLS, tool_choice=NAMED, max_tokens=64)
    greedy = client.chat.completions.create(temperature=0, **kw)
    sampled = client.chat.completions.create(temperature=1.0, n=4, seed=7, **kw)
    for ch in greedy.choices + sampled.choices:
        assert ch.finish_reason == "stop" and ch.message.content is None, ch
        (call,) = ch.message.tool_calls
        assert call.id.startswith("call_") and call.type == "function" and call.function.name == "get_weather"
        _check_call("get_weather", call.function.arguments)
    streamed, reasons = _stream(client, temperature=1.0, seed=7, **kw)
    first = sampled.choices[0].message.tool_calls[0].function
    assert streamed == [("get_weather", first.arguments)] and reasons == ["stop"]


def test_required_calls_come_from_the_tools(srv):
    client = openai_client(srv)
    kw = dict(model="tiny-chat", messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=160)
    sampled = client.chat.completions.create(temperature=1.0, n=4, seed=3, **kw)
    for ch in sampled.choices:
        assert ch.message.content is None and ch.finish_reason in ("tool_calls", "length"), ch
        assert ch.message.tool_calls or ch.finish_reason == "length", ch
        for call in ch.message.tool_calls or []:
            _check_call(call.function.name, call.function.arguments)
    streamed, reasons = _stream(client, temperature=1.0, seed=3, **kw)
    whole = sampled.choices[0]
    assert streamed == [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
    assert reasons == [whole.finish_reason]
    one = client.chat.completions.create(temperature=1.0, n=4, seed=3, parallel_tool_calls=False, **kw)
    for ch in one.choices:
        assert ch.finish_reason == "tool_calls" and len(ch.message.tool_calls) == 1, ch
        _check_call(ch.message.tool_calls[0].function.name, ch.message.tool_calls[0].function.arguments)
    free = client.chat.completions.create(model="tiny-chat", messages=MESSAGES, tools=TOOLS, tool_choice="none",
                                          max_tokens=48, temperature=0)
    assert not free.choices[0].message.tool_calls
    with pytest.raises(ValueError):
        json.loads(free.choices[0].message.content)  # without the grammar this model writes no call


@pytest.mark.parametrize("fields, param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_mood"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": "no"}, "parallel_tool_calls"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": TOOLS}, "tool_choice"),  # "auto" needs --tool-call-parser
])
def test_bad_forced_tool_choices_are_400s_naming_the_field(srv, fields, param):
    status, body = http_json(srv.url + "/v1/chat/completions",
                             body={"model": "tiny-chat", "messages": MESSAGES, "max_tokens": 4, **fields})
    assert status == 400 and body["error"]["param"] == param and len(body["error"]["message"]) < 320, body
    ok = openai_client(srv).chat.completions.create(model="tiny-chat", messages=MESSAGES, tools=TOOLS,
                                                    tool_choice=NAMED, max_tokens=64, temperature=0)
    assert ok.choices[0].message.tool_calls[0].function.name == "get_weather"


def test_metrics_count_forced_tool_choices(srv):
    def counts() -> dict:
        return metric_counts(srv.url, "graphline_structured_requests", "kind")

    before = counts()
    client = openai_client(srv)
    for choice in (NAMED, "required"):
        client.chat.completions.create(model="tiny-chat", messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                                       max_tokens=4)
    after = counts()
    assert [after.get(k, 0) - before.get(k, 0) for k in ("tool_function", "tool_required")] == [1, 1]
