"""Tool calling in chat completions (`graphline serve --tool-call-parser hermes`), as vLLM's and SGLang's `hermes`
parser serve Qwen3 and other Hermes-format models.

Request side (`parse_tools`, `parse_tool_choice`, `tool_message_fields`): `tools` is a list of
`{"type": "function", "function": {"name", "description"?, "parameters"? (a JSON schema object)}}`, handed to the
chat template as `tools=`; `tool_choice` is "auto" (the default with tools), "none" (the template still sees the
tools; nothing is parsed), "required" or a named function `{"type": "function", "function": {"name": ...}}` (both
forced through a grammar: `launch.forced_tools`); `parallel_tool_calls: false` allows one call per choice. Messages
may carry the turns of an earlier call: an assistant message's `tool_calls` and `tool` messages (`tool_call_id`,
`content`), passed to the template as given.

Response side: a choice's content text is scanned for `<tool_call>` JSON `</tool_call>` blocks, each holding
`{"name": str, "arguments": object}`. Every well-formed block becomes a `tool_calls` entry (`arguments` serialised
as a JSON string, as OpenAI sends it) and leaves the content; a block whose JSON does not parse stays content. With
calls, the content is the text around the blocks, stripped (null when empty), and a choice that stopped has
`finish_reason` "tool_calls". `ToolCallStream` does the same on streamed text: text that may begin a block is held
back, a call goes out whole once its block closes, and whitespace next to blocks is sent only if no call comes, so
a stream's deltas join to the answer of the same request unstreamed.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Optional

from engine.errors import RequestError

TOOL_CALL_PARSERS = ("hermes",)
OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_TOOLS = 128
MAX_TOOLS_JSON_CHARS = 256 * 1024
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.S)


def parse_tools(v: Any) -> Optional[list[dict]]:
    """The request's `tools` as the template takes them (None: no tools)."""
    if v is None or v == []:
        return None
    if not isinstance(v, list) or len(v) > MAX_TOOLS:
        raise RequestError(f"'tools' must be a list of at most {MAX_TOOLS} tools", "tools", "invalid_type")
    out = []
    for i, t in enumerate(v):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            raise RequestError(f"'tools[{i}]' must be {{\"type\": \"function\", \"function\": {{...}}}}", "tools",
                               "invalid_type")
        if not isinstance(fn.get("name"), str) or not _NAME.fullmatch(fn["name"]):
            raise RequestError(f"'tools[{i}].function.name' must be 1-64 letters, digits, '_', '.' or '-'", "tools",
                               "invalid_value")
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise RequestError(f"'tools[{i}].function.description' must be a string", "tools", "invalid_type")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise RequestError(f"'tools[{i}].function.parameters' must be a JSON schema object", "tools",
                               "invalid_type")
        out.append({"type": "function", "function": {k: fn[k] for k in ("name", "description", "parameters")
                                                     if fn.get(k) is not None}})
    if len(json.dumps(out)) > MAX_TOOLS_JSON_CHARS:
        raise RequestError(f"'tools' may take at most {MAX_TOOLS_JSON_CHARS} characters as JSON", "tools",
                           "invalid_value")
    return out


@dataclass(frozen=True)
class ToolChoice:
    """A chat request's `tool_choice` and `parallel_tool_calls`, parsed."""

    mode: str  # "none" | "auto" (calls parsed from the text) | "required" | "function" (forced by a grammar)
    name: Optional[str] = None  # mode "function": the tool every choice calls
    parallel: bool = True  # False: at most one call per choice

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "function")


def parse_tool_choice(v: Any, tools: Optional[list[dict]], parallel: Any = None) -> ToolChoice:
    """`tool_choice` (default: "auto" with tools, else "none") with `parallel_tool_calls` (default true)."""
    if parallel is not None and not isinstance(parallel, bool):
        raise RequestError("'parallel_tool_calls' must be a boolean", "parallel_tool_calls", "invalid_type")
    par = parallel is not False
    if v is None:
        return ToolChoice("auto" if tools else "none", parallel=par)
    if v in ("auto", "required") and not tools:
        raise RequestError(f"'tool_choice' \"{v}\" needs 'tools'", "tool_choice", "invalid_value")
    if v in ("none", "auto", "required"):
        return ToolChoice(v, parallel=par)
    fn = v.get("function") if isinstance(v, dict) else None
    if not isinstance(fn, dict) or v.get("type") != "function" or not isinstance(fn.get("name"), str):
        raise RequestError("'tool_choice' must be \"auto\", \"none\", \"required\" or {\"type\": \"function\", "
                           "\"function\": {\"name\": ...}}", "tool_choice", "invalid_value")
    if fn["name"] not in {t["function"]["name"] for t in tools or ()}:
        raise RequestError(f"'tool_choice.function.name' {fn['name'][:64]!r} is not one of 'tools'", "tool_choice",
                           "invalid_value")
    return ToolChoice("function", fn["name"], par)


def tool_message_fields(msg: dict, i: int) -> dict:
    """The tool-call fields of message i for the template: an assistant's `tool_calls`, a tool's `tool_call_id`."""
    where = f"messages[{i}]"
    if msg.get("role") == "tool":
        if not isinstance(msg.get("tool_call_id"), str):
            raise RequestError(f"'{where}.tool_call_id' is required (a string) for a tool message", "messages",
                               "missing")
        return {"tool_call_id": msg["tool_call_id"]}
    calls = msg.get("tool_calls")
    if calls is None:
        return {}
    if msg.get("role") != "assistant" or not isinstance(calls, list) or len(calls) > MAX_TOOLS:
        raise RequestError(f"'{where}.tool_calls' must be a list on an assistant message", "messages", "invalid_type")
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments"), str):
            raise RequestError(f"'{where}.tool_calls[{j}]' needs function.name and function.arguments (strings)",
                               "messages", "invalid_type")
        out.append({"id": str(c.get("id", "")), "type": "function",
                    "function": {"name": fn["name"], "arguments": fn["arguments"]}})
    return {"tool_calls": out}


def _call(block: str) -> Optional[dict]:
    """A `tool_calls` entry of one block's JSON, or None when it is not `{"name": str, "arguments": object}`."""
    try:
        obj = json.loads(block)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", {})
    if not isinstance(args, dict):
        return None
    return tool_call(obj["name"], json.dumps(args, ensure_ascii=False))


def tool_call(name: str, arguments: str) -> dict:
    """A `tool_calls` entry with a fresh id; `arguments`: the JSON text of the call's arguments."""
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def extract_tool_calls(text: str) -> tuple[Optional[str], list[dict]]:
    """(content, tool calls) of a whole choice's text: the text outside the well-formed blocks, stripped (None when
    empty and there are calls)."""
    calls, parts, pos = [], [], 0
    for m in _BLOCK.finditer(text):
        call = _call(m.group(1))
        if call is None:
            continue
        calls.append(call)
        parts.append(text[pos:m.start()])
        pos = m.end()
    parts.append(text[pos:])
    content = "".join(parts).strip()
    return (content or None) if calls else content, calls


class ToolCallStream:
    """The streamed counterpart of `extract_tool_calls` for one choice: `push(text)` -> (content to send, calls
    completed), `finish()` -> the content still held at the end. The content sent joins to `extract_tool_calls`'s:
    leading whitespace is dropped, and whitespace after text is held until more text follows."""

    __slots__ = ("_buf", "_inside", "_ws", "_started", "calls")

    def __init__(self) -> None:
        self._buf = ""  # outside a block: a possible start of OPEN; inside: the block's text so far
        self._inside = False
        self._ws = ""  # whitespace after the last text sent
        self._started = False  # some content text was sent
        self.calls: list[dict] = []

    def push(self, text: str) -> tuple[str, list[dict]]:
        if not self._inside and not self._buf and "<" not in text:  # the common token: plain text
            return self._text(text), []
        out, new = [], []
        buf = self._buf + text
        while True:
            if self._inside:
                end = buf.find(CLOSE)
                if end < 0:
                    break
                block, buf = buf[:end], buf[end + len(CLOSE):]
                self._inside = False
                call = _call(block)
                if call is None:
                    out.append(self._text(OPEN + block + CLOSE))
                else:
                    new.append(call)
                continue
            start = buf.find(OPEN)
            if start >= 0:
                out.append(self._text(buf[:start]))
                buf, self._inside = buf[start + len(OPEN):], True
                continue
            keep = _partial_open(buf)
            out.append(self._text(buf[:len(buf) - keep]))
            buf = buf[len(buf) - keep:]
            break
        self._buf = buf
        self.calls.extend(new)
        return "".join(out), new

    def finish(self) -> str:
        """An unclosed block or a partial tag, as text; trailing whitespace is dropped."""
        rest = OPEN + self._buf if self._inside else self._buf
        self._buf, self._inside = "", False
        return self._text(rest)

    def _text(self, text: str) -> str:
        body = text.rstrip()
        if not body:
            if self._started:
                self._ws += text
            return ""
        tail = text[len(body):]
        if self._started:
            body = self._ws + body
        else:
            body, self._started = body.lstrip(), True
        self._ws = tail
        return body


def _partial_open(text: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of OPEN."""
    for k in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-k:]):
            return k
    return 0
