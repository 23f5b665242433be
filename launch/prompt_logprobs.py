"""A prompt's log-probabilities and echo in the response shapes (the engine's entries: `RequestOutput.prompt_logprobs`,
None for the first prompt token, then (logprob, rank, top ids, top logprobs) per token, of the raw logits).

- Completions' `echo: true` (OpenAI's legacy field, what lm-evaluation-harness' loglikelihood tasks send with
  `logprobs` and `max_tokens: 1`): the choice's text starts with the prompt's text; with `logprobs: N` its logprobs
  object starts with one entry per prompt token (the first token's `token_logprobs` and `top_logprobs` null), and
  the generated tokens' `text_offset`s count the prompt's text too.
- vLLM's `prompt_logprobs: k`: `[null, {"<token id>": {"logprob", "rank", "decoded_token"}}, ...]`, each dict the
  prompt token's entry and the k best ids' (a completion choice's `prompt_logprobs`; a chat response's top-level).
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

from launch.logprobs import completion_logprobs, for_tokenizer


def echo_text(tokenizer: Any, prompt: Sequence[int]) -> str:
    """The echoed prompt: its tokens' texts joined (so the logprobs' text offsets add up; no tokenizer: none)."""
    if tokenizer is None:
        return ""
    text = for_tokenizer(tokenizer).text
    return "".join(text(t) for t in prompt)


def echo_logprobs(tokenizer: Any, prompt: Sequence[int], entries: Optional[list], generated: Optional[dict]) -> dict:
    """The completions logprobs object of the echoed `prompt` (its `entries`, None when the engine returned none:
    every token's logprob null) followed by `generated`'s (the choice's own object, its offsets from the prompt's
    text on; None: no generated tokens)."""
    k = len(prompt)
    ents = list(entries) if entries is not None and len(entries) == k else [None] * k
    body = [(e[0], e[2], e[3]) if e is not None else (0.0, [], []) for e in ents]
    out = completion_logprobs(tokenizer, prompt, body, 0)
    out["token_logprobs"] = [None if e is None else v for e, v in zip(ents, out["token_logprobs"])]
    out["top_logprobs"] = [None if e is None else v for e, v in zip(ents, out["top_logprobs"])]
    if generated:
        shift = out["text_offset"][-1] + len(out["tokens"][-1]) if k else 0  # the echoed text's length
        for key in ("tokens", "token_logprobs", "top_logprobs"):
            out[key] = out[key] + generated[key]
        out["text_offset"] = out["text_offset"] + [o + shift for o in generated["text_offset"]]
    return out


def vllm_prompt_logprobs(tokenizer: Any, prompt: Sequence[int], entries: Optional[list]) -> Optional[list]:
    """vLLM's `prompt_logprobs` list (None when the engine returned none)."""
    if entries is None:
        return None
    text = for_tokenizer(tokenizer).text
    out: list[Optional[dict]] = []
    for t, e in zip(prompt, entries):
        if e is None:
            out.append(None)
            continue
        lp, rank, ids, lps = e
        d = {str(t): {"logprob": lp, "rank": rank, "decoded_token": text(t)}}
        for r, (i, v) in enumerate(zip(ids, lps), 1):
            d.setdefault(str(i), {"logprob": v, "rank": r, "decoded_token": text(i)})
        out.append(d)
    return out
