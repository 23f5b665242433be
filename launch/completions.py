"""Completions (`POST /v1/completions`): its prompts (token ids, token-id lists, texts), its request, its choice and
response shapes. The fields it shares with chat are parsed by `launch.protocol`."""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

from engine.errors import RequestError
from engine.sampling_params import LOGPROBS_MAX, check_int
from launch.protocol import (ApiError, GenerationRequest, ParseContext, _unsupported, check_text, choices_usage,
                             parse_common, parse_max_tokens, parse_model, parse_n, parse_truncation, require_object)
from launch.structured import parse_response_format


def _token_list(x: Any) -> bool:
    return isinstance(x, list) and set(map(type, x)) <= _PLAIN_INT


_PLAIN_INT = frozenset({int})


def _context_check(n: int, ctx: ParseContext) -> None:
    if n >= ctx.max_model_len:
        raise RequestError(f"the prompt has {n} tokens; this model's maximum context length is "
                           f"{ctx.max_model_len} tokens (prompt + at least one new token)", "prompt",
                           "context_length_exceeded")


def parse_prompts(prompt: Any, ctx: ParseContext, keep: Optional[int] = None) -> list[list[int]]:
    """prompt: token ids, a list of token-id lists, a string or a list of strings (with a tokenizer); `keep`:
    `parse_truncation`'s count of the last tokens each prompt keeps."""
    lim = ctx.limits
    if prompt is None:
        raise ApiError(400, "'prompt' is required", "prompt", "missing")
    if isinstance(prompt, list):
        if not prompt:
            raise ApiError(400, "'prompt' is empty", "prompt", "empty_prompt")
        if type(prompt[0]) is int:
            prompt = prompt[-keep:] if keep else prompt
            _context_check(len(prompt), ctx)  # before looking at every element of a huge list
        elif len(prompt) > lim.max_prompts:
            raise RequestError(f"'prompt' holds {len(prompt)} prompts; at most {lim.max_prompts} are allowed per "
                               "request", "prompt", "invalid_value")
    if isinstance(prompt, str) or (isinstance(prompt, list) and all(isinstance(p, str) for p in prompt)):
        if ctx.tokenizer is None:
            raise ApiError(400, "this model has no tokenizer: send 'prompt' as token ids (a list of ints or a "
                                "list of lists of ints)", "prompt", "no_tokenizer")
        texts = [prompt] if isinstance(prompt, str) else prompt
        if sum(len(t) for t in texts) > lim.max_prompt_chars:
            raise RequestError(f"the text prompts may have at most {lim.max_prompt_chars} characters in all",
                               "prompt", "invalid_value")
        ids = [list(ctx.tokenizer.encode(check_text(t, "prompt"))) for t in texts]
        ids = [p[-keep:] for p in ids] if keep else ids
        for p in ids:
            _context_check(len(p), ctx)
        return ids
    if _token_list(prompt):
        _context_check(len(prompt), ctx)
        return [prompt]
    if isinstance(prompt, list) and all(isinstance(p, list) and p and _token_list(p) for p in prompt):
        prompt = [list(p[-keep:] if keep else p) for p in prompt]
        for p in prompt:
            _context_check(len(p), ctx)
        return prompt
    raise ApiError(400, "'prompt' must be a list of token ids, a list of non-empty token-id lists"
                        + (", a string or a list of strings" if ctx.tokenizer is not None else ""), "prompt",
                   "invalid_type")


def parse_completion_request(body: Any, ctx: ParseContext) -> GenerationRequest:
    body = require_object(body)
    parse_model(body, ctx)  # an unknown model is a 404 whatever else is wrong
    n = parse_n(body)
    _unsupported(body, "suffix", ("",), "(insertion)")
    lp = body.get("logprobs")
    logprobs = None if lp is None else check_int("logprobs", lp, 0, LOGPROBS_MAX)
    prompts = parse_prompts(body.get("prompt"), ctx, parse_truncation(body, ctx))
    # `echo` with `max_tokens: 0` scores the prompt alone: one token is generated and not returned
    echo_only = body.get("echo") is True and type(body.get("max_tokens")) is int and body["max_tokens"] == 0
    max_tokens = [1] * len(prompts) if echo_only else \
        parse_max_tokens(body, ("max_tokens",), ctx.defaults.max_tokens or 16, prompts, ctx)
    greq = parse_common(body, ctx, prompts, logprobs, max_tokens, n)
    if echo_only:
        greq.text = dataclasses.replace(greq.text, echo_only=True)
    greq.grammar = parse_response_format(body, ctx.grammars)
    return greq


def choice(index: int, text: str, token_ids: list[int], finish_reason: Optional[str],
           logprobs: Optional[dict] = None) -> dict:
    """One completion choice (non-streamed) or one streamed choice delta; `logprobs` when the request asked."""
    return {"index": index, "text": text, "token_ids": token_ids, "logprobs": logprobs,
            "finish_reason": finish_reason}


def completion_response(rid: str, model: str, created: int, choices: list, n: int = 1,
                        logprobs: Optional[list] = None) -> dict:
    """choices: `launch.outputs.ChoiceState`s, finished; logprobs: their `logprobs` objects (None: not asked)."""
    lps = logprobs or [None] * len(choices)
    return {
        "id": rid, "object": "text_completion", "created": created, "model": model,
        "choices": [choice(c.index, c.text, c.token_ids, c.finish_reason, lp) for c, lp in zip(choices, lps)],
        "usage": choices_usage(choices, n),
    }


