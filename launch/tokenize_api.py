"""`POST /tokenize` and `POST /detokenize` (vLLM's routes): the served tokenizer, for clients that count or inspect
tokens before they send a request.

- `/tokenize`: `{"model"?, "prompt": str, "add_special_tokens"?: bool (true)}` -> the ids `/v1/completions` would get
  for that text prompt; or `{"model"?, "messages": [...], "add_generation_prompt"?, "continue_final_message"?,
  "chat_template_kwargs"?, "tools"?}` -> the ids `/v1/chat/completions` would get (`launch.chat.chat_prompt`).
  Response `{"count": n, "max_model_len": L, "tokens": [ids]}`: a prompt longer than the context is counted, not
  refused, so the client can compare.
- `/detokenize`: `{"model"?, "tokens": [ids in [0, vocab)]}` -> `{"prompt": text}` (`tokenizer.decode`).

Both need a tokenizer (400 `no_tokenizer` otherwise) and parse off the event loop for large bodies like the
completions (`launch.server._parse`); a bad field is a 400 naming it. With an API key they need it too.
"""
from __future__ import annotations

from typing import Any

from engine.errors import RequestError
from engine.sampling_params import check_bool
from launch.chat import chat_prompt
from launch.protocol import ApiError, ParseContext, check_text, parse_model, require_object
from launch.tools import parse_tools


def _tokenizer(ctx: ParseContext, param: str) -> Any:
    if ctx.tokenizer is None:
        raise ApiError(400, "this model has no tokenizer: the server works on token ids only", param, "no_tokenizer")
    return ctx.tokenizer


def tokenize(body: Any, ctx: ParseContext) -> dict:
    body = require_object(body)
    parse_model(body, ctx)
    has_prompt, has_messages = body.get("prompt") is not None, body.get("messages") is not None
    if has_prompt == has_messages:
        raise ApiError(400, "send either 'prompt' (a string) or 'messages' (a conversation)",
                       "messages" if has_messages else "prompt", "invalid_value" if has_prompt else "missing")
    if has_messages:
        if body.get("add_special_tokens") is not None:
            raise RequestError("'add_special_tokens' applies to 'prompt' (the chat template places a conversation's "
                               "special tokens)", "add_special_tokens", "invalid_value")
        ids = chat_prompt(body, ctx, parse_tools(body.get("tools")))
    else:
        prompt = body["prompt"]
        if not isinstance(prompt, str):
            raise RequestError("'prompt' must be a string (token ids need no tokenizing)", "prompt", "invalid_type")
        if len(prompt) > ctx.limits.max_prompt_chars:
            raise RequestError(f"'prompt' may have at most {ctx.limits.max_prompt_chars} characters", "prompt",
                               "invalid_value")
        special = body.get("add_special_tokens")
        special = True if special is None else check_bool("add_special_tokens", special)
        ids = [int(t) for t in _tokenizer(ctx, "prompt").encode(check_text(prompt, "prompt"),
                                                                add_special_tokens=special)]
    return {"count": len(ids), "max_model_len": ctx.max_model_len, "tokens": ids}


def detokenize(body: Any, ctx: ParseContext) -> dict:
    body = require_object(body)
    parse_model(body, ctx)
    tokens = body.get("tokens")
    if tokens is None:
        raise ApiError(400, "'tokens' is required", "tokens", "missing")
    if not isinstance(tokens, list) or any(type(t) is not int for t in tokens):
        raise RequestError("'tokens' must be a list of token ids (integers)", "tokens", "invalid_type")
    if len(tokens) > ctx.limits.max_prompt_chars:
        raise RequestError(f"'tokens' may hold at most {ctx.limits.max_prompt_chars} ids", "tokens", "invalid_value")
    bad = next((t for t in tokens if not 0 <= t < ctx.vocab_size), None)
    if bad is not None:
        raise RequestError(f"'tokens' holds {bad}, outside this model's vocabulary [0, {ctx.vocab_size})", "tokens",
                           "invalid_value")
    return {"prompt": _tokenizer(ctx, "tokens").decode(tokens)}
