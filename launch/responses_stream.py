"""Streamed `/v1/responses`: the chat deltas of one choice (`launch.generation.Shape.delta`) as the Responses API's
server-sent events, each `event: <type>` + `data: {"type", "sequence_number", ...}`.

`response.created` and `response.in_progress` open the stream. Each output item is opened by
`response.output_item.added` and closed by `response.output_item.done` before the next one opens:
- reasoning (`--reasoning-parser`): `response.content_part.added` (a `reasoning_text` part), then
  `response.reasoning_text.delta`s, `response.reasoning_text.done` and `response.content_part.done`;
- the message: `response.content_part.added` (an `output_text` part), `response.output_text.delta`s,
  `response.output_text.done`, `response.content_part.done`;
- a function call: `response.function_call_arguments.delta`s (the whole arguments when the call arrives whole, the
  next piece for a named `tool_choice`), `response.function_call_arguments.done`.
`response.completed` (or `response.incomplete` when `max_output_tokens` cut the answer) carries the whole response
object, whose items are the ones streamed (same ids, texts and call ids). An engine failure is an `error` event and
then `response.failed` (status "failed", the items streamed so far, nothing stored). No `[DONE]` follows, as OpenAI
sends none on this API.
"""
from __future__ import annotations

import json
from typing import Any, Callable, Optional

from aiohttp import web

from launch.generation import Shape, log_failure
from launch.outputs import ChoiceState
from launch.protocol import ApiError, GenerationRequest
from launch.responses import (function_call_item, message_item, new_id, output_text, reasoning_item, response_object,
                              usage_object)
from launch.tools import ToolChoice

TEXT_EVENTS = {"reasoning": ("response.reasoning_text.delta", "response.reasoning_text.done"),
               "message": ("response.output_text.delta", "response.output_text.done")}


class ResponseEventWriter:
    """The events of one streamed response. `choices(deltas)`: chat deltas of its one choice; `close(usage)`: the
    closing events and the final object (`usage`: the chat usage object of the finished choice)."""

    def __init__(self, resp: web.StreamResponse, rid: str, created: int, echo: dict,
                 failed: Callable[[BaseException], str], keep: Optional[Callable[[dict], None]] = None):
        """`failed`: logs an engine failure, returns its reference; `keep`: stores the final object."""
        self.resp, self.rid, self.created, self.echo, self._failed = resp, rid, created, echo, failed
        self.keep = keep
        self._pending: list[str] = []  # events of this update, written together (one write per token)
        self.seq = 0
        self.items: list[dict] = []  # the output items so far, each as streamed
        self.open: Optional[dict] = None  # the item being streamed
        self.finish_reason: Optional[str] = None
        self.failure: Optional[dict] = None  # set by `error`: the stream ends with response.failed
        self._lp_held: list = []  # logprob entries of tokens that brought no text yet

    def _event(self, kind: str, **fields: Any) -> None:
        data = json.dumps({"type": kind, "sequence_number": self.seq, **fields})
        self.seq += 1
        self._pending.append(f"event: {kind}\ndata: {data}\n\n")

    async def _flush(self) -> None:
        if self._pending:
            text, self._pending = "".join(self._pending), []
            await self.resp.write(text.encode())

    async def start(self, openings: list[dict]) -> None:
        """The opening events (the chat openings, a role each, have nothing to add)."""
        snapshot = response_object(self.rid, self.created, self.echo, None, "in_progress")
        self._event("response.created", response=snapshot)
        self._event("response.in_progress", response=snapshot)
        await self._flush()

    async def choices(self, deltas: list[dict], usage_: Optional[dict] = None) -> None:
        for d in deltas:
            delta = d["delta"]
            if delta.get("reasoning_content"):
                self._text("reasoning", delta["reasoning_content"])
            lps = (d.get("logprobs") or {}).get("content") or []
            if delta.get("content"):
                self._text("message", delta["content"], self._lp_held + lps)
                self._lp_held = []
            else:  # tokens without text yet (part of a character): their entries go with the next text
                self._lp_held += lps
            for call in delta.get("tool_calls") or ():
                self._call(call)
            self.finish_reason = d["finish_reason"] or self.finish_reason
        await self._flush()

    def _open(self, item: dict, part: Optional[dict] = None) -> None:
        self._close_open()
        self.open = item
        self.items.append(item)
        self._event("response.output_item.added", output_index=len(self.items) - 1, item=item)
        if part is not None:
            item["content"].append(part)
            self._event("response.content_part.added", item_id=item["id"], output_index=len(self.items) - 1,
                              content_index=0, part=part)

    def _text(self, kind: str, text: str, logprobs: Optional[list] = None) -> None:
        """`logprobs`: the chat entries of the delta's tokens (message text only)."""
        if self.open is None or self.open["type"] != kind:
            if kind == "reasoning":
                item = reasoning_item(new_id("rs"), "", "in_progress")
                part = item["content"].pop()
            else:
                item, part = message_item(new_id("msg"), None, "in_progress"), output_text("")
            self._open(item, part)
        part = self.open["content"][0]
        part["text"] += text
        extra = {}
        if kind == "message":
            part["logprobs"] += logprobs or []
            extra["logprobs"] = logprobs or []
        self._event(TEXT_EVENTS[kind][0], item_id=self.open["id"], output_index=len(self.items) - 1,
                    content_index=0, delta=text, **extra)

    def _call(self, call: dict) -> None:
        """A chat `tool_calls` delta entry: one with an `id` opens a call, the others add to the open one."""
        if "id" in call:
            opened = {**call, "function": {**call["function"], "arguments": ""}}
            self._open(function_call_item(new_id("fc"), opened, "in_progress"))
        args = call["function"].get("arguments") or ""
        if args and self.open is not None and self.open["type"] == "function_call":
            self.open["arguments"] += args
            self._event("response.function_call_arguments.delta", item_id=self.open["id"],
                              output_index=len(self.items) - 1, delta=args)

    def _close_open(self, status: str = "completed") -> None:
        item, self.open = self.open, None
        if item is None:
            return
        index = len(self.items) - 1
        if item["type"] == "function_call":
            self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                              arguments=item["arguments"])
        else:
            part = item["content"][0]
            self._event(TEXT_EVENTS[item["type"]][1], item_id=item["id"], output_index=index, content_index=0,
                              text=part["text"])
            self._event("response.content_part.done", item_id=item["id"], output_index=index,
                              content_index=0, part=part)
        item["status"] = status
        self._event("response.output_item.done", output_index=index, item=item)

    async def close(self, usage_: dict) -> None:
        if self.failure is not None:  # the engine failed: what was streamed, then response.failed
            self._close_open("incomplete")
            final = response_object(self.rid, self.created, self.echo, None, "failed")
            final.update(output=self.items, error=self.failure)
            self._event("response.failed", response=final)
            await self._flush()
            await self.resp.write_eof()
            return
        status = "incomplete" if self.finish_reason == "length" else "completed"
        if self._lp_held and self.open is not None and self.open["type"] == "message":
            self._text("message", "", self._lp_held)  # the last tokens brought no text
        self._close_open(status)
        if not self.items:  # an empty answer is still a message
            self._open(message_item(new_id("msg"), None, "in_progress"), output_text(""))
            self._close_open(status)
        final = response_object(self.rid, self.created, self.echo, None, status)
        final["output"] = self.items
        final["usage"] = usage_object(usage_)
        final["incomplete_details"] = {"reason": "max_output_tokens"} if status == "incomplete" else None
        if self.keep is not None:
            self.keep(final)
        self._event("response.completed" if status == "completed" else "response.incomplete", response=final)
        await self._flush()
        await self.resp.write_eof()

    async def error(self, exc: BaseException) -> None:
        ref = self._failed(exc)
        err = ApiError(503, f"the engine failed while serving this request; retry it (reference {ref})", None,
                       "engine_failed", "server_error")
        self._event("error", code=err.code, message=err.message, param=None)
        self.failure = {"code": "server_error", "message": err.message}
        await self._flush()



class ResponsesShape(Shape):
    """A Responses request's chat choice (n = 1), answered as a response object or streamed as its events."""

    def __init__(self, tokenizer: Any, think_tags: Any, tool_choice: Optional[ToolChoice], echo: dict,
                 keep: Optional[Callable[[dict], None]] = None):
        """`keep`: stores the finished response object (`launch.responses.ResponsesRequest.keeper`)."""
        super().__init__(True, tokenizer, think_tags, tool_choice)
        self.echo, self.keep = echo, keep

    def writer(self, resp: web.StreamResponse, rid: str, greq: GenerationRequest, created: int,
               choices: list[ChoiceState]) -> ResponseEventWriter:
        return ResponseEventWriter(resp, rid, created, self.echo, lambda exc: log_failure("stream failed", exc),
                                   self.keep)

    def response(self, rid: str, model: str, created: int, choices: list[ChoiceState], n: int) -> dict:
        obj = response_object(rid, created, self.echo, super().response(rid, model, created, choices, n))
        if self.keep is not None:
            self.keep(obj)
        return obj
