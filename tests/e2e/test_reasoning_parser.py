"""`graphline serve --reasoning-parser qwen3` through the official `openai` client on 127.0.0.1, on a real-format
checkpoint whose weights make its greedy output a known token chain (`tests.fixtures.hf_checkpoints.
script_checkpoint`): after the chat prompt it writes `<think>`, two reasoning tokens, `</think>`, three content
tokens and `<|im_end|>` (an EOS of its generation_config.json).

- the message carries the think block's text in `reasoning_content` and the rest in `content`; usage counts every
  token and the think block's as `reasoning_tokens`; the stream's deltas join to the same two texts;
- a request cut by `max_tokens` inside the think block has reasoning and no content, streamed or not;
- the same server without the parser returns the think block's tokens in `content` (the fixture's tags are
  special tokens, so their own text is dropped);
- `--reasoning-parser` on a preset (no tokenizer) fails at once, in one line, before any rank starts.
"""
from __future__ import annotations

import subprocess
import time

import pytest

from e2e_support import REPO, graphline, openai_client, serve_checkpoint
from tests.fixtures.hf_checkpoints import build_checkpoint, script_checkpoint

openai = pytest.importorskip("openai", reason="the official openai client is a test dependency")
transformers = pytest.importorskip("transformers")

MESSAGES = [{"role": "user", "content": "Why is the fox quick?"}]


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    d = build_checkpoint(tmp_path_factory.mktemp("reasoning") / "qwen3-thinks", max_position_embeddings=1024)
    tok = transformers.AutoTokenizer.from_pretrained(str(d), local_files_only=True)
    prompt = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    vocab = tok.get_vocab()
    reasoning = tok.encode(" quick", add_special_tokens=False)
    content = tok.encode(" brown", add_special_tokens=False) + tok.encode(" fox", add_special_tokens=False)[:1]
    chain = [prompt[-1], vocab["<think>"], *reasoning, vocab["</think>"], *content, vocab["<|im_end|>"]]
    script_checkpoint(d, chain)
    return d, tok, reasoning, content, len(chain) - 1


@pytest.fixture(scope="module")
def srv(scripted):
    s = serve_checkpoint(scripted[0], "--reasoning-parser", "qwen3", "--max-model-len", "1024")  # tools: long prompts
    yield s
    s.stop()


def _stream(c, **kw):
    chunks = list(c.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
    reasoning = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    return reasoning, content, finish, chunks[-1].usage


def test_the_think_block_is_reasoning_content_and_the_rest_content(srv, scripted):
    d, tok, reasoning, content, n_tokens = scripted
    c = openai_client(srv)
    kw = dict(model=d.name, messages=MESSAGES, max_tokens=32, temperature=0)
    r = c.chat.completions.create(**kw)
    msg = r.choices[0].message
    assert msg.model_extra["reasoning_content"] == tok.decode(reasoning) == " quick"
    assert msg.content == tok.decode(content) == " brown f"
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == n_tokens  # tags and the EOS counted
    assert r.usage.completion_tokens_details.reasoning_tokens == len(reasoning) + 2
    s_reasoning, s_content, finish, usage = _stream(c, **kw)
    assert (s_reasoning, s_content, finish) == (" quick", " brown f", ["stop"])
    assert usage.completion_tokens == n_tokens


def test_a_choice_cut_inside_the_think_block_has_reasoning_only(srv, scripted):
    d, tok, reasoning, content, _ = scripted
    c = openai_client(srv)
    kw = dict(model=d.name, messages=MESSAGES, max_tokens=1 + len(reasoning), temperature=0)
    r = c.chat.completions.create(**kw)
    assert r.choices[0].message.model_extra["reasoning_content"] == " quick"
    assert r.choices[0].message.content == "" and r.choices[0].finish_reason == "length"
    assert _stream(c, **kw)[:3] == (" quick", "", ["length"])


def test_without_the_parser_the_think_block_stays_in_content(scripted):
    d, tok, reasoning, content, _ = scripted
    s = serve_checkpoint(d)
    try:
        r = openai_client(s).chat.completions.create(model=d.name, messages=MESSAGES, max_tokens=32, temperature=0)
    finally:
        s.stop()
    msg = r.choices[0].message
    assert "reasoning_content" not in (msg.model_extra or {})
    assert msg.content == tok.decode(reasoning + content) == " quick brown f"


def test_a_model_without_think_tags_fails_in_one_line_before_any_rank_starts():
    t0 = time.monotonic()
    p = subprocess.run(graphline("serve", "--model", "qwen3-tiny", "--executor", "local", "--device", "cpu",
                                 "--reasoning-parser", "qwen3", "--port", "0"),
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    lines = [ln for ln in p.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and "--reasoning-parser needs a checkpoint with a tokenizer" in lines[0], p.stderr
    assert time.monotonic() - t0 < 60


def test_a_grammar_applies_after_the_think_block(srv, scripted):
    """Reasoning-aware structured outputs: the scripted model opens its think block and reasons freely (the grammar
    allows `<think>` or JSON first, then everything until `</think>`); what follows is the schema's JSON, not the
    script's content tokens."""
    from test_structured_outputs import FORMAT, _check_answer

    d, tok, reasoning, content, n_tokens = scripted
    c = openai_client(srv)
    r = c.chat.completions.create(model="qwen3-thinks", messages=MESSAGES, max_tokens=64, temperature=0,
                                  response_format=FORMAT)
    msg = r.choices[0].message
    assert (msg.model_extra or {}).get("reasoning_content") == tok.decode(reasoning)
    assert r.choices[0].finish_reason == "stop"
    _check_answer(msg.content)
    assert msg.content != tok.decode(content)  # the script's content tokens were masked away
    cut = c.chat.completions.create(model="qwen3-thinks", messages=MESSAGES, max_tokens=1 + len(reasoning),
                                    temperature=0, response_format=FORMAT)  # ends inside the think block
    assert cut.choices[0].message.content == "" and cut.choices[0].finish_reason == "length"


def test_a_forced_tool_call_follows_the_think_block(srv, scripted):
    """`tool_choice` with a named function under the reasoning parser: the think block is the script's reasoning,
    and the call's arguments come after it, in the function's schema."""
    from test_tool_choice_forced import NAMED, TOOLS, _check_call

    d, tok, reasoning, content, n_tokens = scripted
    r = openai_client(srv).chat.completions.create(model="qwen3-thinks", messages=MESSAGES, max_tokens=96,
                                                   temperature=0, tools=TOOLS, tool_choice=NAMED)
    ch = r.choices[0]
    assert (ch.message.model_extra or {}).get("reasoning_content") == tok.decode(reasoning)
    assert ch.finish_reason == "stop" and ch.message.content is None
    (call,) = ch.message.tool_calls
    assert call.function.name == "get_weather"
    _check_call("get_weather", call.function.arguments)


def test_the_responses_api_returns_the_think_block_as_a_reasoning_item(srv, scripted):
    d, tok, reasoning, content, n_tokens = scripted
    c = openai_client(srv)
    r = c.responses.create(model="qwen3-thinks", input=MESSAGES[0]["content"], max_output_tokens=64, temperature=0)
    assert [o.type for o in r.output] == ["reasoning", "message"] and r.status == "completed"
    assert r.output[0].content[0].text == tok.decode(reasoning) and r.output_text == tok.decode(content)
    assert r.usage.output_tokens_details.reasoning_tokens == len(reasoning) + 2 and r.usage.output_tokens == n_tokens
    events = list(c.responses.create(model="qwen3-thinks", input=MESSAGES[0]["content"], max_output_tokens=64,
                                     temperature=0, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == tok.decode(reasoning)
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == tok.decode(content)
    final = events[-1].response
    assert events[-1].type == "response.completed" and [o.type for o in final.output] == ["reasoning", "message"]
    assert [e.item.type for e in events if e.type == "response.output_item.done"] == ["reasoning", "message"]
