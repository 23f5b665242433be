"""`POST /v1/responses`: OpenAI's Responses API, served by the chat path (`launch.chat`) it is translated to.

Request: `input` (a string: one user message; or a list of items: messages `{"role": "user" | "system" |
"developer" | "assistant", "content": str | [{"type": "input_text" | "output_text", "text"}]}` with or without
`"type": "message"`, `{"type": "function_call", "call_id", "name", "arguments"}` (an earlier call: consecutive
calls are one assistant turn) and `{"type": "function_call_output", "call_id", "output"}` (its result); reasoning
items are dropped), `instructions` (a system message first), `max_output_tokens`, `temperature`, `top_p`, `stream`,
`tools` (`[{"type": "function", "name", "description"?, "parameters"?}]`), `tool_choice` ("auto", "none",
"required" or `{"type": "function", "name"}`), `parallel_tool_calls`, `text.format` (`{"type": "text" |
"json_object"}` or `{"type": "json_schema", "name", "schema", "strict"?}`) and the vLLM sampling extras chat takes
(`seed`, `top_k`, `min_p`, penalties, `stop`, `stop_token_ids`, `ignore_eos`, `min_tokens`, `logit_bias`,
`chat_template_kwargs`, `structured_outputs`). With `--responses-store N` (`launch.responses_store`) a response is
kept unless `store` is false, and `previous_response_id` continues a kept one's conversation (its `instructions` are
not carried over); without it, `previous_response_id` is a 400. `truncation: "auto"` drops the oldest input turns
while the conversation overflows the context. `background: true` (with a store) answers at once with the response
`in_progress` and generates it in the server (`launch.responses_background`). `conversation` is a 400 naming it;
`include: ["message.output_text.logprobs"]` or `top_logprobs` (0-20) return the output text's token logprobs (chat's
entries; streamed with each text delta); `metadata`, `user`, other `include` values and `reasoning` are taken and not
acted on. An error of the translated request names the Responses field (`input`, `max_output_tokens`, `text.format`,
...).

Response (`response_object`): `{"id": "resp_...", "object": "response", "status": "completed" | "incomplete",
"incomplete_details": {"reason": "max_output_tokens"} | null, "output": [...], "usage": {...}, ...}`, the output
items in order: a `reasoning` item (`content: [{"type": "reasoning_text", "text"}]`, with `--reasoning-parser`),
a `message` item (`content: [{"type": "output_text", "text", "annotations": []}]`; left out when the answer is only
tool calls) and one `function_call` item per call (`call_id`, `name`, `arguments`). Streamed: `launch.responses_stream`.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Callable, Optional

from engine.errors import RequestError
from launch.chat import parse_chat_request
from launch.protocol import ApiError, GenerationRequest, ParseContext, parse_model, require_object
from launch.responses_store import answer_messages

# chat fields a Responses request sets under the same name
PASSED = ("model", "stream", "temperature", "top_p", "parallel_tool_calls", "seed", "top_k", "min_p",
          "presence_penalty", "frequency_penalty", "repetition_penalty", "stop", "stop_token_ids", "ignore_eos",
          "min_tokens", "logit_bias", "chat_template_kwargs", "structured_outputs", "priority")
# chat's names for Responses fields, in error messages and `param`s
RENAMED = (("messages", "input"), ("max_completion_tokens", "max_output_tokens"), ("response_format", "text.format"))
TEXT_PARTS = ("input_text", "output_text", "text")
ROLES = ("user", "system", "developer", "assistant")


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _content(v: Any, where: str) -> str:
    if isinstance(v, str):
        return v
    if not isinstance(v, list):
        raise RequestError(f"'{where}' must be a string or a list of input_text parts", "input", "invalid_type")
    texts = []
    for j, part in enumerate(v):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS:
            raise ApiError(400, f"'{where}[{j}]' must be an input_text part; {str(kind)[:40]!r} parts are not "
                                "supported", "input", "unsupported")
        if not isinstance(part.get("text"), str):
            raise RequestError(f"'{where}[{j}].text' must be a string", "input", "invalid_type")
        texts.append(part["text"])
    return "\n".join(texts)


def instruction_messages(instructions: Any) -> list[dict]:
    if instructions is None:
        return []
    if not isinstance(instructions, str):
        raise RequestError("'instructions' must be a string", "instructions", "invalid_type")
    return [{"role": "system", "content": instructions}]


def input_messages(items: Any) -> list[dict]:
    """Chat messages of `input` (each problem a 400 naming `input`)."""
    out: list[dict] = []
    if isinstance(items, str):
        return out + [{"role": "user", "content": items}]
    if items is None:
        raise ApiError(400, "'input' is required", "input", "missing")
    if not isinstance(items, list) or not items:
        raise RequestError("'input' must be a string or a non-empty list of items", "input", "invalid_type")
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise RequestError(f"'{where}' must be an object", "input", "invalid_type")
        kind = item.get("type", "message")
        if kind == "message":
            if item.get("role") not in ROLES:
                raise RequestError(f"'{where}.role' must be one of {', '.join(ROLES)}", "input", "invalid_value")
            out.append({"role": item["role"], "content": _content(item.get("content"), where + ".content")})
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise RequestError(f"'{where}' needs call_id, name and arguments (strings)", "input", "invalid_type")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") and not out[-1]["content"]:
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise RequestError(f"'{where}.call_id' must be a string", "input", "invalid_type")
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": _content(item.get("output"), where + ".output")})
        elif kind != "reasoning":
            raise ApiError(400, f"'{where}.type' {str(kind)[:40]!r} is not supported", "input", "unsupported")
    return out


def _tools(v: Any) -> Any:
    """Responses tools (`{"type": "function", "name", ...}`) in chat's form; anything else as given (chat says what
    is wrong with it)."""
    if not isinstance(v, list):
        return v
    out = []
    for i, t in enumerate(v):
        if isinstance(t, dict) and t.get("type") not in (None, "function"):
            raise ApiError(400, f"'tools[{i}].type' {str(t['type'])[:40]!r} is not supported: only function tools",
                           "tools", "unsupported")
        if isinstance(t, dict) and "function" not in t:
            t = {"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters") if k in t}}
        out.append(t)
    return out


def _tool_choice(v: Any) -> Any:
    if isinstance(v, dict) and v.get("type") == "function" and "function" not in v:
        return {"type": "function", "function": {"name": v.get("name")}}
    return v


def _text_format(text: Any) -> Any:
    """`text.format` as chat's `response_format`."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise RequestError("'text' must be an object such as {\"format\": {\"type\": \"text\"}}", "text",
                           "invalid_type")
    fmt = text.get("format")
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}
    return fmt


LOGPROBS_INCLUDE = "message.output_text.logprobs"


def _wants_logprobs(body: dict) -> bool:
    """`include` names the output text's logprobs, or `top_logprobs` is set (0-20; chat checks it)."""
    include = body.get("include")
    if include is not None and not (isinstance(include, list) and all(isinstance(x, str) for x in include)):
        raise RequestError("'include' must be a list of strings", "include", "invalid_type")
    return LOGPROBS_INCLUDE in (include or ()) or body.get("top_logprobs") is not None


def _refuse(body: dict, key: str, allowed: tuple, why: str) -> None:
    if body.get(key) not in allowed:
        raise ApiError(400, f"'{key}' is not supported: {why}", key, "unsupported")


def _renamed(exc: Exception) -> Exception:
    """A chat-side error of the translated request, naming the Responses field instead."""
    param, message = exc.param, str(exc.message if isinstance(exc, ApiError) else exc)
    for chat, resp in RENAMED:
        message = message.replace(f"'{chat}", f"'{resp}").replace(f"the {chat}", f"the {resp}")
        if param is not None and (param == chat or param.startswith(chat + ".")):
            param = resp + param[len(chat):]
    if isinstance(exc, ApiError):
        return ApiError(exc.status, message, param, exc.code, exc.type)
    return RequestError(message, param, exc.code)


@dataclass
class ResponsesRequest:
    """A parsed `/v1/responses` request: the chat request answering it (one choice), the fields the response object
    repeats, and its conversation (earlier turns and the input, as chat messages) when it is to be stored."""

    greq: GenerationRequest
    echo: dict
    conversation: Optional[list[dict]]

    def keeper(self, store: Any) -> Optional[Callable[[dict], None]]:
        """What stores the finished response object (None: nothing is stored)."""
        if store is None or self.conversation is None:
            return None
        conv = self.conversation
        return lambda obj: store.put(obj, conv + answer_messages(obj["output"]))


def _earlier_turns(body: dict, ctx: ParseContext) -> list[dict]:
    prev = body.get("previous_response_id")
    if prev is None:
        return []
    if ctx.responses is None:
        raise ApiError(400, "'previous_response_id' needs stored responses: start the server with "
                            "--responses-store N, or send the whole conversation in 'input'", "previous_response_id",
                       "unsupported")
    hit = ctx.responses.get(prev) if isinstance(prev, str) else None
    if hit is None:
        raise ApiError(404, f"no stored response {str(prev)[:80]!r} (kept: the last {ctx.responses.capacity})",
                       "previous_response_id", "response_not_found")
    return hit[1]


def parse_responses_request(body: Any, ctx: ParseContext) -> ResponsesRequest:
    body = require_object(body)
    model = parse_model(body, ctx)
    _refuse(body, "conversation", (None,), "send the conversation in 'input' or use 'previous_response_id'")
    background = body.get("background")
    if background is not None and not isinstance(background, bool):
        raise RequestError("'background' must be a boolean", "background", "invalid_type")
    if background and (ctx.responses is None or body.get("store") is False or body.get("stream")):
        raise ApiError(400, "'background': true needs a stored, unstreamed response (graphline serve "
                            "--responses-store N, no 'store': false, no 'stream')", "background", "unsupported")
    _refuse(body, "truncation", (None, "disabled", "auto"), "only \"disabled\" or \"auto\"")
    store = body.get("store")
    if store is not None and not isinstance(store, bool):
        raise RequestError("'store' must be a boolean", "store", "invalid_type")
    turns = _earlier_turns(body, ctx) + input_messages(body.get("input"))
    chat = {k: body[k] for k in PASSED if body.get(k) is not None}
    if _wants_logprobs(body):
        chat.update(logprobs=True, top_logprobs=body.get("top_logprobs") or 0)
    system, auto = instruction_messages(body.get("instructions")), body.get("truncation") == "auto"
    chat.update(messages=system + turns, tools=_tools(body.get("tools")),
                tool_choice=_tool_choice(body.get("tool_choice")), response_format=_text_format(body.get("text")),
                max_completion_tokens=body.get("max_output_tokens"))
    while True:
        try:
            greq = parse_chat_request({k: v for k, v in chat.items() if v is not None}, ctx)
            if not (auto and len(turns) > 1 and greq.max_tokens_given
                    and len(greq.prompts[0]) + greq.max_tokens[0] > ctx.max_model_len):
                break
        except (RequestError, ApiError) as exc:
            # `truncation: "auto"`: drop the oldest turns (a tool result never leads) while the context overflows
            if not auto or getattr(exc, "code", None) != "context_length_exceeded" or len(turns) < 2:
                raise _renamed(exc) from None
        turns = turns[1:]
        while len(turns) > 1 and turns[0].get("role") == "tool":
            turns = turns[1:]
        chat["messages"] = system + turns
    stored = ctx.responses is not None and store is not False
    echo = {"model": model, "instructions": body.get("instructions"), "store": stored,
            "previous_response_id": body.get("previous_response_id"),
            "max_output_tokens": body.get("max_output_tokens"), "temperature": greq.sampling.temperature,
            "top_p": greq.sampling.top_p, "tools": body.get("tools") or [],
            "tool_choice": body.get("tool_choice") or ("auto" if body.get("tools") else "none"),
            "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
            "text": body.get("text") or {"format": {"type": "text"}}, "metadata": body.get("metadata") or {},
            "reasoning": body.get("reasoning"), "user": body.get("user"),
            "truncation": "auto" if body.get("truncation") == "auto" else "disabled", "background": bool(background)}
    return ResponsesRequest(greq, echo, turns if stored else None)


def response_object(rid: str, created: int, echo: dict, answer: Optional[dict], status: str = "completed") -> dict:
    """The Responses object of one chat answer (`launch.chat.chat_response`'s, n = 1; None: nothing yet, as the
    stream's opening events carry it)."""
    output: list[dict] = []
    usage = details = None
    if answer is not None:
        ch, u = answer["choices"][0], answer["usage"]
        msg = ch["message"]
        status = "incomplete" if ch["finish_reason"] == "length" else status
        if msg.get("reasoning_content") is not None:
            output.append(reasoning_item(new_id("rs"), msg["reasoning_content"]))
        if msg["content"] or not msg.get("tool_calls"):
            output.append(message_item(new_id("msg"), msg["content"] or "", status))
            output[-1]["content"][0]["logprobs"] = (ch.get("logprobs") or {}).get("content") or []
        output += [function_call_item(new_id("fc"), c) for c in msg.get("tool_calls") or []]
        usage = usage_object(u)
        details = {"reason": "max_output_tokens"} if status == "incomplete" else None
    return {"id": rid, "object": "response", "created_at": created, "status": status, "error": None,
            "incomplete_details": details, "output": output, "usage": usage, **echo}


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict:
    return {"type": "reasoning", "id": item_id, "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def output_text(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: Optional[str], status: str = "completed") -> dict:
    """An assistant message item; `text` None: not started (no content part yet)."""
    return {"type": "message", "id": item_id, "role": "assistant", "status": status,
            "content": [] if text is None else [output_text(text)]}


def function_call_item(item_id: str, call: dict, status: str = "completed") -> dict:
    """A function_call item of a chat `tool_calls` entry."""
    return {"type": "function_call", "id": item_id, "call_id": call["id"], "name": call["function"]["name"],
            "arguments": call["function"]["arguments"], "status": status}


def usage_object(u: dict) -> dict:
    """The Responses usage of a chat usage object."""
    return {"input_tokens": u["prompt_tokens"], "input_tokens_details": u["prompt_tokens_details"],
            "output_tokens": u["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": u.get("completion_tokens_details", {}).get(
                "reasoning_tokens", 0)}, "total_tokens": u["total_tokens"]}
