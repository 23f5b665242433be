"""Forced tool calls: `tool_choice` "required" or a named function, decoded under a JSON-schema grammar
(`launch.structured`), as vLLM serves them; no tool-call parser is needed.

- A named function `{"type": "function", "function": {"name": N}}`: a choice's text is the call's arguments, JSON
  that N's `parameters` schema accepts (any object when it has none). The answer is one call of N whose `arguments`
  are that text as generated; the content is null and the finish reason is the choice's own ("stop", as OpenAI
  answers a named choice). Streamed, the first delta opens the call (id, name) and every later one carries the next
  piece of its arguments, so the pieces join to the unstreamed arguments.
- "required": the text is a JSON array of `{"name": N, "arguments": {...}}`, one or more (exactly one with
  `parallel_tool_calls: false`), N one of the tools and the arguments what its schema accepts. Every element is a
  call (arguments re-serialised, as the hermes parser sends them); the content is null, and a choice that stopped
  has finish reason "tool_calls". Streamed, a call goes out whole once its element closes. A choice cut short
  ("length") returns the calls completed before the cut.

The JSON is laid out with `", "` and `": "` and no other whitespace (as Hermes-format chat templates show calls), so
a call cannot run on in blank space. A tool's `$defs` are lifted to the array's root, where its `$ref`s point.
"""
from __future__ import annotations

import json
from typing import Optional

from engine.errors import RequestError
from engine.grammar import TokenGrammar
from launch.structured import GrammarCompiler
from launch.tools import ToolChoice, tool_call

LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_OBJECT = {"type": "object"}
_DECODER = json.JSONDecoder()
_BETWEEN = " \t\r\n[,"  # what may precede an element of the "required" array


def _parameters(tools: list[dict], name: str) -> dict:
    return next(t["function"].get("parameters") or ANY_OBJECT for t in tools if t["function"]["name"] == name)


def required_schema(tools: list[dict], parallel: bool) -> dict:
    """The JSON schema of a "required" choice's text: an array of calls of `tools` (`launch.tools.parse_tools`)."""
    defs: dict = {}
    items = []
    for t in tools:
        params = dict(t["function"].get("parameters") or ANY_OBJECT)
        for k, v in (params.pop("$defs", None) or {}).items():
            if defs.setdefault(k, v) != v:
                raise RequestError(f"'tools' define '$defs.{k}' differently in two functions; "
                                   "tool_choice \"required\" needs them to agree", "tools", "invalid_value")
        items.append({"type": "object", "properties": {"name": {"const": t["function"]["name"]}, "arguments": params},
                      "required": ["name", "arguments"], "additionalProperties": False})
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}, "x-guidance": LAYOUT}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def forced_tool_grammar(choice: ToolChoice, tools: Optional[list[dict]],
                        compiler: Optional[GrammarCompiler]) -> Optional[TokenGrammar]:
    """The grammar every choice of a forced `tool_choice` obeys (None: not forced). A schema llguidance cannot take
    is a 400 naming `tools`."""
    if not choice.forced:
        return None
    if compiler is None:
        raise RequestError(f"this model has no tokenizer: 'tool_choice' {choice.mode!r} needs one", "tool_choice",
                           "no_tokenizer")
    assert tools  # parse_tool_choice: a forced choice has tools
    if choice.mode == "function":
        params = _parameters(tools, choice.name)
        return compiler.json_schema({**params, "x-guidance": params.get("x-guidance", LAYOUT)}, "tool_function",
                                    "tools")
    return compiler.json_schema(required_schema(tools, choice.parallel), "tool_required", "tools")


class ForcedCallStream:
    """One choice's text under a forced `tool_choice`, turned into tool calls as it arrives: `push(text)` -> the
    `delta.tool_calls` entries to send now (each with its `index`); `calls`: the calls so far, whole."""

    __slots__ = ("choice", "calls", "_buf", "_pos")

    def __init__(self, choice: ToolChoice):
        self.choice = choice
        self.calls: list[dict] = []
        self._buf = ""  # "required": the text so far; `_pos`: where the next element may start
        self._pos = 0

    def push(self, text: str) -> list[dict]:
        if self.choice.mode == "function":
            if not self.calls:
                call = tool_call(self.choice.name, text)
                self.calls.append(call)
                return [{"index": 0, **call, "function": dict(call["function"])}]  # the call's arguments grow
            if not text:
                return []
            self.calls[0]["function"]["arguments"] += text
            return [{"index": 0, "function": {"arguments": text}}]
        self._buf += text
        out = []
        while self.choice.parallel or not self.calls:  # the grammar allows one call then; so does the answer
            start = self._pos
            while start < len(self._buf) and self._buf[start] in _BETWEEN:
                start += 1
            try:
                obj, self._pos = _DECODER.raw_decode(self._buf, start)
            except ValueError:  # the element is not closed yet (or the text is not the grammar's)
                return out
            if isinstance(obj, dict) and isinstance(obj.get("name"), str) and isinstance(obj.get("arguments"), dict):
                self.calls.append(tool_call(obj["name"], json.dumps(obj["arguments"], ensure_ascii=False)))
                out.append({"index": len(self.calls) - 1, **self.calls[-1]})
        return out

    def finish_reason(self, reason: Optional[str]) -> Optional[str]:
        """The choice's finish reason as answered: "tool_calls" for a "required" choice that stopped with calls."""
        return "tool_calls" if reason == "stop" and self.choice.mode == "required" and self.calls else reason


def forced_answer(text: str, reason: Optional[str], choice: ToolChoice) -> tuple[None, list[dict], Optional[str]]:
    """(content, tool calls, finish reason) of a whole choice's text under a forced `tool_choice`."""
    st = ForcedCallStream(choice)
    st.push(text)
    return None, st.calls, st.finish_reason(reason)
