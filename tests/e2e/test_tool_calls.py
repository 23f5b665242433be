"""`graphline serve --tool-call-parser hermes` through the official `openai` client on 127.0.0.1, on a real-format
checkpoint whose weights script its greedy output (`tests.fixtures.hf_checkpoints.script_checkpoint`): after a chat
prompt it writes a sentence, one `<tool_call>` JSON block (its pieces added tokens of the tokenizer, as Qwen3's
tags are) and `<|im_end|>`.

- the tools reach the chat template: the prompt is transformers' `apply_chat_template(..., tools=...)`, an earlier
  call's assistant `tool_calls` and the `tool` result message included;
- the answer's `<tool_call>` block is `message.tool_calls` (arguments a JSON string), the sentence the content,
  `finish_reason` "tool_calls"; streamed, the deltas join to the same content and calls;
- `tool_choice: "none"` passes the tools to the template but returns the block as content;
- `parallel_tool_calls: false` keeps the first call of a choice;
- a bad `tools`, `tool_choice` or `parallel_tool_calls` is a 400 naming the field, and the server serves the next request; without the
  parser, tools with the default `tool_choice` are a 400 that names the option.
"""
from __future__ import annotations

import json

import pytest

from e2e_support import openai_client, serve_checkpoint
from tests.fixtures.hf_checkpoints import build_checkpoint, script_checkpoint

openai = pytest.importorskip("openai", reason="the official openai client is a test dependency")
transformers = pytest.importorskip("transformers")

CALL_PIECES = ['{"name": "get_weather", ', '"arguments": {"city": "Paris", "unit": "C"}}']
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
MESSAGES = [{"role": "system", "content": "You help."}, {"role": "user", "content": "Weather in Paris?"}]
HISTORY = MESSAGES + [
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 25 C"},
    {"role": "user", "content": "And Paris?"},
]


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    d = build_checkpoint(tmp_path_factory.mktemp("tools") / "qwen3-calls",
                         extra_tokens=["<tool_call>", "</tool_call>", *CALL_PIECES], max_position_embeddings=1024)
    tok = transformers.AutoTokenizer.from_pretrained(str(d), local_files_only=True)
    vocab = tok.get_vocab()
    prompt = tok.apply_chat_template(MESSAGES, tools=TOOLS, add_generation_prompt=True, tokenize=True,
                                     return_dict=False)
    sentence = tok.encode(" Checking", add_special_tokens=False)
    chain = [prompt[-1], *sentence, vocab["<tool_call>"], *(vocab[p] for p in CALL_PIECES), vocab["</tool_call>"],
             vocab["<|im_end|>"]]
    script_checkpoint(d, chain)
    return d, tok, tok.decode(sentence)


def _serve(d, *extra):
    return serve_checkpoint(d, *extra, max_model_len=1024)  # the tools' signatures make long prompts


@pytest.fixture(scope="module")
def srv(scripted):
    s = _serve(scripted[0], "--tool-call-parser", "hermes")
    yield s
    s.stop()


def _template(tok, messages, tools):
    return tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True,
                                   return_dict=False)


def test_the_tools_and_an_earlier_call_reach_the_template(srv, scripted):
    d, tok, _ = scripted
    c = openai_client(srv)
    for messages in (MESSAGES, HISTORY):
        r = c.chat.completions.create(model=d.name, messages=messages, tools=TOOLS, max_tokens=1, temperature=0)
        assert r.usage.prompt_tokens == len(_template(tok, messages, TOOLS))
    rendered = tok.apply_chat_template(HISTORY, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert '"name": "get_weather"' in rendered and "<tool_response>\nsunny, 25 C" in rendered


def test_a_tool_call_block_is_returned_as_tool_calls(srv, scripted):
    d, tok, sentence = scripted
    c = openai_client(srv)
    kw = dict(model=d.name, messages=MESSAGES, tools=TOOLS, max_tokens=32, temperature=0)
    r = c.chat.completions.create(**kw)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content == sentence.strip()
    (call,) = ch.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "C"}
    chunks = list(c.chat.completions.create(stream=True, **kw))
    deltas = [x.choices[0].delta for x in chunks if x.choices]
    content = "".join(x.content or "" for x in deltas)
    calls = [tc for x in deltas for tc in (x.tool_calls or [])]
    assert content == sentence.strip() and len(calls) == 1 and calls[0].index == 0
    assert calls[0].function.name == "get_weather" and json.loads(calls[0].function.arguments) == {
        "city": "Paris", "unit": "C"}
    assert [x.choices[0].finish_reason for x in chunks if x.choices and x.choices[0].finish_reason] == ["tool_calls"]


def test_tool_choice_none_leaves_the_block_in_the_content(srv, scripted):
    d, tok, sentence = scripted
    r = openai_client(srv).chat.completions.create(model=d.name, messages=MESSAGES, tools=TOOLS, tool_choice="none",
                                             max_tokens=32, temperature=0)
    ch = r.choices[0]
    assert ch.finish_reason == "stop" and not ch.message.tool_calls
    assert ch.message.content == sentence + "<tool_call>" + "".join(CALL_PIECES) + "</tool_call>"


@pytest.mark.parametrize("extra,param", [
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
    ({"tools": TOOLS, "parallel_tool_calls": 0}, "parallel_tool_calls"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tools": TOOLS, "messages": [{"role": "tool", "content": "x"}]}, "messages"),
])
def test_bad_tool_fields_are_400_naming_the_field(srv, scripted, extra, param):
    d = scripted[0]
    c = openai_client(srv)
    body = {"messages": MESSAGES, "max_tokens": 2, **extra}
    with pytest.raises(openai.BadRequestError) as info:
        c.chat.completions.create(model=d.name, **body)
    assert info.value.body["param"] == param, info.value.body
    after = c.chat.completions.create(model=d.name, messages=MESSAGES, max_tokens=2)
    assert after.choices[0].message.content is not None


def test_without_the_parser_tools_need_tool_choice_none(scripted):
    d, tok, sentence = scripted
    s = _serve(d)
    try:
        c = openai_client(s)
        with pytest.raises(openai.BadRequestError) as info:
            c.chat.completions.create(model=d.name, messages=MESSAGES, tools=TOOLS, max_tokens=2)
        assert info.value.body["param"] == "tool_choice" and "--tool-call-parser hermes" in info.value.body["message"]
        r = c.chat.completions.create(model=d.name, messages=MESSAGES, tools=TOOLS, tool_choice="none",
                                      max_tokens=1, temperature=0)
        assert r.usage.prompt_tokens == len(_template(tok, MESSAGES, TOOLS))
    finally:
        s.stop()


def test_the_responses_api_returns_parsed_calls_as_function_call_items(srv, scripted):
    """`/v1/responses` with tools under the hermes parser: the sentence is a message item and the block a
    function_call item, whole and streamed (the events' items are the final object's)."""
    d, tok, sentence = scripted
    c = openai_client(srv)
    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    kw = dict(model=d.name, input=MESSAGES[1]["content"], instructions=MESSAGES[0]["content"], tools=tools,
              max_output_tokens=32, temperature=0)
    r = c.responses.create(**kw)
    assert [o.type for o in r.output] == ["message", "function_call"] and r.status == "completed"
    assert r.output_text == sentence.strip() and r.output[1].name == "get_weather"
    assert json.loads(r.output[1].arguments) == {"city": "Paris", "unit": "C"}
    events = list(c.responses.create(stream=True, **kw))
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [i.type for i in done] == ["message", "function_call"] and done[1].arguments == r.output[1].arguments
    assert [o.id for o in events[-1].response.output] == [i.id for i in done]
