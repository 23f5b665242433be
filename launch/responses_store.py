"""Stored responses (`graphline serve --responses-store N`): the last N responses of `/v1/responses` in this
process's memory, least recently used first out, for `previous_response_id`, `GET /v1/responses/{id}` and
`DELETE /v1/responses/{id}`. Off by default (N = 0): nothing is kept, and those requests are refused. Each entry is a
response object and its conversation as chat messages (the inputs, earlier turns included, and the answer; never the
request's `instructions`, which apply to one request only, as OpenAI treats them). A request with `"store": false`
is not kept. Entries are as large as their conversations (bounded by the request limits); N bounds their number."""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Optional


class ResponseStore:
    """Thread-safe (requests are parsed on the event loop or the tokenize thread)."""

    def __init__(self, capacity: int):
        if type(capacity) is not int or capacity < 1:
            raise ValueError(f"a response store holds at least one response, got {capacity!r}")
        self.capacity = capacity
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, tuple[dict, list[dict]]] = OrderedDict()

    def put(self, response: dict, conversation: list[dict]) -> None:
        with self._lock:
            self._entries[response["id"]] = (response, conversation)
            self._entries.move_to_end(response["id"])
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)

    def get(self, response_id: str) -> Optional[tuple[dict, list[dict]]]:
        """(response object, conversation) or None; a hit becomes the most recently used."""
        with self._lock:
            hit = self._entries.get(response_id)
            if hit is not None:
                self._entries.move_to_end(response_id)
            return hit

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._entries.pop(response_id, None) is not None

    def __len__(self) -> int:
        return len(self._entries)


def answer_messages(output: list[dict]) -> list[dict]:
    """The chat messages of a response's output items: one assistant turn (its text, its calls); reasoning is
    dropped, as chat templates drop earlier turns' reasoning."""
    text = "".join(part["text"] for item in output if item["type"] == "message" for part in item["content"])
    calls = [{"id": item["call_id"], "type": "function", "function": {"name": item["name"],
                                                                     "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]
    msg: dict = {"role": "assistant", "content": text or (None if calls else "")}
    if calls:
        msg["tool_calls"] = calls
    return [msg]
