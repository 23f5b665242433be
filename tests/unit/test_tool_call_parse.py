"""The Hermes tool-call parser (`launch.tools`): a whole text and the same text streamed in any pieces give the
same content and calls; malformed or unclosed blocks stay content; the request fields check what the template
will receive."""
import json
import random

import pytest

from engine.errors import RequestError
from launch.tools import ToolCallStream, ToolChoice, extract_tool_calls, parse_tool_choice, parse_tools

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TEXTS = {
    "one call after text": "Let me check.\n" + CALL + "\n",
    "two calls, no text": "  \n" + CALL + CALL.replace("Paris", "Rome"),
    "text around a call": "Hi\n" + CALL + "\nBye  ",
    "a partial and an unclosed tag": "no calls here <tool_ but <tool_call> unclosed",
    "malformed JSON": "bad <tool_call>{not json}</tool_call> ok",
    "arguments not an object": '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
    "no name": '<tool_call>{"arguments": {}}</tool_call> text',
    "plain text": "\n\nplain text, 日本語\n",
    "empty": "",
}


def _streamed(text: str, seed: int) -> tuple[str, list[dict]]:
    rng = random.Random(seed)
    st, out, calls, i = ToolCallStream(), [], [], 0
    while i < len(text):
        k = rng.randint(1, 7)
        c, new = st.push(text[i:i + k])
        out.append(c)
        calls += new
        i += k
    out.append(st.finish())
    assert calls == st.calls
    return "".join(out), calls


@pytest.mark.parametrize("name", TEXTS)
def test_streamed_pieces_equal_the_whole_text(name):
    text = TEXTS[name]
    content, calls = extract_tool_calls(text)
    for seed in range(40):
        got, got_calls = _streamed(text, seed)
        assert got == (content or "")
        assert [c["function"] for c in got_calls] == [c["function"] for c in calls]


def test_what_is_parsed_and_what_stays_content():
    content, calls = extract_tool_calls(TEXTS["one call after text"])
    assert content == "Let me check." and len(calls) == 1
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    assert calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert extract_tool_calls(TEXTS["two calls, no text"])[0] is None
    two = extract_tool_calls(TEXTS["two calls, no text"])[1]
    assert [json.loads(c["function"]["arguments"])["city"] for c in two] == ["Paris", "Rome"]
    assert extract_tool_calls(TEXTS["text around a call"])[0] == "Hi\n\nBye"
    for name in ("a partial and an unclosed tag", "malformed JSON", "arguments not an object", "no name"):
        content, calls = extract_tool_calls(TEXTS[name])
        assert calls == [] and content == TEXTS[name].strip(), name


def test_request_fields():
    tools = parse_tools([{"type": "function", "function": {"name": "f", "description": "d", "parameters": {
        "type": "object"}, "strict": True}}])
    assert tools == [{"type": "function", "function": {"name": "f", "description": "d",
                                                       "parameters": {"type": "object"}}}]
    assert parse_tools(None) is None and parse_tools([]) is None
    assert parse_tool_choice(None, tools) == ToolChoice("auto") and parse_tool_choice(None, None).mode == "none"
    assert parse_tool_choice("none", tools).mode == "none"
    assert parse_tool_choice("required", tools, False) == ToolChoice("required", parallel=False)
    named = parse_tool_choice({"type": "function", "function": {"name": "f"}}, tools)
    assert named == ToolChoice("function", "f") and named.forced and not ToolChoice("auto").forced
    for bad, param in (("required", "tool_choice"), ({"type": "function", "function": {"name": "g"}}, "tool_choice"),
                       ({"type": "function"}, "tool_choice"), ({"function": {"name": "f"}}, "tool_choice"),
                       ("always", "tool_choice")):
        with pytest.raises(RequestError) as info:
            parse_tool_choice(bad, tools if bad != "required" else None)
        assert info.value.param == param, bad
    with pytest.raises(RequestError) as info:
        parse_tool_choice("auto", tools, "no")
    assert info.value.param == "parallel_tool_calls"
