"""OpenAI-compatible request parsing shared by completions and chat (completions' own: `launch.completions`).

Every field is bounded and checked here, before a request reaches the engine thread: a problem is
an `ApiError` (HTTP status + OpenAI error body) or a `RequestError` (400, `param` names the field).
The JSON body itself is read by `launch.json_body.parse_json_body` (size, depth, content type, UTF-8). Unknown fields
are ignored, as OpenAI does. Error messages describe the caller's own request only and name no
internals. No I/O here.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional

from engine.errors import RequestError
from engine.grammar import TokenGrammar
from engine.sampling_params import (BAD_WORD_MAX_TOKENS, BAD_WORDS_MAX, INT32_MAX, LOGPROBS_MAX, SamplingParams,
                                    check_bool, check_int)
from engine.samples import MAX_N
from launch.defaults import GenerationDefaults
from launch.tools import ToolChoice


class ApiError(Exception):
    """An HTTP error with an OpenAI-style JSON body."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 type_: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class ProtocolLimits:
    """Bounds on what one HTTP request may carry (beyond the model's own limits)."""

    max_body_bytes: int = 16 * 1024 * 1024
    max_json_depth: int = 32  # nesting of arrays/objects (a list of token-id lists is depth 3)
    max_prompts: int = 256  # prompts in one completion request
    max_prompt_chars: int = 1_000_000  # all text prompts of a request, or all of a chat's message text
    max_stop_strings: int = 4
    max_stop_chars: int = 256
    max_stop_token_ids: int = 256
    max_messages: int = 1024
    max_model_name_chars: int = 256


@dataclass(frozen=True)
class ParseContext:
    """What parsing needs from the server: served names, tokenizer, model limits, defaults, EOS ids."""

    served_names: tuple[str, ...]
    tokenizer: Any
    vocab_size: int
    max_model_len: int
    max_sequence_tokens: int = 0  # tokens one sequence can hold (KV capacity of a DP rank); 0 = max_model_len
    defaults: GenerationDefaults = field(default_factory=GenerationDefaults)
    eos_token_ids: tuple[int, ...] = ()
    limits: ProtocolLimits = field(default_factory=ProtocolLimits)
    tool_call_parser: Optional[str] = None  # `launch.tools.TOOL_CALL_PARSERS`: chat may ask for tool calls
    grammars: Any = None  # `launch.structured.GrammarCompiler` of the tokenizer (None without one)
    responses: Any = None  # `launch.responses_store.ResponseStore` (None: `/v1/responses` stores nothing)


@dataclass
class GenerationRequest:
    """A parsed completion or chat request: prompts (token ids), each answered by `n` choices (choice index
    `prompt_index * n + sample_index`, as OpenAI orders them)."""

    model: str
    prompts: list[list[int]]
    sampling: SamplingParams
    max_tokens: list[int]  # per prompt
    stop_token_ids: list[int]
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    n: int = 1
    max_tokens_given: bool = True  # False: max_tokens is the server's default (lowered to fit n samples)
    tool_choice: Optional[ToolChoice] = None  # chat: `launch.tools.parse_tool_choice` (None: completions)
    grammar: Optional[TokenGrammar] = None  # `response_format` (`launch.structured`): every choice obeys it
    text: "TextOptions" = field(default_factory=lambda: TextOptions())
    priority: int = 0  # vLLM's `priority` (the server's --scheduling-policy priority: lower first)


@dataclass(frozen=True)
class TextOptions:
    """vLLM's options of how a choice's tokens become text and chunks."""

    include_stop_str: bool = False  # `include_stop_str_in_output`: a matched stop string ends the text
    skip_special_tokens: bool = True  # special tokens (e.g. `<|im_start|>`) have no text
    continuous_usage: bool = False  # `stream_options.continuous_usage_stats`: every chunk carries the usage so far
    echo: bool = False  # completions' `echo`: each choice's text (and logprobs) starts with its prompt's
    echo_only: bool = False  # `echo` with `max_tokens: 0`: the prompt alone (the one token generated is dropped)
    prompt_logprobs: bool = False  # vLLM's `prompt_logprobs`: the response carries them (`launch.prompt_logprobs`)
    tokens_as_ids: bool = False  # vLLM's `return_tokens_as_token_ids`: logprob tokens as "token_id:<id>"
    return_token_ids: bool = False  # vLLM's `return_token_ids`: the prompt's and each choice's token ids
    chat_echo: str = ""  # vLLM's chat `echo`: the text each chat answer starts with (the last message's)


# ---- shared fields
def check_text(s: str, param: str) -> str:
    """`s` if it is encodable text: JSON's \\ud800-style escapes can produce unpaired surrogates, which no
    tokenizer accepts."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise RequestError(f"'{param}' contains an unpaired UTF-16 surrogate escape", param, "invalid_value") from None
    return s


def _kind(v: Any) -> str:
    return "null" if v is None else "a boolean" if isinstance(v, bool) else type(v).__name__


def parse_model(body: dict, ctx: ParseContext) -> str:
    model = body.get("model")
    if model is None:
        return ctx.served_names[0]
    if not isinstance(model, str):
        raise ApiError(400, f"'model' must be a string, got {_kind(model)}", "model", "invalid_type")
    if model not in ctx.served_names:
        shown = model if len(model) <= ctx.limits.max_model_name_chars else model[:40] + "..."
        raise ApiError(404, f"the model '{shown}' does not exist; this server serves '{ctx.served_names[0]}'",
                       "model", "model_not_found")
    return model


def parse_n(body: dict) -> int:
    """`n` (choices per prompt, 1 to `MAX_N`; the samples share the prompt's KV blocks, `engine.samples`).
    `best_of` > 1 (server-side ranking of extra samples) is refused."""
    b = body.get("best_of")
    if b is not None and check_int("best_of", b, 1, INT32_MAX) > 1:
        raise ApiError(400, "'best_of' is not supported (the server does not rank samples by log-probability); use "
                            "'n' for several choices", "best_of", "unsupported")
    v = body.get("n")
    if v is None:
        return 1
    n = check_int("n", v, 1, INT32_MAX)
    if n > MAX_N:
        raise RequestError(f"'n' must be at most {MAX_N}, got {n}", "n", "invalid_value")
    return n


def _unsupported(body: dict, key: str, allowed: tuple, what: str) -> None:
    v = body.get(key)
    if v is not None and not any(v == a and type(v) is type(a) for a in allowed):
        raise ApiError(400, f"'{key}' {what} is not supported", key, "unsupported")


HTTP_SAMPLING_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0}  # OpenAI's defaults where they differ
_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                  "repetition_penalty", "logit_bias", "min_tokens", "ignore_eos", "allowed_token_ids")


def parse_sampling(body: dict, ctx: ParseContext, logprobs: Optional[int]) -> SamplingParams:
    """SamplingParams from the body; omitted (or null) fields take the server's generation defaults, then
    OpenAI's. A field the engine cannot apply yet is refused when sent with a non-default value."""
    kw: dict[str, Any] = {}
    for key in _SAMPLING_KEYS:
        v = body.get(key)
        if v is None:
            v = ctx.defaults.sampling.get(key, HTTP_SAMPLING_DEFAULTS.get(key))
        if v is not None:
            kw[key] = v
    bad = parse_bad_words(body, ctx)
    sp = SamplingParams(**kw, logprobs=logprobs, **({"bad_words": bad} if bad else {}))
    for name in sp.unapplied():
        if body.get(name) is not None:
            raise ApiError(400, f"'{name}' is accepted by the API but not applied by this engine yet; omit it or "
                                "send its neutral value", name, "unsupported")
    return sp


def parse_bad_words(body: dict, ctx: ParseContext) -> tuple[tuple[int, ...], ...]:
    """vLLM's `bad_words` (strings) as token-id sequences: each word as it starts a text and after a space, as the
    served tokenizer writes them (`SamplingParams.bad_words`)."""
    v = body.get("bad_words")
    if v is None or v == []:
        return ()
    if not isinstance(v, list) or not all(isinstance(w, str) and w.strip() for w in v) or len(v) > BAD_WORDS_MAX // 2:
        raise RequestError(f"'bad_words' must be a list of at most {BAD_WORDS_MAX // 2} non-blank strings", "bad_words",
                           "invalid_type")
    if ctx.tokenizer is None:
        raise ApiError(400, "this model has no tokenizer: 'bad_words' needs one", "bad_words", "no_tokenizer")
    out = []
    for w in v:
        for prefix in ("", " "):
            ids = ctx.tokenizer.encode(prefix + check_text(w, "bad_words").lstrip(), add_special_tokens=False)
            if not 1 <= len(ids) <= BAD_WORD_MAX_TOKENS:
                raise RequestError(f"each of 'bad_words' must be 1 to {BAD_WORD_MAX_TOKENS} tokens", "bad_words",
                                   "invalid_value")
            out.append(tuple(ids))
    return tuple(dict.fromkeys(out))


def parse_max_tokens(body: dict, keys: tuple[str, ...], default: Optional[int], prompts: list[list[int]],
                     ctx: ParseContext) -> list[int]:
    """The token budget per prompt: the first of `keys` that is set (validated, and checked against the
    context by the engine), else `default` (None = no limit) capped by what the context and one DP rank's
    KV cache leave after the prompt."""
    for key in keys:
        v = body.get(key)
        if v is not None:
            n = check_int(key, v, 1, INT32_MAX)
            return [n] * len(prompts)
    room = min(ctx.max_model_len, ctx.max_sequence_tokens or ctx.max_model_len)
    return [max(1, min(default if default is not None else room, room - len(p))) for p in prompts]


def parse_stop(body: dict, ctx: ParseContext) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None or v == []:
        return ()
    stops = [v] if isinstance(v, str) else v
    lim = ctx.limits
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise RequestError("'stop' must be a string or a list of strings", "stop", "invalid_type")
    if len(stops) > lim.max_stop_strings:
        raise RequestError(f"'stop' may hold at most {lim.max_stop_strings} strings", "stop", "invalid_value")
    if any(not s or len(s) > lim.max_stop_chars for s in stops):
        raise RequestError(f"each 'stop' string must have 1 to {lim.max_stop_chars} characters", "stop",
                           "invalid_value")
    if ctx.tokenizer is None:
        raise ApiError(400, "this model has no tokenizer: 'stop' strings need one; use 'stop_token_ids'", "stop",
                       "no_tokenizer")
    return tuple(dict.fromkeys(check_text(s, "stop") for s in stops))


def parse_stop_token_ids(body: dict, ctx: ParseContext, ignore_eos: bool) -> list[int]:
    v = body.get("stop_token_ids")
    ids: list[int] = []
    if v is not None:
        if not isinstance(v, list):
            raise RequestError(f"'stop_token_ids' must be a list of token ids, got {_kind(v)}", "stop_token_ids",
                               "invalid_type")
        if len(v) > ctx.limits.max_stop_token_ids:
            raise RequestError(f"'stop_token_ids' may hold at most {ctx.limits.max_stop_token_ids} ids",
                               "stop_token_ids", "invalid_value")
        ids = [check_int("stop_token_ids", t, 0, ctx.vocab_size - 1) for t in v]
    if not ignore_eos:
        ids += [t for t in ctx.eos_token_ids if t not in ids]
    return ids


def _flag(body: dict, key: str, default: bool, where: str = "") -> bool:
    v = body.get(key)
    return default if v is None else check_bool(where + key, v)


def parse_stream(body: dict) -> tuple[bool, bool, bool]:
    """(stream, stream_options.include_usage, stream_options.continuous_usage_stats)."""
    stream = _flag(body, "stream", False)
    opts = body.get("stream_options")
    if opts is None:
        return stream, False, False
    if not isinstance(opts, dict):
        raise RequestError(f"'stream_options' must be an object, got {_kind(opts)}", "stream_options",
                           "invalid_type")
    if not stream:
        raise RequestError("'stream_options' is only allowed with 'stream': true", "stream_options",
                           "invalid_value")
    return (stream, _flag(opts, "include_usage", False, "stream_options."),
            _flag(opts, "continuous_usage_stats", False, "stream_options."))


def parse_truncation(body: dict, ctx: ParseContext) -> Optional[int]:
    """vLLM's `truncate_prompt_tokens`: keep each prompt's last k tokens (-1: as many as the context leaves room
    for, `max_model_len` - 1); None: no truncation."""
    v = body.get("truncate_prompt_tokens")
    if v is None:
        return None
    if v == -1 and type(v) is int:
        return ctx.max_model_len - 1
    return check_int("truncate_prompt_tokens", v, 1, INT32_MAX)


def parse_common(body: Any, ctx: ParseContext, prompts: list[list[int]], logprobs: Optional[int],
                 max_tokens: list[int], n: int = 1, max_tokens_keys: tuple[str, ...] = ("max_tokens",),
                 chat: bool = False) -> GenerationRequest:
    """The fields completions and chat share, after the endpoint parsed its prompt, token budget and `n` (`echo`
    is completions' only)."""
    sampling = parse_sampling(body, ctx, logprobs)
    stream, include_usage, continuous = parse_stream(body)
    echo = _flag(body, "echo", False) and not chat  # chat's echo: `launch.chat`
    v = body.get("prompt_logprobs")
    wanted = None if v is None else check_int("prompt_logprobs", v, 0, LOGPROBS_MAX)
    if wanted is not None and stream and chat:
        raise RequestError("'prompt_logprobs' is not available with 'stream': true on chat completions",
                           "prompt_logprobs", "invalid_value")
    if echo and logprobs is not None:  # the echoed prompt's tokens carry logprobs too
        wanted = max(logprobs, -1 if wanted is None else wanted)
    if wanted is not None:
        sampling = sampling.replace(prompt_logprobs=wanted)
    text = TextOptions(_flag(body, "include_stop_str_in_output", False),
                       _flag(body, "skip_special_tokens", True), continuous, echo=echo, prompt_logprobs=v is not None,
                       tokens_as_ids=_flag(body, "return_tokens_as_token_ids", False),
                       return_token_ids=_flag(body, "return_token_ids", False))
    priority = body.get("priority")
    return GenerationRequest(parse_model(body, ctx), prompts, sampling, max_tokens,
                             parse_stop_token_ids(body, ctx, sampling.ignore_eos), parse_stop(body, ctx),
                             stream, include_usage, n, any(body.get(k) is not None for k in max_tokens_keys),
                             text=text, priority=0 if priority is None else check_int("priority", priority,
                                                                                      -INT32_MAX - 1, INT32_MAX))


def require_object(body: Any) -> dict:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", None, "invalid_json")
    return body


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; `cached_tokens`: prompt tokens whose KV came from the prefix cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def choices_usage(choices: list, n: int = 1) -> dict:
    """Usage of a response's choices (`launch.outputs.ChoiceState`): each prompt's tokens once (its n samples share
    one prefill; so do its cached tokens, those of its first sample), every choice's completion tokens."""
    firsts = [c for c in choices if c.index % n == 0]
    return usage(sum(c.num_prompt_tokens for c in firsts), sum(len(c.token_ids) for c in choices),
                 sum(c.cached_tokens for c in firsts))


def stream_chunk(rid: str, model: str, created: int, choices: list[dict], usage_: Optional[dict] = None,
                 object_: str = "text_completion") -> dict:
    out = {"id": rid, "object": object_, "created": created, "model": model, "choices": choices}
    if usage_ is not None:
        out["usage"] = usage_
    return out


def now_s() -> int:
    return int(time.time())
