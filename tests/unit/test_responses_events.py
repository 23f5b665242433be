"""The Responses API's event stream (`launch.responses_stream.ResponseEventWriter`) from the chat deltas of one
choice, written into an in-memory sink: every item is opened before its deltas and closed before the next opens,
sequence numbers count up from 0, the final object's items are the streamed ones, a named call's argument pieces
join, and an engine failure ends the stream with `response.failed` instead of a completed object (not stored)."""
from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("aiohttp")
from launch.responses_stream import ResponseEventWriter  # noqa: E402

ECHO = {"model": "m", "instructions": None, "store": False, "previous_response_id": None, "tools": []}
USAGE = {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12, "prompt_tokens_details": {"cached_tokens": 0},
         "completion_tokens_details": {"reasoning_tokens": 3}}


class Sink:
    """What the writer writes to (an aiohttp StreamResponse's write / write_eof)."""

    def __init__(self) -> None:
        self.data, self.writes, self.eof = b"", 0, False

    async def write(self, b: bytes) -> None:
        assert not self.eof
        self.data, self.writes = self.data + b, self.writes + 1

    async def write_eof(self) -> None:
        self.eof = True

    def events(self) -> list[dict]:
        out = []
        for block in self.data.decode().split("\n\n"):
            if block:
                kind, data = block.split("\n")
                ev = json.loads(data[len("data: "):])
                assert kind == f"event: {ev['type']}"
                out.append(ev)
        return out


def _delta(content=None, reasoning=None, calls=None, finish=None) -> dict:
    d = {}
    if content:
        d["content"] = content
    if reasoning:
        d["reasoning_content"] = reasoning
    if calls:
        d["tool_calls"] = calls
    return {"index": 0, "delta": d, "finish_reason": finish}


def _run(deltas: list[dict], fail: bool = False, keep=None) -> tuple[Sink, list[dict]]:
    async def main():
        sink = Sink()
        w = ResponseEventWriter(sink, "resp_1", 0, ECHO, lambda exc: "ref", keep)
        await w.start([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])
        for d in deltas:
            await w.choices([d])
        if fail:
            await w.error(RuntimeError("rank died"))
        await w.close(USAGE)
        return sink

    sink = asyncio.run(main())
    return sink, sink.events()


def test_reasoning_text_and_calls_are_items_in_order():
    call = {"index": 0, "id": "call_a", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    kept = []
    sink, ev = _run([_delta(reasoning="think "), _delta(reasoning="more"), _delta(content="Hi"), _delta(content="!"),
                     _delta(calls=[call], finish="tool_calls")], keep=kept.append)
    assert [e["sequence_number"] for e in ev] == list(range(len(ev))) and sink.eof
    kinds = [e["type"] for e in ev]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    opened = [i for i, k in enumerate(kinds) if k == "response.output_item.added"]
    closed = [i for i, k in enumerate(kinds) if k == "response.output_item.done"]
    assert len(opened) == len(closed) == 3 and all(a < b < c for a, b, c in zip(opened, closed, opened[1:] + [1e9]))
    final = ev[-1]["response"]
    assert [o["type"] for o in final["output"]] == ["reasoning", "message", "function_call"]
    texts = [o["content"][0]["text"] for o in final["output"][:2]]
    assert texts == ["think more", "Hi!"]
    assert final["output"][2]["call_id"] == "call_a" and final["output"][2]["arguments"] == '{"x": 1}'
    done_ids = [e["item"]["id"] for e in ev if e["type"] == "response.output_item.done"]
    assert done_ids == [o["id"] for o in final["output"]]
    assert final["usage"]["output_tokens_details"] == {"reasoning_tokens": 3} and final["status"] == "completed"
    assert kept == [final]
    assert sink.writes == 1 + 5 + 1  # the opening pair, one write per update, the close


def test_a_named_calls_pieces_join_and_length_is_incomplete():
    first = {"index": 0, "id": "call_b", "type": "function", "function": {"name": "g", "arguments": '{"c'}}
    pieces = [{"index": 0, "function": {"arguments": p}} for p in ('ity": ', '"Rome"', "}")]
    _, ev = _run([_delta(calls=[first]), *[_delta(calls=[p]) for p in pieces[:-1]],
                  _delta(calls=[pieces[-1]], finish="length")])
    args = "".join(e["delta"] for e in ev if e["type"] == "response.function_call_arguments.delta")
    done = [e for e in ev if e["type"] == "response.function_call_arguments.done"]
    assert args == '{"city": "Rome"}' and [d["arguments"] for d in done] == [args]
    final = ev[-1]
    assert final["type"] == "response.incomplete" and final["response"]["status"] == "incomplete"
    assert final["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


def test_an_engine_failure_ends_with_response_failed_and_nothing_is_kept():
    kept = []
    sink, ev = _run([_delta(content="partial")], fail=True, keep=kept.append)
    kinds = [e["type"] for e in ev]
    assert kinds[-2:] == ["response.output_item.done", "response.failed"] and "error" in kinds
    assert kinds.index("error") < kinds.index("response.failed") and sink.eof
    final = ev[-1]["response"]
    assert final["status"] == "failed" and final["error"]["code"] == "server_error"
    assert final["output"][0]["content"][0]["text"] == "partial" and final["output"][0]["status"] == "incomplete"
    assert "response.completed" not in kinds and kept == []


def test_an_empty_answer_is_an_empty_message():
    _, ev = _run([_delta(finish="stop")])
    assert [o["type"] for o in ev[-1]["response"]["output"]] == ["message"]
    assert ev[-1]["response"]["output"][0]["content"][0]["text"] == ""
