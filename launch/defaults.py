"""Generation defaults: what a request's omitted fields take (e.g. the values of the checkpoint's
`generation_config.json`), validated once when the server state is built.

Recognised keys: the sampling fields `temperature`, `top_p`, `top_k`, `min_p`, `presence_penalty`,
`frequency_penalty`, `repetition_penalty`; `max_tokens` (or `max_new_tokens`); `eos_token_id` (an
id or a list: generation stops at them unless a request sets `ignore_eos`). A sampling default the
engine does not apply yet (`engine.sampling_params.ENGINE_APPLIES`) is not in force unless it is
the neutral value; it and any other key (`do_sample`, `bos_token_id`, ...) are listed in `ignored`.
An explicit request value always overrides a default.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

from engine.errors import RequestError
from engine.sampling_params import DEFAULTS, ENGINE_APPLIES, INT32_MAX, SamplingParams, check_int

SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty")


class GenerationDefaultsError(ValueError):
    """A generation default is out of range (a start-up error, not a request error)."""


class GenerationDefaults:
    def __init__(self, raw: Optional[Mapping[str, Any]] = None):
        self.sampling: dict[str, Any] = {}
        self.max_tokens: Optional[int] = None
        self.eos_token_ids: tuple[int, ...] = ()
        self.ignored: dict[str, Any] = {}
        for key, value in dict(raw or {}).items():
            try:
                self._take(str(key), value)
            except RequestError as exc:
                raise GenerationDefaultsError(f"generation default {key!r}: {exc}") from None

    def _take(self, key: str, value: Any) -> None:
        if value is None:
            return
        if key in SAMPLING_KEYS:
            normalised = getattr(SamplingParams(**{key: value}), key)
            if key in ENGINE_APPLIES or normalised == DEFAULTS[key]:
                self.sampling[key] = normalised
            else:
                self.ignored[key] = value
        elif key in ("max_tokens", "max_new_tokens"):
            self.max_tokens = check_int(key, value, 1, INT32_MAX)
        elif key == "eos_token_id":
            ids = value if isinstance(value, list) else [value]
            self.eos_token_ids = tuple(dict.fromkeys(check_int(key, t, 0, INT32_MAX) for t in ids))
        else:
            self.ignored[key] = value

    def in_force(self) -> dict[str, Any]:
        """The defaults requests get (shown by /v1/models)."""
        out: dict[str, Any] = dict(self.sampling)
        if self.max_tokens is not None:
            out["max_tokens"] = self.max_tokens
        if self.eos_token_ids:
            out["eos_token_id"] = list(self.eos_token_ids)
        return out
