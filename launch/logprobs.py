"""Log-probabilities in the OpenAI shapes, from the engine's per-token entries (`RequestOutput.new_logprobs`:
(chosen logprob, top ids, top logprobs) per token, of the raw model distribution).

Completions (`logprobs: N`): `{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}`,
one entry per returned token; `text_offset` counts characters of the choice's text before the token.
Chat (`logprobs: true`, `top_logprobs: N`): `{"content": [{"token", "logprob", "bytes", "top_logprobs":
[{"token", "logprob", "bytes"}]}]}`. A token's string is its own decoding; without a tokenizer it is
`token_id:<id>` (as vLLM writes token ids).
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

Entry = tuple[float, list[int], list[float]]


def token_text(tokenizer: Any, token_id: int) -> str:
    if tokenizer is None:
        return f"token_id:{token_id}"
    return tokenizer.decode([token_id], skip_special_tokens=False)


def completion_logprobs(tokenizer: Any, token_ids: Sequence[int], entries: Sequence[Entry],
                        text_start: int) -> dict:
    """The completions `logprobs` object of `token_ids` (their `entries`), the first starting at character
    `text_start` of the choice's text."""
    toks, offsets, offset = [], [], text_start
    for t in token_ids:
        s = token_text(tokenizer, t)
        toks.append(s)
        offsets.append(offset)
        offset += len(s)
    return {"tokens": toks, "token_logprobs": [e[0] for e in entries],
            "top_logprobs": [_top(tokenizer, e) for e in entries], "text_offset": offsets}


def _top(tokenizer: Any, entry: Entry) -> dict:
    """{token text: logprob}, best first; tokens whose texts coincide keep the best one's value."""
    out: dict[str, float] = {}
    for i, lp in zip(entry[1], entry[2]):
        out.setdefault(token_text(tokenizer, i), lp)
    return out


def chat_logprobs(tokenizer: Any, token_ids: Sequence[int], entries: Sequence[Entry]) -> dict:
    def item(t: int, lp: float) -> dict:
        s = token_text(tokenizer, t)
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

    return {"content": [{**item(t, e[0]), "top_logprobs": [item(i, lp) for i, lp in zip(e[1], e[2])]}
                        for t, e in zip(token_ids, entries)]}


def merge(entries: list, more: Optional[list]) -> list:
    if more:
        entries.extend(more)
    return entries
