"""`/v1/chat/completions`: messages through the checkpoint's chat template, and the chat shapes.

`messages`: a list of `{"role": "system" | "developer" (= system) | "user" | "assistant" | "tool", "content": str |
[{"type": "text", "text": str}, ...]}` (text parts are joined with newlines; an assistant message may have null
content, and `tool_calls`; a tool message needs `tool_call_id`: `launch.tools`). The prompt is
`tokenizer.apply_chat_template(messages, tools=..., add_generation_prompt=..., continue_final_message=...,
tokenize=True, **chat_template_kwargs)` (transformers; e.g. Qwen3's
`{"enable_thinking": false}`). `max_completion_tokens` (or `max_tokens`) defaults to what the
context leaves. `logprobs` (bool) / `top_logprobs` (0-20) return the chosen tokens' log-probabilities
and the most probable alternatives (`launch.logprobs`).
"""
from __future__ import annotations

import dataclasses

import math
import re
from typing import Any, Optional

from engine.errors import RequestError
from engine.sampling_params import LOGPROBS_MAX, check_bool, check_int
from launch.protocol import (ApiError, GenerationRequest, ParseContext, _unsupported, check_text, choices_usage,
                             parse_common, parse_max_tokens, parse_model, parse_n, parse_truncation,
                             require_object)
from launch.forced_tools import forced_tool_grammar
from launch.structured import parse_response_format
from launch.tools import parse_tool_choice, parse_tools, tool_message_fields

ROLES = ("system", "user", "assistant", "tool")
# Arguments of apply_chat_template (and names a template reads from its own context): never from a request.
_RESERVED_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "sanitize_control_tokens", "bos_token", "eos_token",
    "pad_token", "unk_token", "raise_exception", "strftime_now",
})
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
MAX_TEMPLATE_KWARGS = 16
MAX_TEMPLATE_KWARG_CHARS = 1024


def _content(msg: dict, i: int) -> str:
    c = msg.get("content")
    where = f"messages[{i}].content"
    if c is None:
        if msg.get("role") == "assistant":
            return ""
        raise RequestError(f"'{where}' is required", "messages", "missing")
    if isinstance(c, str):
        return c
    if isinstance(c, list):
        texts = []
        for part in c:
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise RequestError(f"'{where}' parts must be objects with a 'type'", "messages", "invalid_type")
            if part["type"] != "text":
                raise ApiError(400, f"'{where}' parts of type other than 'text' are not supported", "messages",
                               "unsupported")
            if not isinstance(part.get("text"), str):
                raise RequestError(f"'{where}' text parts need a string 'text'", "messages", "invalid_type")
            texts.append(part["text"])
        return "\n".join(texts)
    raise RequestError(f"'{where}' must be a string or a list of text parts", "messages", "invalid_type")


def parse_messages(v: Any, ctx: ParseContext) -> list[dict]:
    """Validated messages as `{"role", "content": str}` (only what the template needs)."""
    lim = ctx.limits
    if v is None:
        raise ApiError(400, "'messages' is required", "messages", "missing")
    if not isinstance(v, list) or not v:
        raise RequestError("'messages' must be a non-empty list of messages", "messages", "invalid_type")
    if len(v) > lim.max_messages:
        raise RequestError(f"'messages' may hold at most {lim.max_messages} messages", "messages", "invalid_value")
    out, chars = [], 0
    for i, msg in enumerate(v):
        if not isinstance(msg, dict):
            raise RequestError(f"'messages[{i}]' must be an object", "messages", "invalid_type")
        role = msg.get("role")
        if role == "developer":  # OpenAI's newer name for the system turn
            role = "system"
        if role not in ROLES:
            raise RequestError(f"'messages[{i}].role' must be one of {', '.join(ROLES)}", "messages",
                               "invalid_value")
        text = check_text(_content(msg, i), "messages")
        chars += len(text)
        if chars > lim.max_prompt_chars:
            raise RequestError(f"the messages may have at most {lim.max_prompt_chars} characters in all",
                               "messages", "invalid_value")
        out.append({"role": role, "content": text, **tool_message_fields(msg, i)})
    return out


def _template_kwargs(v: Any) -> dict:
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise RequestError("'chat_template_kwargs' must be an object", "chat_template_kwargs", "invalid_type")
    if len(v) > MAX_TEMPLATE_KWARGS:
        raise RequestError(f"'chat_template_kwargs' may hold at most {MAX_TEMPLATE_KWARGS} entries",
                           "chat_template_kwargs", "invalid_value")
    for k, x in v.items():
        if not _IDENT.fullmatch(k) or k in _RESERVED_KWARGS:
            raise RequestError("'chat_template_kwargs' keys must be identifiers other than the template's own "
                               "arguments", "chat_template_kwargs", "invalid_value")
        ok = x is None or isinstance(x, (bool, int)) or (isinstance(x, float) and math.isfinite(x)) \
            or (isinstance(x, str) and len(x) <= MAX_TEMPLATE_KWARG_CHARS
                and check_text(x, "chat_template_kwargs") is x)
        if not ok:
            raise RequestError("'chat_template_kwargs' values must be booleans, numbers, null or short strings",
                               "chat_template_kwargs", "invalid_type")
    return dict(v)


def render_chat(tokenizer: Any, messages: list[dict], add_generation_prompt: bool, continue_final: bool,
                kwargs: dict, tools: Optional[list[dict]] = None) -> list[int]:
    """Token ids of the conversation through the tokenizer's chat template (`tools` as the template's `tools`)."""
    import jinja2

    if tools is not None:
        kwargs = {**kwargs, "tools": tools}
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                            continue_final_message=continue_final, tokenize=True,
                                            return_dict=False, **kwargs)
    except jinja2.TemplateError as exc:  # includes the template's own raise_exception(...)
        raise ApiError(400, f"the chat template rejected the messages: {str(exc)[:300]}", "messages",
                       "template_error") from None
    except ValueError as exc:  # e.g. continue_final_message on a template that cannot
        raise ApiError(400, f"the chat template could not render the messages: {str(exc)[:300]}", "messages",
                       "template_error") from None
    if hasattr(ids, "keys"):  # a BatchEncoding (transformers >= 5 when return_dict is ignored)
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def chat_prompt(body: dict, ctx: ParseContext, tools: Optional[list[dict]]) -> list[int]:
    """The conversation's token ids: the request's `messages` through the chat template, with its
    `add_generation_prompt` (default true), `continue_final_message` and `chat_template_kwargs`, and `tools` (parsed
    by the caller). Shared by chat completions and `/tokenize`, so both count the same tokens."""
    messages = parse_messages(body.get("messages"), ctx)
    add_gen = body.get("add_generation_prompt")
    add_gen = True if add_gen is None else check_bool("add_generation_prompt", add_gen)
    cont = body.get("continue_final_message")
    cont = False if cont is None else check_bool("continue_final_message", cont)
    if add_gen and cont:
        raise RequestError("'continue_final_message' needs 'add_generation_prompt': false", "continue_final_message",
                           "invalid_value")
    kwargs = _template_kwargs(body.get("chat_template_kwargs"))
    tok = ctx.tokenizer
    if tok is None:
        raise ApiError(400, "this model has no tokenizer: chat completions need one (use /v1/completions with "
                            "token ids)", "messages", "no_tokenizer")
    if not getattr(tok, "chat_template", None):
        raise ApiError(400, "this model's tokenizer has no chat template: use /v1/completions", "messages",
                       "no_chat_template")
    return render_chat(tok, messages, add_gen, cont, kwargs, tools)


def parse_chat_request(body: Any, ctx: ParseContext) -> GenerationRequest:
    body = require_object(body)
    parse_model(body, ctx)
    n = parse_n(body)
    _unsupported(body, "functions", ([],), "(the deprecated form of 'tools')")
    tools = parse_tools(body.get("tools"))
    tool_choice = parse_tool_choice(body.get("tool_choice"), tools, body.get("parallel_tool_calls"))
    if tool_choice.mode == "auto" and ctx.tool_call_parser is None:
        raise ApiError(400, "'tool_choice' \"auto\" (the default with 'tools') needs the server started with "
                            "--tool-call-parser hermes; send \"tool_choice\": \"none\" to pass the tools to the "
                            "template only", "tool_choice", "unsupported")
    lp = body.get("logprobs")
    want = False if lp is None else check_bool("logprobs", lp)
    top = body.get("top_logprobs")
    top_n = None if top is None else check_int("top_logprobs", top, 0, LOGPROBS_MAX)
    if top_n is not None and not want:
        raise RequestError("'top_logprobs' needs 'logprobs': true", "top_logprobs", "invalid_value")
    prompt = chat_prompt(body, ctx, tools)
    keep = parse_truncation(body, ctx)
    prompt = prompt[-keep:] if keep else prompt
    if len(prompt) >= ctx.max_model_len:
        raise RequestError(f"the messages have {len(prompt)} tokens; this model's maximum context length is "
                           f"{ctx.max_model_len} tokens (prompt + at least one new token)", "messages",
                           "context_length_exceeded")
    max_tokens = parse_max_tokens(body, ("max_completion_tokens", "max_tokens"), ctx.defaults.max_tokens, [prompt],
                                  ctx)
    greq = parse_common(body, ctx, [prompt], (top_n or 0) if want else None, max_tokens, n,
                        ("max_completion_tokens", "max_tokens"), chat=True)
    greq.tool_choice = tool_choice
    greq.grammar = parse_response_format(body, ctx.grammars)
    if tool_choice.forced:
        if greq.grammar is not None:
            raise RequestError("'tool_choice' \"required\" or a named function cannot be combined with "
                               "'response_format' or 'structured_outputs'", "tool_choice", "invalid_value")
        greq.grammar = forced_tool_grammar(tool_choice, tools, ctx.grammars)
    prefix = _echo_prefix(body)
    if prefix:
        greq.text = dataclasses.replace(greq.text, chat_echo=prefix)
    return greq


def _echo_prefix(body: dict) -> str:
    """vLLM's chat `echo`: the answer starts with the last message's text when that message has the answer's role
    (the assistant's with `add_generation_prompt`, else the last message's own: a continuation); "" otherwise. The
    messages were validated by `chat_prompt`."""
    v = body.get("echo")
    if v is None or not check_bool("echo", v):
        return ""
    last = body["messages"][-1]
    add_gen = body.get("add_generation_prompt") is not False
    if add_gen and last.get("role") != "assistant":
        return ""
    content = last.get("content")
    if isinstance(content, list):
        content = "\n".join(part.get("text", "") for part in content if isinstance(part, dict))
    return content if isinstance(content, str) else ""


# ---- shapes
def chat_response(rid: str, model: str, created: int, choices: list, logprobs: Optional[list] = None,
                  reasoning: bool = False, tools: Optional[list] = None) -> dict:
    """choices: the finished `launch.outputs.ChoiceState`s (the n samples of the conversation); logprobs: their
    `{"content": [...]}` objects (None: not asked); reasoning: a reasoning parser serves (every message carries
    `reasoning_content`, null when the choice did not reason, and usage the think block's token count); tools:
    per choice (content, tool calls, finish reason) as `launch.generation.Shape` answers them (None: tool calls are
    not parsed)."""
    lps = logprobs or [None] * len(choices)
    usage = choices_usage(choices, len(choices))
    if reasoning:
        usage["completion_tokens_details"] = {"reasoning_tokens": sum(c.reasoning_tokens for c in choices)}
    out = []
    for c, lp, tool in zip(choices, lps, tools or [None] * len(choices)):
        content, calls, reason = (c.text, [], c.finish_reason) if tool is None else tool
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        if reasoning:
            msg["reasoning_content"] = c.reasoning_text
        if calls:
            msg["tool_calls"] = calls
        out.append({"index": c.index, "message": msg, "logprobs": lp, "finish_reason": reason})
    return {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": out,
            "usage": usage}


def chat_delta(index: int, content: Optional[str], finish_reason: Optional[str], first: bool = False,
               logprobs: Optional[dict] = None, reasoning: Optional[str] = None,
               tool_calls: Optional[list] = None) -> dict:
    """One streamed chat choice: the first carries the role; the last the finish reason (and an empty delta
    when it brings no text); `reasoning`: text of the think block (`delta.reasoning_content`); `tool_calls`: the
    calls completed since the last delta, each with its `index` among the choice's calls."""
    delta: dict[str, Any] = {"role": "assistant", "content": content or ""} if first else \
        ({} if not content else {"content": content})
    if reasoning:
        delta["reasoning_content"] = reasoning
    if tool_calls:
        delta["tool_calls"] = tool_calls
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


class ChatTemplateError(ValueError):
    """`graphline serve --chat-template` names no usable template."""


def set_chat_template(tokenizer: Any, value: str) -> str:
    """`--chat-template`: `value` is a file holding a Jinja chat template, or the template's text itself (as vLLM
    takes it); it replaces the tokenizer's own. Rendered once on a probe conversation so a broken template fails at
    start-up. Returns where it came from ("file PATH" or "inline")."""
    from pathlib import Path

    import jinja2

    if tokenizer is None:
        raise ChatTemplateError("--chat-template needs a tokenizer: serve a checkpoint directory that has one")
    path = Path(value)
    try:
        is_file = len(value) < 4096 and path.is_file()
    except OSError:
        is_file = False
    text, where = (path.read_text(encoding="utf-8"), f"file {path}") if is_file else (value, "inline")
    if "{" not in text:
        raise ChatTemplateError(f"--chat-template {value[:80]!r} is neither a file nor a Jinja template")
    old = getattr(tokenizer, "chat_template", None)
    tokenizer.chat_template = text
    try:
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                      tokenize=False)
    except (jinja2.TemplateError, ValueError, TypeError) as exc:
        tokenizer.chat_template = old
        raise ChatTemplateError(f"--chat-template ({where}) does not render a conversation: {str(exc)[:300]}") from None
    return where
