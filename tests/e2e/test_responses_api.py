"""`POST /v1/responses` (OpenAI's Responses API) on a real `graphline serve` of a checkpoint with a real byte-level
BPE tokenizer, through the official `openai` client's `responses.create` (whole and streamed) and raw HTTP, all
requests to 127.0.0.1. Every expectation comes from the same server's chat completions of the same conversation:
a response is the chat answer in the Responses shape, and its stream's events build the same output."""
from __future__ import annotations

import json
import time

import pytest

from e2e_support import http_json, openai_client, serve_checkpoint
from tests.fixtures.hf_checkpoints import build_checkpoint

openai = pytest.importorskip("openai")
transformers = pytest.importorskip("transformers")
pytest.importorskip("llguidance")

SCHEMAS = {"get_weather": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                           "required": ["city"], "additionalProperties": False}}
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather",
                                                "parameters": SCHEMAS["get_weather"]}}]
TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather",
          "parameters": SCHEMAS["get_weather"]}]


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    d = build_checkpoint(tmp_path_factory.mktemp("responses") / "tiny-chat", max_position_embeddings=1024)
    s = serve_checkpoint(d, "--max-model-len", "1024")
    yield s
    s.stop()


def test_a_response_is_the_chat_answer_in_the_responses_shape(srv):
    client = openai_client(srv)
    r = client.responses.create(model="tiny-chat", instructions="Be brief.", input="Why is the sky blue?",
                                max_output_tokens=12, temperature=0)
    chat = client.chat.completions.create(model="tiny-chat", max_tokens=12, temperature=0, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why is the sky blue?"}])
    assert r.object == "response" and r.id.startswith("resp_") and r.model == "tiny-chat"
    assert r.output_text == chat.choices[0].message.content and r.output_text
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"  # 12 tokens cut it
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, 12)
    assert r.usage.total_tokens == r.usage.input_tokens + 12 and r.max_output_tokens == 12
    items = client.responses.create(model="tiny-chat", max_output_tokens=12, temperature=0, input=[
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Why is the sky blue?"}]}])
    assert items.output_text == r.output_text


def _events(client, **kw) -> list:
    return list(client.responses.create(stream=True, **kw))


def test_the_stream_builds_the_same_output(srv):
    client = openai_client(srv)
    kw = dict(model="tiny-chat", input="Tell me about foxes.", max_output_tokens=16, temperature=1.0,
              extra_body={"seed": 5})
    whole = client.responses.create(**kw)
    events = _events(client, **kw)
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.incomplete"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text
    done = [e for e in events if e.type == "response.output_text.done"]
    assert [d.text for d in done] == [deltas]
    final = events[-1].response
    assert final.output_text == deltas and final.usage.output_tokens == 16
    added = [e.item.id for e in events if e.type == "response.output_item.added"]
    assert added == [o.id for o in final.output]
    assert kinds.index("response.content_part.added") < kinds.index("response.output_text.delta") < \
        kinds.index("response.output_text.done") < kinds.index("response.content_part.done") < \
        kinds.index("response.output_item.done")


def test_function_calls_and_their_results_round_trip(srv):
    client = openai_client(srv)
    named = client.responses.create(model="tiny-chat", input="Weather in Paris?", tools=TOOLS, temperature=0,
                                    tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=48)
    (call,) = named.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    assert json.loads(call.arguments)["city"] in ("Paris", "Rome") and named.status == "completed"
    chat = client.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "Weather in "
                                                                         "Paris?"}], tools=CHAT_TOOLS, temperature=0,
                                          tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                          max_tokens=48)
    assert call.arguments == chat.choices[0].message.tool_calls[0].function.arguments
    events = _events(client, model="tiny-chat", input="Weather in Paris?", tools=TOOLS, temperature=0,
                     tool_choice="required", parallel_tool_calls=False, max_output_tokens=64)
    streamed = [e.item for e in events if e.type == "response.output_item.done"]
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert [i.type for i in streamed] == ["function_call"] and streamed[0].arguments == args
    assert events[-1].type == "response.completed" and events[-1].response.output[0].call_id == streamed[0].call_id
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]
    after = client.responses.create(model="tiny-chat", input=history, tools=TOOLS, tool_choice="none",
                                    max_output_tokens=8, temperature=0)
    chat_after = client.chat.completions.create(model="tiny-chat", tools=CHAT_TOOLS, tool_choice="none", max_tokens=8,
                                                temperature=0, messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": call.call_id, "type": "function", "function": {
            "name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"}])
    assert after.output_text == chat_after.choices[0].message.content
    assert after.usage.input_tokens == chat_after.usage.prompt_tokens


def test_text_format_json_schema(srv):
    client = openai_client(srv)
    r = client.responses.create(model="tiny-chat", input="Weather?", max_output_tokens=48, temperature=1.0, text={
        "format": {"type": "json_schema", "name": "w", "schema": SCHEMAS["get_weather"], "strict": True}})
    assert r.status == "completed" and json.loads(r.output_text)["city"] in ("Paris", "Rome")


def _post(url: str, body: dict) -> tuple[int, dict]:
    return http_json(url + "/v1/responses", body=body)


def _delete(url: str, rid: str) -> tuple[int, dict]:
    return http_json(f"{url}/v1/responses/{rid}", "DELETE")


@pytest.mark.parametrize("fields, param", [
    ({"input": None}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"role": "wizard", "content": "x"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
    ({"input": [{"type": "web_search_call"}]}, "input"),
    ({"input": [{"type": "function_call", "name": "f"}]}, "input"),
    ({"instructions": 5}, "instructions"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": "8"}, "max_output_tokens"),
    ({"input": "x " * 2000}, "input"),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"text": "json"}, "text"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"background": True}, "background"),  # this server keeps no responses
    ({"background": "yes"}, "background"),
    ({"truncation": "middle"}, "truncation"),
    ({"temperature": 101}, "temperature"),
    ({"top_logprobs": 25}, "top_logprobs"),
    ({"include": "message.output_text.logprobs"}, "include"),
])
def test_bad_fields_are_400s_naming_the_responses_field(srv, fields, param):
    status, body = _post(srv.url, {"model": "tiny-chat", "input": "hi", "max_output_tokens": 4, **fields})
    assert status == 400 and body["error"]["param"] == param, body
    assert "messages" not in body["error"]["message"] and "max_completion_tokens" not in body["error"]["message"]
    ok = openai_client(srv).responses.create(model="tiny-chat", input="still there?", max_output_tokens=2,
                                             extra_body={"ignore_eos": True})
    assert ok.status == "incomplete" and ok.usage.output_tokens == 2


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    d = build_checkpoint(tmp_path_factory.mktemp("responses-store") / "tiny-chat", max_position_embeddings=1024)
    s = serve_checkpoint(d, "--max-model-len", "1024", "--responses-store", "3")
    yield s
    s.stop()


def test_previous_response_id_continues_a_stored_conversation(stored):
    client = openai_client(stored)
    first = client.responses.create(model="tiny-chat", instructions="Only for the first turn.",
                                    input="My name is Ann.", max_output_tokens=6, temperature=0)
    assert first.store is True and client.responses.retrieve(first.id).output_text == first.output_text
    second = client.responses.create(model="tiny-chat", previous_response_id=first.id, input="What is my name?",
                                     max_output_tokens=6, temperature=0)
    chat = client.chat.completions.create(model="tiny-chat", max_tokens=6, temperature=0, messages=[
        {"role": "user", "content": "My name is Ann."}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"}])  # the first turn's instructions are not carried over
    assert second.previous_response_id == first.id and second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    events = list(client.responses.create(model="tiny-chat", previous_response_id=second.id, input="And?",
                                          max_output_tokens=4, temperature=0, stream=True))
    third = client.responses.retrieve(events[-1].response.id)
    assert third.output_text == events[-1].response.output_text and third.previous_response_id == second.id
    assert _delete(stored.url, first.id) == (200, {"id": first.id, "object": "response.deleted", "deleted": True})
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    assert _delete(stored.url, first.id)[0] == 404


def test_the_store_keeps_the_last_n_and_honours_store_false(stored):
    client = openai_client(stored)
    ids = [client.responses.create(model="tiny-chat", input=f"turn {i}", max_output_tokens=2).id for i in range(4)]
    with pytest.raises(openai.NotFoundError):  # 3 kept: the oldest is gone
        client.responses.retrieve(ids[0])
    assert [client.responses.retrieve(i).id for i in ids[1:]] == ids[1:]
    status, body = _post(stored.url, {"model": "tiny-chat", "input": "x", "previous_response_id": ids[0]})
    assert status == 404 and body["error"]["param"] == "previous_response_id", body
    unkept = client.responses.create(model="tiny-chat", input="x", max_output_tokens=2, store=False)
    assert unkept.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unkept.id)
    status, body = _post(stored.url, {"model": "tiny-chat", "input": "x", "store": "yes"})
    assert status == 400 and body["error"]["param"] == "store", body


def test_without_a_store_nothing_is_kept(srv):
    client = openai_client(srv)
    r = client.responses.create(model="tiny-chat", input="x", max_output_tokens=2)
    assert r.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)


def test_output_text_logprobs_equal_chats(srv):
    client = openai_client(srv)
    kw = dict(model="tiny-chat", input="Count to three.", max_output_tokens=8, temperature=0,
              include=["message.output_text.logprobs"], top_logprobs=2, extra_body={"ignore_eos": True})
    r = client.responses.create(**kw)
    chat = client.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "Count to three."}],
                                          max_tokens=8, temperature=0, logprobs=True, top_logprobs=2,
                                          extra_body={"ignore_eos": True})
    got = [(e.token, round(e.logprob, 5), [t.token for t in e.top_logprobs]) for e in r.output[0].content[0].logprobs]
    want = [(e.token, round(e.logprob, 5), [t.token for t in e.top_logprobs]) for e in chat.choices[0].logprobs.content]
    assert got == want and len(got) >= 1
    events = list(client.responses.create(stream=True, **kw))
    streamed = [(e2["token"], round(e2["logprob"], 5)) for e in events if e.type == "response.output_text.delta"
                for e2 in (x if isinstance(x, dict) else x.model_dump() for x in e.logprobs)]
    assert streamed == [(t, lp) for t, lp, _ in want]
    plain = client.responses.create(model="tiny-chat", input="Count to three.", max_output_tokens=2)
    assert plain.output[0].content[0].logprobs == []


def test_truncation_auto_drops_the_oldest_turns_that_overflow(srv):
    """A conversation whose oldest turns overflow the 1024-token context: a 400 naming `input` when truncation is
    disabled; with "auto" those turns are dropped (the instructions kept) and the answer is chat's of the rest."""
    client = openai_client(srv)
    turns = [{"role": "user", "content": "tell me everything " * 400}, {"role": "assistant", "content": "no"},
             {"role": "user", "content": "a short question"}]
    status, body = _post(srv.url, {"model": "tiny-chat", "input": turns, "max_output_tokens": 6})
    assert status == 400 and body["error"]["param"] == "input", body
    r = client.responses.create(model="tiny-chat", instructions="Be brief.", input=turns, max_output_tokens=6,
                                temperature=0, truncation="auto")
    chat = client.chat.completions.create(model="tiny-chat", max_tokens=6, temperature=0, messages=[
        {"role": "system", "content": "Be brief."}, *turns[1:]])
    assert r.truncation == "auto" and r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    # the prompt fits but not with max_output_tokens: the oldest turns go too
    fits = [{"role": "user", "content": "tell me everything " * 150}, *turns[1:]]
    status, body = _post(srv.url, {"model": "tiny-chat", "input": fits, "max_output_tokens": 900})
    assert status == 400, body
    r2 = client.responses.create(model="tiny-chat", input=fits, max_output_tokens=900, temperature=0,
                                 truncation="auto", extra_body={"ignore_eos": True})
    assert r2.usage.input_tokens + r2.usage.output_tokens <= 1024 and r2.usage.output_tokens == 900


def _poll(client, rid: str, until: float = 60.0):
    deadline = time.monotonic() + until
    while True:
        r = client.responses.retrieve(rid)
        if r.status != "in_progress" or time.monotonic() > deadline:
            return r
        time.sleep(0.05)


def test_background_responses_are_polled_and_cancelled(stored):
    """`background: true`: answered at once `in_progress`, then the stored object becomes the same answer as the
    request made in the foreground; a long one is cancelled (its engine request aborted: nothing keeps running)."""
    client = openai_client(stored)
    kw = dict(model="tiny-chat", input="Why is the sky blue?", max_output_tokens=8, temperature=0)
    fg = client.responses.create(**kw)
    bg = client.responses.create(background=True, **kw)
    assert bg.background is True and bg.status in ("in_progress", "completed") and bg.id != fg.id
    done = _poll(client, bg.id)
    assert done.status == fg.status and done.output_text == fg.output_text and done.usage.output_tokens == 8
    long = client.responses.create(model="tiny-chat", input="go on", max_output_tokens=900, background=True,
                                   extra_body={"ignore_eos": True})
    cancelled = client.responses.cancel(long.id)
    assert cancelled.status == "cancelled" and client.responses.retrieve(long.id).status == "cancelled"
    status, body = http_json(stored.url + f"/v1/responses/{bg.id}/cancel", "POST", {})
    assert status == 400 and body["error"]["code"] == "invalid_state"  # finished: nothing to cancel
    status, body = http_json(stored.url + "/v1/responses/resp_nope/cancel", "POST", {})
    assert status == 404
    status, body = http_json(stored.url + "/status", "GET")
    assert status == 200 and body["engine"]["running"] == 0 and body["engine"]["waiting"] == 0, body
    for bad in ({"stream": True}, {"store": False}):
        status, body = _post(stored.url, {**kw, "background": True, **bad})
        assert status == 400 and body["error"]["param"] == "background"
