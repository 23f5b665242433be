"""`SamplingParams`: the request-side sampling parameters, validated once, in plain Python (no torch).

Every field is checked for type and range on construction and a bad one raises
`RequestError(message, param=<field name>, code=...)`: bools where numbers are wanted, NaN and
infinities (Python's json reads `1e400` as inf), integers beyond what the int32 / int64 step arrays
carry, negative seeds. Ranges (vLLM / OpenAI):

| field | type | range | default / off |
|---|---|---|---|
| temperature | number | [0, 100]; values in (0, 0.01) are raised to 0.01 (as vLLM) | 0 = greedy |
| top_k | int | -1 or 0 (off; -1 is stored as 0), 1 .. 2**31-1 | 0 |
| top_p | number | (0, 1] (and > 0 in float32) | 1.0 |
| min_p | number | [0, 1] | 0.0 |
| seed | int or None | [0, 2**63-1]; None = unseeded (the engine assigns one on the driver) | None |
| presence_penalty, frequency_penalty | number | [-2, 2] | 0.0 |
| repetition_penalty | number | (0, 2] | 1.0 |
| logit_bias | {token id: bias} or pairs | <= 300 entries, ids in [0, 2**31-1], bias [-100, 100] | () |
| min_tokens | int | [0, 2**31-1] | 0 |
| bad_words | token-id sequences | <= 128 sequences of 1-32 ids in [0, 2**31-1] | () |
| allowed_token_ids | token ids | 1 .. 2**20 distinct ids in [0, 2**31-1] (vLLM's: only these may be drawn) | None |
| ignore_eos | bool | | False |
| logprobs | int or None | 0 .. 20 (top log-probabilities per token) | None |
| prompt_logprobs | int or None | 0 .. 20 (top log-probabilities per prompt token; vLLM's) | None |

`ENGINE_APPLIES` names the fields the engine's sampler honours today; `unapplied()` lists the
fields of a `SamplingParams` set away from their default that it does not (the HTTP layer refuses
those rather than silently ignoring them; extend the set when the sampler learns a field).
"""
from __future__ import annotations

import dataclasses
import math
import numbers
import struct
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional, Union

from engine.errors import RequestError

INT32_MAX = 2**31 - 1
SEED_MAX = 2**63 - 1
TEMPERATURE_MAX = 100.0
TEMPERATURE_MIN_POSITIVE = 1e-2
PENALTY_MAX = 2.0
LOGIT_BIAS_MAX = 100.0
LOGIT_BIAS_MAX_ENTRIES = 300
LOGPROBS_MAX = 20
BAD_WORDS_MAX = 128
BAD_WORD_MAX_TOKENS = 32
ALLOWED_TOKEN_IDS_MAX = 2**20

# Fields the sampler on the ranks applies (`modeling.sampler`: temperature, top_k, top_p, seed in the step arrays,
# the rest in `actors.batch.SamplerExtras`; min_tokens as banned stop ids until the request has that many tokens).
ENGINE_APPLIES: frozenset[str] = frozenset({"temperature", "top_k", "top_p", "seed", "min_p", "presence_penalty",
                                            "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens",
                                            "bad_words", "allowed_token_ids"})
# Fields handled outside the sampler: ignore_eos by whoever builds the stop token ids (the HTTP layer leaves
# EOS out), logprobs accepted with null values until the sampler returns them.
HANDLED_OUTSIDE: frozenset[str] = frozenset({"ignore_eos", "logprobs", "prompt_logprobs"})

LogitBiasInput = Union[None, Mapping[Any, Any], Iterable[Any]]


def _kind(v: Any) -> str:
    return "null" if v is None else "a boolean" if isinstance(v, bool) else type(v).__name__


def _show(v: Any) -> str:
    """A short rendering of a caller's value for an error message (huge integers are not spelt out)."""
    if isinstance(v, numbers.Integral) and abs(int(v)) > 2**64:
        return "an integer of %d bits" % int(v).bit_length()
    return repr(v) if isinstance(v, (int, float)) else _kind(v)


def check_int(name: str, v: Any, lo: int, hi: int) -> int:
    """`v` as an int in [lo, hi]; bools, floats and out-of-range values raise `RequestError(param=name)`."""
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise RequestError(f"'{name}' must be an integer, got {_kind(v)}", name, "invalid_type")
    i = int(v)
    if not lo <= i <= hi:
        raise RequestError(f"'{name}' must be in [{lo}, {hi}], got {_show(i)}", name, "invalid_value")
    return i


def check_number(name: str, v: Any, lo: float, hi: float, lo_open: bool = False, hi_open: bool = False) -> float:
    """`v` as a finite float in the interval; bools, NaN, infinities and out-of-range values raise."""
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise RequestError(f"'{name}' must be a number, got {_kind(v)}", name, "invalid_type")
    try:
        f = float(v)
    except OverflowError:  # an int too large for a float
        f = math.inf
    if not math.isfinite(f):
        raise RequestError(f"'{name}' must be a finite number", name, "invalid_value")
    if f < lo or f > hi or (lo_open and f == lo) or (hi_open and f == hi):
        interval = f"{'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
        raise RequestError(f"'{name}' must be in {interval}, got {f:g}", name, "invalid_value")
    return f


def check_bool(name: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise RequestError(f"'{name}' must be a boolean, got {_kind(v)}", name, "invalid_type")
    return v


def _float32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def _logit_bias(v: LogitBiasInput) -> tuple[tuple[int, float], ...]:
    if v is None:
        return ()
    if isinstance(v, (str, bytes)) or not isinstance(v, (Mapping, Iterable)):
        raise RequestError(f"'logit_bias' must be an object mapping token ids to biases, got {_kind(v)}",
                           "logit_bias", "invalid_type")
    items = list(v.items()) if isinstance(v, Mapping) else list(v)
    if len(items) > LOGIT_BIAS_MAX_ENTRIES:
        raise RequestError(f"'logit_bias' has {len(items)} entries; at most {LOGIT_BIAS_MAX_ENTRIES} are allowed",
                           "logit_bias", "invalid_value")
    out: dict[int, float] = {}
    for item in items:
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise RequestError("'logit_bias' entries must be (token id, bias) pairs", "logit_bias", "invalid_type")
        key, bias = item
        if isinstance(key, str):  # JSON object keys are strings: "50256"
            if not (key.isascii() and key.isdigit()) or len(key) > 10:
                raise RequestError("'logit_bias' keys must be token ids (decimal integers)", "logit_bias",
                                   "invalid_type")
            key = int(key)
        tid = check_int("logit_bias", key, 0, INT32_MAX)
        if tid in out:
            raise RequestError(f"'logit_bias' names token id {tid} twice", "logit_bias", "invalid_value")
        out[tid] = check_number("logit_bias", bias, -LOGIT_BIAS_MAX, LOGIT_BIAS_MAX)
    return tuple(sorted(out.items()))


def _bad_words(v: Any) -> tuple[tuple[int, ...], ...]:
    if not isinstance(v, (list, tuple)) or len(v) > BAD_WORDS_MAX:
        raise RequestError(f"'bad_words' must be at most {BAD_WORDS_MAX} token-id sequences", "bad_words",
                           "invalid_type")
    out = []
    for w in v:
        if not isinstance(w, (list, tuple)) or not 1 <= len(w) <= BAD_WORD_MAX_TOKENS:
            raise RequestError(f"each of 'bad_words' must be 1 to {BAD_WORD_MAX_TOKENS} tokens", "bad_words",
                               "invalid_value")
        out.append(tuple(check_int("bad_words", t, 0, INT32_MAX) for t in w))
    return tuple(dict.fromkeys(out))


def _allowed_token_ids(v: Any) -> Optional[tuple[int, ...]]:
    if v is None:
        return None
    if isinstance(v, (str, bytes)) or not isinstance(v, (list, tuple)):
        raise RequestError(f"'allowed_token_ids' must be a list of token ids, got {_kind(v)}", "allowed_token_ids",
                           "invalid_type")
    if not 1 <= len(v) <= ALLOWED_TOKEN_IDS_MAX:
        raise RequestError(f"'allowed_token_ids' must hold 1 to {ALLOWED_TOKEN_IDS_MAX} token ids, got {len(v)}",
                           "allowed_token_ids", "invalid_value")
    return tuple(sorted({check_int("allowed_token_ids", t, 0, INT32_MAX) for t in v}))


@dataclass(frozen=True)
class SamplingParams:
    """How one request's tokens are sampled (ranges in the module docstring); validated and normalised on
    construction, immutable and hashable afterwards. temperature 0 = greedy; top_k 0 = off; top_p 1 = off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: Optional[int] = None
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: Optional[int] = None
    # vLLM's bad_words as token-id sequences: the last id of one is banned whenever the output ends with the others
    bad_words: tuple[tuple[int, ...], ...] = ()
    # vLLM's allowed_token_ids: only these ids may be drawn (sorted, distinct); None = every id
    allowed_token_ids: Optional[tuple[int, ...]] = None
    # vLLM's prompt_logprobs: each prompt token after the first gets its log-probability (and this many top ones)
    prompt_logprobs: Optional[int] = None

    def __post_init__(self) -> None:
        t = check_number("temperature", self.temperature, 0.0, TEMPERATURE_MAX)
        if 0.0 < t < TEMPERATURE_MIN_POSITIVE:
            t = TEMPERATURE_MIN_POSITIVE
        top_k = check_int("top_k", self.top_k, -1, INT32_MAX)
        top_k = 0 if top_k == -1 else top_k  # vLLM's "off"
        top_p = check_number("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        if _float32(top_p) <= 0.0:
            raise RequestError("'top_p' is too small (it rounds to 0 in float32)", "top_p", "invalid_value")
        seed = None if self.seed is None else check_int("seed", self.seed, 0, SEED_MAX)
        values = {
            "temperature": t, "top_k": top_k, "top_p": top_p, "seed": seed,
            "min_p": check_number("min_p", self.min_p, 0.0, 1.0),
            "presence_penalty": check_number("presence_penalty", self.presence_penalty, -PENALTY_MAX, PENALTY_MAX),
            "frequency_penalty": check_number("frequency_penalty", self.frequency_penalty, -PENALTY_MAX,
                                              PENALTY_MAX),
            "repetition_penalty": check_number("repetition_penalty", self.repetition_penalty, 0.0, PENALTY_MAX,
                                               lo_open=True),
            "logit_bias": _logit_bias(self.logit_bias),
            "min_tokens": check_int("min_tokens", self.min_tokens, 0, INT32_MAX),
            "ignore_eos": check_bool("ignore_eos", self.ignore_eos),
            "logprobs": None if self.logprobs is None else check_int("logprobs", self.logprobs, 0, LOGPROBS_MAX),
            "bad_words": _bad_words(self.bad_words),
            "allowed_token_ids": _allowed_token_ids(self.allowed_token_ids),
            "prompt_logprobs": None if self.prompt_logprobs is None else check_int("prompt_logprobs",
                                                                                   self.prompt_logprobs, 0,
                                                                                   LOGPROBS_MAX),
        }
        for k, v in values.items():
            object.__setattr__(self, k, v)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def replace(self, **changes: Any) -> "SamplingParams":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def unapplied(self) -> tuple[str, ...]:
        """Fields set away from their default that the engine's sampler does not apply yet."""
        return tuple(f.name for f in dataclasses.fields(self)
                     if f.name not in ENGINE_APPLIES and f.name not in HANDLED_OUTSIDE
                     and getattr(self, f.name) != f.default)

    @classmethod
    def coerce(cls, sp: Any) -> "SamplingParams":
        """`sp` itself, or a `SamplingParams` built from any object with the same attributes (the legacy
        object with these attributes); fields it lacks keep their defaults."""
        if isinstance(sp, cls):
            return sp
        if sp is None or not all(hasattr(sp, k) for k in ("temperature", "top_k", "top_p", "seed")):
            raise RequestError("sampling must be a SamplingParams", "sampling", "invalid_type")
        return cls(**{f.name: getattr(sp, f.name) for f in dataclasses.fields(cls) if hasattr(sp, f.name)})


FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(SamplingParams))
DEFAULTS: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(SamplingParams)}
