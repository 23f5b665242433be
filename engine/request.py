"""Requests, their validation, and what the engine hands back per step.

A `Request` is immutable once validated: prompt token ids, sampling parameters, stop
conditions. Validation (`validate_request`) runs in the caller's thread before anything
is scheduled, so a bad request never touches a scheduler, a block or a rank.
"""
from __future__ import annotations

import enum
import itertools
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

from engine.errors import RequestError
from engine.grammar import TokenGrammar, mask_words
from engine.sampling_params import INT32_MAX, SamplingParams

_ids = itertools.count()

MAX_STOP_TOKEN_IDS = 1024  # stop token ids per request (the HTTP layer may allow fewer)

__all__ = ["RequestError", "FinishReason", "Request", "ModelLimits", "validate_request", "RequestOutput",
           "new_request_id", "MAX_STOP_TOKEN_IDS"]


class FinishReason(str, enum.Enum):
    STOP = "stop"  # a stop token id was generated (the last output token; its text is not returned)
    LENGTH = "length"  # max_tokens reached, or the sequence reached max_model_len
    ABORT = "abort"  # aborted by the client (disconnect) or the operator
    ERROR = "error"  # the executor failed while the request was in flight


def new_request_id() -> str:
    return f"cmpl-{uuid.uuid4().hex[:16]}-{next(_ids)}"


@dataclass(frozen=True)
class Request:
    """prompt_token_ids: the prompt; max_tokens None = generate until max_model_len (else 1 .. 2**31-1).
    stop_token_ids: generation ends when one is sampled (it is the last output token, counted, its text not
    returned; at most `MAX_STOP_TOKEN_IDS`); the engine adds the model's EOS ids unless `sampling.ignore_eos`.
    sampling: `engine.sampling_params.SamplingParams`. parent_id: another sample of the same prompt (`n > 1`,
    `engine.samples`): this request waits until that one has computed the prompt, then shares its cached blocks.
    grammar: the constraint every generated token obeys (`engine.grammar`; the HTTP layer's `response_format`), None
    = free text. priority: under the priority scheduling policy a lower value is admitted first (ties: arrival
    order); int32, 0 by default."""

    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams = SamplingParams()
    max_tokens: Optional[int] = 16
    stop_token_ids: frozenset[int] = frozenset()
    request_id: str = field(default_factory=new_request_id)
    arrival_time: float = field(default_factory=time.monotonic)
    parent_id: Optional[str] = None
    grammar: Optional[TokenGrammar] = None
    priority: int = 0

    @staticmethod
    def make(prompt_token_ids: Sequence[int], sampling: Optional[SamplingParams] = None,
             max_tokens: Optional[int] = 16, stop_token_ids: Sequence[int] = (),
             request_id: Optional[str] = None, grammar: Optional[TokenGrammar] = None,
             priority: int = 0) -> "Request":
        """Build a request from loose inputs; type and range errors become `RequestError` (nothing is validated
        against the model here: see `validate_request`). `sampling` may be a legacy
        object with the same attributes (converted field by field)."""
        if isinstance(prompt_token_ids, np.ndarray):
            prompt_token_ids = prompt_token_ids.tolist() if prompt_token_ids.ndim == 1 else None
        if type(prompt_token_ids) in (list, tuple) and set(map(type, prompt_token_ids)) <= _PLAIN_INT:
            ids = tuple(prompt_token_ids)  # the common case (JSON, tokenizers): plain ints, checked at C speed
        else:
            if isinstance(prompt_token_ids, (str, bytes)) or not isinstance(prompt_token_ids, Sequence):
                raise RequestError("prompt token ids must be a list of ints", "prompt", "invalid_type")
            for t in prompt_token_ids:
                if not _is_int(t):
                    raise RequestError(f"prompt token ids must be ints, got {type(t).__name__}", "prompt",
                                       "invalid_type")
            ids = tuple(int(t) for t in prompt_token_ids)
        if max_tokens is not None and not _is_int(max_tokens):
            raise RequestError(f"max_tokens must be an int, got {type(max_tokens).__name__}", "max_tokens",
                               "invalid_type")
        if max_tokens is not None and int(max_tokens) > INT32_MAX:
            raise RequestError(f"max_tokens must be <= {INT32_MAX}", "max_tokens", "invalid_value")
        if isinstance(stop_token_ids, np.ndarray):
            stop_token_ids = stop_token_ids.tolist()
        if isinstance(stop_token_ids, (str, bytes)) or not isinstance(stop_token_ids, (Sequence, set, frozenset)):
            raise RequestError("stop_token_ids must be a list of ints", "stop_token_ids", "invalid_type")
        if len(stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise RequestError(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids are allowed", "stop_token_ids",
                               "invalid_value")
        for t in stop_token_ids:
            if not _is_int(t):
                raise RequestError(f"stop_token_ids must be ints, got {type(t).__name__}", "stop_token_ids",
                                   "invalid_type")
        sampling = SamplingParams() if sampling is None else SamplingParams.coerce(sampling)
        kw = {} if request_id is None else {"request_id": str(request_id)}
        if grammar is not None and not isinstance(grammar, TokenGrammar):
            raise RequestError("the grammar must be an engine.grammar.TokenGrammar", "response_format", "invalid_type")
        if not _is_int(priority) or not -INT32_MAX - 1 <= int(priority) <= INT32_MAX:
            raise RequestError("'priority' must be an int32", "priority", "invalid_value")
        return Request(ids, sampling,
                       None if max_tokens is None else int(max_tokens),
                       frozenset(int(t) for t in stop_token_ids), grammar=grammar, priority=int(priority), **kw)


def _tid(t: int) -> str:
    """A token id for an error message (an absurdly large one is not spelt out)."""
    return str(t) if abs(t) < 2**64 else f"of {t.bit_length()} bits"


_PLAIN_INT = frozenset({int})  # `type(t) is int`: no bool, no numpy scalar


def _is_int(x: object) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


@dataclass(frozen=True)
class ModelLimits:
    """What a request is validated against: vocabulary, longest sequence, KV capacity of one DP rank."""

    vocab_size: int
    max_model_len: int
    block_size: int
    num_kv_blocks: int  # per DP rank, block 0 included (it is reserved)

    @property
    def max_blocks_per_request(self) -> int:
        return self.num_kv_blocks - 1


def validate_request(req: Request, limits: ModelLimits) -> None:
    """Raise `RequestError` if the request is malformed or could never complete alone on one DP rank."""
    n = len(req.prompt_token_ids)
    if n == 0:
        raise RequestError("the prompt is empty", "prompt", "empty_prompt")
    lo, hi = min(req.prompt_token_ids), max(req.prompt_token_ids)
    if lo < 0 or hi >= limits.vocab_size:
        bad = lo if lo < 0 else hi
        raise RequestError(f"token id {_tid(bad)} is outside the vocabulary [0, {limits.vocab_size})", "prompt",
                           "invalid_token_id")
    if req.max_tokens is not None and req.max_tokens < 1:
        raise RequestError(f"max_tokens must be >= 1, got {req.max_tokens}", "max_tokens", "invalid_value")
    for t in req.stop_token_ids:
        if not 0 <= t < limits.vocab_size:
            raise RequestError(f"stop token id {_tid(t)} is outside the vocabulary [0, {limits.vocab_size})",
                               "stop_token_ids", "invalid_token_id")
    for t in {t for w in req.sampling.bad_words for t in w}:
        if t >= limits.vocab_size:
            raise RequestError(f"bad_words token id {t} is outside the vocabulary [0, {limits.vocab_size})",
                               "bad_words", "invalid_token_id")
    allowed = req.sampling.allowed_token_ids
    if allowed is not None and allowed[-1] >= limits.vocab_size:
        raise RequestError(f"allowed_token_ids token id {allowed[-1]} is outside the vocabulary [0, "
                           f"{limits.vocab_size})", "allowed_token_ids", "invalid_token_id")
    for t, _ in req.sampling.logit_bias:
        if t >= limits.vocab_size:
            raise RequestError(f"logit_bias token id {t} is outside the vocabulary [0, {limits.vocab_size})",
                               "logit_bias", "invalid_token_id")
    if req.max_tokens is not None and req.sampling.min_tokens > req.max_tokens:
        raise RequestError(f"min_tokens ({req.sampling.min_tokens}) exceeds max_tokens ({req.max_tokens})",
                           "min_tokens", "invalid_value")
    if req.grammar is not None and req.grammar.words != mask_words(limits.vocab_size):
        raise RequestError(f"the grammar was compiled for another vocabulary ({32 * req.grammar.words} ids at most; "
                           f"this model has {limits.vocab_size})", "response_format", "invalid_value")
    if n >= limits.max_model_len:
        raise RequestError(f"the prompt has {n} tokens; this model's maximum context length is "
                           f"{limits.max_model_len} tokens (prompt + at least one new token)", "prompt",
                           "context_length_exceeded")
    total = n + (req.max_tokens if req.max_tokens is not None else limits.max_model_len - n)
    if total > limits.max_model_len:
        raise RequestError(f"this model's maximum context length is {limits.max_model_len} tokens; you requested "
                           f"{total} ({n} in the prompt + {req.max_tokens} max_tokens)", "max_tokens",
                           "context_length_exceeded")
    need = math.ceil(total / limits.block_size)
    if need > limits.max_blocks_per_request:
        raise RequestError(f"the request needs {need} KV blocks of {limits.block_size} tokens; one DP rank holds "
                           f"{limits.max_blocks_per_request}", "max_tokens", "kv_capacity_exceeded")


@dataclass(slots=True)
class RequestOutput:
    """One request's progress after a step. `new_token_ids` are the tokens since the previous output
    (streaming); `token_ids` all generated tokens, filled in the final output (`finished`) only;
    `num_generated` counts them at any time. Times are `time.monotonic()` seconds."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    new_token_ids: list[int]
    token_ids: list[int]
    num_generated: int = 0
    finished: bool = False
    finish_reason: Optional[FinishReason] = None
    arrival_time: float = 0.0
    first_token_time: Optional[float] = None
    finish_time: Optional[float] = None
    num_preemptions: int = 0
    error: Optional[str] = None
    # finished on a stop token (EOS or a stop_token_ids entry): it is the last of `token_ids` and counted, as
    # OpenAI and vLLM count it, but its text is not returned
    stopped_on_token: bool = False
    # when the request asked for logprobs: per token of `new_token_ids`, (its logprob, top ids, top logprobs)
    new_logprobs: Optional[list[tuple[float, list[int], list[float]]]] = None
    # every generated token's entry, in the final output only (like `token_ids`)
    logprobs: Optional[list[tuple[float, list[int], list[float]]]] = None
    # prompt tokens whose KV came from the prefix cache when the request was first scheduled (0 until then)
    num_cached_tokens: int = 0
    # when the request asked for prompt_logprobs: None for the first prompt token, then each one's entry (its
    # log-probability, rank, top ids, top log-probabilities; `engine.prompt_rows`); in the first and the final output
    prompt_logprobs: Optional[list] = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def time_to_first_token(self) -> Optional[float]:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def time_per_output_token(self) -> Optional[float]:
        """Mean decode interval after the first token (None below two tokens or before the end)."""
        if self.finish_time is None or self.first_token_time is None or self.num_generated < 2:
            return None
        return (self.finish_time - self.first_token_time) / (self.num_generated - 1)
