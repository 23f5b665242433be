"""Incremental detokenisation of a growing list of generated token ids.

Offsets rather than re-decoding: each `push` decodes only a small window, `ids[prefix:]`, and emits
the part of it beyond the text of `ids[prefix:read]` (the window's already-emitted head, which gives
the decoder the left context it needs for spaces and merges). When the window's text ends in U+FFFD
(an incomplete UTF-8 sequence: a multi-byte character split across byte-level tokens) nothing is
emitted and the offsets stay, so the character comes out whole once its last byte arrives; a run of
more than `MAX_PENDING` undecodable tokens is emitted as it is (invalid bytes, not a split character).
The window is therefore bounded and the cost is O(1) amortised per token.

The text is that of the generated tokens alone (as `tokenizer.decode(generated_ids)`), without the
prompt as left context: byte-level BPE tokenizers (Qwen, GPT) carry their leading spaces in the token.
"""
from __future__ import annotations

from typing import Any, Iterable

REPLACEMENT = "\ufffd"


def backend_decoder(tokenizer: Any) -> Any:
    """The `tokenizers.Tokenizer` a fast transformers tokenizer decodes with, when its `decode` adds nothing to it
    (no `clean_up_tokenization_spaces`): called directly, a decode skips transformers' argument handling, most of
    a streamed token's detokenisation time (`python -m bench.chat_parsers`). None: decode through the tokenizer."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True) or not hasattr(backend, "decode"):
        return None
    return backend


class IncrementalDetokenizer:
    """Text deltas of one sequence's generated tokens. `push(ids)` -> newly complete text; `flush()` -> the
    rest (at the end of the sequence, an incomplete tail included)."""

    MAX_PENDING = 16

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._backend = backend_decoder(tokenizer)
        self.ids: list[int] = []
        self.prefix = 0  # window start: the decoder's left context
        self.read = 0  # everything before this has been emitted
        self._prefix_text = ""  # decode(ids[prefix:read])

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    @property
    def window(self) -> int:
        """Tokens the next decode covers beyond the new ones (bounded; exposed for tests)."""
        return len(self.ids) - self.prefix

    def push(self, new_ids: Iterable[int]) -> str:
        self.ids.extend(new_ids)
        if len(self.ids) == self.read:
            return ""
        text = self._decode(self.ids[self.prefix:])
        if text.endswith(REPLACEMENT) and len(self.ids) - self.read < self.MAX_PENDING:
            return ""  # an incomplete UTF-8 tail: wait for its last byte
        return self._advance(text)

    def flush(self) -> str:
        """The text not emitted yet (the sequence ended): an incomplete tail comes out as U+FFFD, as in a full
        decode."""
        if len(self.ids) == self.read:
            return ""
        return self._advance(self._decode(self.ids[self.prefix:]))

    def _advance(self, text: str) -> str:
        delta = text[len(self._prefix_text):] if text.startswith(self._prefix_text) else \
            self._resync(text)
        self.prefix, self.read = self.read, len(self.ids)
        self._prefix_text = self._decode(self.ids[self.prefix:self.read])
        return delta

    def _resync(self, text: str) -> str:
        """The window's head decodes differently with what followed (rare: a decoder that rewrites across
        tokens): emit what follows the longest common prefix."""
        n = 0
        for a, b in zip(text, self._prefix_text):
            if a != b:
                break
            n += 1
        return text[n:]
