"""Forced tool calls (`launch.forced_tools`): the grammars of `tool_choice` "required" and a named function accept
exactly the calls the answer parses (compiled by llguidance over a real byte-level BPE tokenizer and walked token by
token); streamed text in any pieces gives the calls of the whole text; `parallel_tool_calls: false` holds for both
the forced and the parsed ("auto") paths, streamed and whole (`launch.generation.Shape`)."""
from __future__ import annotations

import json
import random

import pytest

from engine.errors import RequestError
from launch.tools import ToolChoice, parse_tools

llguidance = pytest.importorskip("llguidance")
pytest.importorskip("transformers")
from launch.forced_tools import ForcedCallStream, forced_answer, forced_tool_grammar, required_schema  # noqa: E402
from launch.structured import GrammarCompiler  # noqa: E402
from tests.e2e.chat_fixture import build_tokenizer  # noqa: E402

CITY = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
        "required": ["city"], "additionalProperties": False}
TOOLS = parse_tools([
    {"type": "function", "function": {"name": "get_weather", "parameters": CITY}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"$ref": "#/$defs/zone"}}, "required": ["zone"],
        "additionalProperties": False, "$defs": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}}}},
    {"type": "function", "function": {"name": "ping"}},
])
REQUIRED = ('[{"name": "get_weather", "arguments": {"city": "Rome"}}, '
            '{"name": "get_time", "arguments": {"zone": "CET"}}]')


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def compiler(tok):
    return GrammarCompiler(tok, 520, [tok.eos_token_id])


def _accepts(grammar, tok, text: str) -> bool:
    """The grammar takes `text`'s tokens one by one and is then complete."""
    m = grammar.matcher.deep_copy()
    for t in tok.encode(text, add_special_tokens=False):
        if not m.consume_token(t):
            return False
    return m.is_accepting()


def test_the_grammars_accept_exactly_the_calls(compiler, tok):
    named = forced_tool_grammar(ToolChoice("function", "get_weather"), TOOLS, compiler)
    assert named.kind == "tool_function"
    assert _accepts(named, tok, '{"city": "Paris"}')
    for bad in ('{"city": "Berlin"}', '{"city":"Paris"}', ' {"city": "Paris"}', '{"city": "Paris", "x": 1}'):
        assert not _accepts(named, tok, bad), bad
    assert _accepts(forced_tool_grammar(ToolChoice("function", "ping"), TOOLS, compiler), tok, '{"any": [1, 2]}')
    required = forced_tool_grammar(ToolChoice("required"), TOOLS, compiler)
    assert required.kind == "tool_required"
    assert _accepts(required, tok, REQUIRED) and _accepts(required, tok, '[{"name": "ping", "arguments": {}}]')
    for bad in ("[]", '[{"name": "get_weather", "arguments": {"city": "Oslo"}}]', '[{"name": "nope", "arguments": {}}]',
                '[{"name": "get_time", "arguments": {"zone": "PST"}}]', '{"name": "ping", "arguments": {}}'):
        assert not _accepts(required, tok, bad), bad
    single = forced_tool_grammar(ToolChoice("required", parallel=False), TOOLS, compiler)
    assert not _accepts(single, tok, REQUIRED) and _accepts(single, tok, REQUIRED[:REQUIRED.index("}},") + 2] + "]")
    assert forced_tool_grammar(ToolChoice("auto"), TOOLS, compiler) is None


def test_defs_are_lifted_and_must_agree(compiler):
    schema = required_schema(TOOLS, True)
    assert schema["$defs"] == {"zone": {"type": "string", "enum": ["UTC", "CET"]}}
    assert "$defs" not in schema["items"]["anyOf"][1]["properties"]["arguments"]
    clash = parse_tools([{"type": "function", "function": {"name": n, "parameters": {
        "type": "object", "$defs": {"zone": {"const": n}}}}} for n in ("a", "b")])
    with pytest.raises(RequestError) as info:
        forced_tool_grammar(ToolChoice("required"), clash, compiler)
    assert info.value.param == "tools"
    bad = parse_tools([{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                                     "minProperties": "x"}}}])
    with pytest.raises(RequestError) as info:
        forced_tool_grammar(ToolChoice("function", "f"), bad, compiler)
    assert info.value.param == "tools" and info.value.code == "invalid_schema"
    with pytest.raises(RequestError) as info:
        forced_tool_grammar(ToolChoice("required"), TOOLS, None)
    assert info.value.param == "tool_choice"


def _pieces(text: str, rng: random.Random) -> list[str]:
    out, i = [], 0
    while i < len(text):
        k = rng.randint(0, 5)
        out.append(text[i:i + k])
        i += k
    return out


@pytest.mark.parametrize("seed", range(6))
def test_streamed_pieces_give_the_whole_texts_calls(seed):
    rng = random.Random(seed)
    named = (ToolChoice("function", "get_weather"), '{"city": "Rome"}')
    for choice, text in ((ToolChoice("required"), REQUIRED), named):
        _, whole, reason = forced_answer(text, "stop", choice)
        assert reason == ("tool_calls" if choice.mode == "required" else "stop")
        st, deltas = ForcedCallStream(choice), []
        for p in _pieces(text, rng):
            deltas += st.push(p)
        joined: dict[int, dict] = {}
        for d in deltas:
            first = d["index"] not in joined  # only a call's first delta has its id and name
            assert first == ("id" in d) == ("name" in d["function"]), d
            j = joined.setdefault(d["index"], {"id": d.get("id"), "name": d["function"].get("name"), "arguments": ""})
            j["arguments"] += d["function"]["arguments"]
        assert [(j["name"], j["arguments"]) for j in joined.values()] == \
            [(c["function"]["name"], c["function"]["arguments"]) for c in whole]
        assert all(j["id"].startswith("call_") for j in joined.values())
    names = [c["function"]["name"] for c in forced_answer(REQUIRED, "stop", ToolChoice("required"))[1]]
    assert names == ["get_weather", "get_time"]
    cut = forced_answer(REQUIRED[:-30], "length", ToolChoice("required"))
    assert [c["function"]["name"] for c in cut[1]] == ["get_weather"] and cut[2] == "length"
    assert json.loads(forced_answer(REQUIRED, "stop", ToolChoice("required"))[1][1]["function"]["arguments"]) == \
        {"zone": "CET"}


@pytest.mark.parametrize("choice", [ToolChoice("auto", parallel=False), ToolChoice("required", parallel=False),
                                    ToolChoice("auto"), ToolChoice("required")])
def test_parallel_tool_calls_false_keeps_one_call_streamed_and_whole(tok, choice):
    """`Shape` on one chat choice: the first call only when not parallel, the same streamed and whole."""
    from launch.generation import Shape
    from launch.outputs import ChoiceState

    if choice.mode == "auto":
        text = "".join(f'<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "{c}"}}}}\n</tool_call>'
                       for c in ("Paris", "Rome"))
    else:
        text = REQUIRED
    ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
    whole = ChoiceState(0, 2, tok)
    whole.feed(ids, True, "stop", stop_token=True)
    answer = Shape(True, tok, None, choice).response("r", "m", 0, [whole], 1)["choices"][0]
    calls = answer["message"]["tool_calls"]
    assert len(calls) == (2 if choice.parallel else 1) and answer["finish_reason"] == "tool_calls"
    shape, c, streamed = Shape(True, tok, None, choice), ChoiceState(0, 2, tok, keep_logprobs=False), []
    for i in range(0, len(ids), 3):
        last = i + 3 >= len(ids)
        d = shape.delta(c, *c.feed(ids[i:i + 3], last, "stop" if last else None, stop_token=last))
        if d is not None:
            streamed.append(d)
    got = [t for d in streamed for t in d["delta"].get("tool_calls", [])]
    assert [(t["index"], t["function"]) for t in got] == [(k, x["function"]) for k, x in enumerate(calls)]
    assert [d["finish_reason"] for d in streamed if d["finish_reason"]] == ["tool_calls"]
    assert answer["message"]["content"] is None and not "".join(d["delta"].get("content", "") for d in streamed)
