"""Log-probabilities in the OpenAI shapes, from the engine's per-token entries (`RequestOutput.new_logprobs`:
(chosen logprob, top ids, top logprobs) per token, of the raw model distribution).

Completions (`logprobs: N`): `{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}`,
one entry per returned token; `text_offset` counts characters of the choice's text before the token.
Chat (`logprobs: true`, `top_logprobs: N`): `{"content": [{"token", "logprob", "bytes", "top_logprobs":
[{"token", "logprob", "bytes"}]}]}`. A token's string is its own decoding; without a tokenizer it is
`token_id:<id>` (as vLLM writes token ids).

A token's string depends on its id alone (`tokenizer.decode([id])`), so each tokenizer's strings (and their
UTF-8 bytes) are kept per id once decoded (`TokenTexts`): a step of B rows asking for N logprobs would otherwise
decode B * (N + 1) ids one call at a time.
"""
from __future__ import annotations

import weakref
from typing import Any, Optional, Sequence

from engine.logprob_rows import Entry  # (chosen logprob, top ids, top logprobs) of one token

# most ids a tokenizer's cache keeps (a vocabulary's worth); ids beyond it are decoded each time
MAX_CACHED_IDS = 1 << 18


def token_text(tokenizer: Any, token_id: int) -> str:
    """The string of one token id (uncached: `TokenTexts.text` is the cached one)."""
    if tokenizer is None:
        return f"token_id:{token_id}"
    return tokenizer.decode([token_id], skip_special_tokens=False)


class TokenTexts:
    """`token_text` of one tokenizer per id, decoded once: `text(id)` and `item(id)` = (text, its UTF-8 bytes).
    Lifetime: the tokenizer's (`for_tokenizer`); not thread-safe beyond what dict operations are (a race decodes
    an id twice, with the same result)."""

    __slots__ = ("tokenizer", "_items", "__weakref__")

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._items: dict[int, tuple[str, bytes]] = {}

    def item(self, token_id: int) -> tuple[str, bytes]:
        got = self._items.get(token_id)
        if got is None:
            s = token_text(self.tokenizer, token_id)
            got = (s, s.encode("utf-8"))
            if len(self._items) < MAX_CACHED_IDS:
                self._items[token_id] = got
        return got

    def text(self, token_id: int) -> str:
        got = self._items.get(token_id)
        return got[0] if got is not None else self.item(token_id)[0]


_BY_TOKENIZER: "weakref.WeakKeyDictionary[Any, TokenTexts]" = weakref.WeakKeyDictionary()


def for_tokenizer(tokenizer: Any) -> TokenTexts:
    """The `TokenTexts` of `tokenizer` (None: `token_id:<id>` strings), kept while the tokenizer lives; a tokenizer
    that cannot be weakly referenced gets a fresh one (cached for that call only)."""
    if tokenizer is None:
        tokenizer = _NoTokenizer
    try:
        texts = _BY_TOKENIZER.get(tokenizer)
        if texts is None:
            texts = _BY_TOKENIZER[tokenizer] = TokenTexts(None if tokenizer is _NoTokenizer else tokenizer)
        return texts
    except TypeError:  # not weakly referenceable, or unhashable
        return TokenTexts(tokenizer)


class _NoTokenizer:
    """The key of the `token_id:<id>` strings' cache."""


def completion_logprobs(tokenizer: Any, token_ids: Sequence[int], entries: Sequence[Entry],
                        text_start: int) -> dict:
    """The completions `logprobs` object of `token_ids` (their `entries`), the first starting at character
    `text_start` of the choice's text."""
    text = for_tokenizer(tokenizer).text
    toks, offsets, offset = [], [], text_start
    for t in token_ids:
        s = text(t)
        toks.append(s)
        offsets.append(offset)
        offset += len(s)
    return {"tokens": toks, "token_logprobs": [e[0] for e in entries],
            "top_logprobs": [_top(text, e) for e in entries], "text_offset": offsets}


def _top(text: Any, entry: Entry) -> dict:
    """{token text: logprob}, best first; tokens whose texts coincide keep the best one's value."""
    out: dict[str, float] = {}
    for i, lp in zip(entry[1], entry[2]):
        out.setdefault(text(i), lp)
    return out


def chat_logprobs(tokenizer: Any, token_ids: Sequence[int], entries: Sequence[Entry]) -> dict:
    item = for_tokenizer(tokenizer).item
    content = []
    for t, e in zip(token_ids, entries):
        top = []
        for i, lp in zip(e[1], e[2]):
            s, b = item(i)
            top.append({"token": s, "logprob": lp, "bytes": list(b)})
        s, b = item(t)
        content.append({"token": s, "logprob": e[0], "bytes": list(b), "top_logprobs": top})
    return {"content": content}


def merge(entries: list, more: Optional[list]) -> list:
    if more:
        entries.extend(more)
    return entries
