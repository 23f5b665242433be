"""OpenAI-compatible completions: request parsing (every problem is an `ApiError` with an HTTP
status), response and stream-chunk building. No I/O here."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Optional

from engine.request import RequestOutput
from modeling.sampling import SamplingParams, SamplingParamsError


class ApiError(Exception):
    """An HTTP error with an OpenAI-style JSON body."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 type_: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class CompletionRequest:
    prompts: list[list[int]]
    sampling: SamplingParams
    max_tokens: Optional[int]
    stop_token_ids: list[int]
    stream: bool
    include_usage: bool
    model: str


def _int(body: dict, key: str, default: Any, lo: Optional[int] = None) -> Any:
    v = body.get(key, default)
    if v is None:
        return default
    if not isinstance(v, int) or isinstance(v, bool):
        raise ApiError(400, f"'{key}' must be an integer, got {type(v).__name__}", key, "invalid_type")
    if lo is not None and v < lo:
        raise ApiError(400, f"'{key}' must be >= {lo}, got {v}", key, "invalid_value")
    return v


def _num(body: dict, key: str, default: float) -> float:
    v = body.get(key, default)
    if v is None:
        return default
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        raise ApiError(400, f"'{key}' must be a number, got {type(v).__name__}", key, "invalid_type")
    return float(v)


def _bool(body: dict, key: str, default: bool) -> bool:
    v = body.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ApiError(400, f"'{key}' must be a boolean, got {type(v).__name__}", key, "invalid_type")
    return v


def _token_list(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def parse_prompts(prompt: Any, tokenizer: Any) -> list[list[int]]:
    """prompt: token ids, a list of token-id lists, a string or a list of strings (with a tokenizer)."""
    if prompt is None:
        raise ApiError(400, "'prompt' is required", "prompt", "missing")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt)):
        if tokenizer is None:
            raise ApiError(400, "this model has no tokenizer: send 'prompt' as token ids (a list of ints or a "
                                "list of lists of ints)", "prompt", "no_tokenizer")
        texts = [prompt] if isinstance(prompt, str) else prompt
        return [list(tokenizer.encode(t)) for t in texts]
    if isinstance(prompt, list) and prompt and _token_list(prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(_token_list(p) for p in prompt):
        return [list(p) for p in prompt]
    if isinstance(prompt, list) and not prompt:
        raise ApiError(400, "'prompt' is empty", "prompt", "empty_prompt")
    raise ApiError(400, "'prompt' must be a list of token ids, a list of token-id lists"
                        + (", a string or a list of strings" if tokenizer is not None else ""), "prompt",
                   "invalid_type")


_UNSUPPORTED = {"n": (None, 1), "best_of": (None, 1), "echo": (None, False), "logprobs": (None,),
                "suffix": (None, ""), "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
                "logit_bias": (None, {})}


def parse_completion_request(body: Any, served_names: tuple[str, ...], tokenizer: Any) -> CompletionRequest:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", None, "invalid_json")
    model = body.get("model", served_names[0])
    if not isinstance(model, str):
        raise ApiError(400, "'model' must be a string", "model", "invalid_type")
    if model not in served_names:
        raise ApiError(404, f"the model '{model}' does not exist; this server serves '{served_names[0]}'", "model",
                       "model_not_found")
    for key, allowed in _UNSUPPORTED.items():
        if key in body and body[key] not in allowed:
            raise ApiError(400, f"'{key}'={body[key]!r} is not supported", key, "unsupported")
    stop = body.get("stop")
    if stop not in (None, [], ""):
        raise ApiError(400, "'stop' strings are not supported; use 'stop_token_ids'", "stop", "unsupported")
    prompts = parse_prompts(body.get("prompt"), tokenizer)
    max_tokens = body.get("max_tokens", 16)
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool)):
        raise ApiError(400, f"'max_tokens' must be an integer, got {type(max_tokens).__name__}", "max_tokens",
                       "invalid_type")
    top_k = _int(body, "top_k", 0)
    if top_k == -1:
        top_k = 0  # vLLM's "off"
    try:
        sampling = SamplingParams(temperature=_num(body, "temperature", 1.0), top_k=top_k,
                                  top_p=_num(body, "top_p", 1.0), seed=_int(body, "seed", None))
    except SamplingParamsError as exc:
        raise ApiError(400, str(exc), None, "invalid_value") from exc
    stop_ids = body.get("stop_token_ids") or []
    if not _token_list(stop_ids):
        raise ApiError(400, "'stop_token_ids' must be a list of ints", "stop_token_ids", "invalid_type")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise ApiError(400, "'stream_options' must be an object", "stream_options", "invalid_type")
    return CompletionRequest(prompts, sampling, max_tokens, stop_ids, _bool(body, "stream", False),
                             _bool(opts, "include_usage", False), model)


def choice(index: int, text: str, token_ids: list[int], finish_reason: Optional[str]) -> dict:
    return {"index": index, "text": text, "token_ids": token_ids, "logprobs": None, "finish_reason": finish_reason}


def completion_response(rid: str, model: str, created: int, outs: list[RequestOutput], texts: list[str]) -> dict:
    prompt_tokens = sum(o.num_prompt_tokens for o in outs)
    completion_tokens = sum(len(o.token_ids) for o in outs)
    return {
        "id": rid, "object": "text_completion", "created": created, "model": model,
        "choices": [choice(i, t, o.token_ids, o.finish_reason.value if o.finish_reason else None)
                    for i, (o, t) in enumerate(zip(outs, texts))],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
    }


def stream_chunk(rid: str, model: str, created: int, choices: list[dict], usage: Optional[dict] = None) -> dict:
    out = {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices}
    if usage is not None:
        out["usage"] = usage
    return out


class IncrementalDetokenizer:
    """Text deltas of a growing token list (holds back an incomplete UTF-8 tail)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.sent = 0

    def push(self, new_ids: list[int], final: bool = False) -> str:
        if self.tokenizer is None:
            return ""
        self.ids.extend(new_ids)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd") and not final:
            return ""
        delta, self.sent = text[self.sent:], len(text)
        return delta


def decode_text(tokenizer: Any, ids: list[int]) -> str:
    return "" if tokenizer is None else tokenizer.decode(ids, skip_special_tokens=True)


def now_s() -> int:
    return int(time.time())
