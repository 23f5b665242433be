"""Prompt log-probabilities on the driver (vLLM's `prompt_logprobs`): which prompt positions a step asks the ranks
for (`actors.prompt_logprobs.PromptLogprobsAsk`) and which sequence each answer belongs to.

A sequence that wants them (`Sequence.prompt_lp`, a list: one entry per prompt token after the first, in order)
collects them while its prompt is computed. Its prefix-cache reuse stops at the positions it already has entries
for (`engine.chunking`), so every position it still needs is computed by a step that asks for it, after a
preemption too. Only prefill rounds can ask (decode rows are past their prompts), so decode steps cost nothing.
An entry: (log-probability, rank (1 = the most likely id), top ids, top log-probabilities), of the raw logits.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from actors.prompt_logprobs import PromptLogprobs, PromptLogprobsAsk

PromptEntry = tuple[float, int, list[int], list[float]]


class PromptRowsError(RuntimeError):
    """A step's prompt log-probabilities do not match what it asked for."""


def build_ask(seqs: Sequence, hist: Sequence[int], q: Sequence[int]
              ) -> tuple[Optional[PromptLogprobsAsk], list[tuple[int, int]]]:
    """The ask of a step whose row i computes `seqs[i].token_ids[hist[i]:hist[i] + q[i]]`, and its owners: (row,
    positions) for each asking row, in ask order. (None, []) when no row needs any."""
    rows: list[int] = []
    targets: list[int] = []
    owners: list[tuple[int, int]] = []
    num_top = 0
    start = 0
    for i, (s, h, k) in enumerate(zip(seqs, hist, q)):
        have = s.prompt_lp
        if have is not None:
            c = len(have)
            hi = min(h + k, s.prompt_len - 1)  # position p predicts prompt token p + 1
            if c < hi:
                if h > c:
                    raise PromptRowsError(f"{s.request_id}: its step starts at {h}, after the {c} prompt positions "
                                          "it has log-probabilities for")
                rows.extend(range(start + c - h, start + hi - h))
                targets.extend(s.token_ids[c + 1:hi + 1])
                owners.append((i, hi - c))
                num_top = max(num_top, s.request.sampling.prompt_logprobs)
        start += k
    if not rows:
        return None, []
    return PromptLogprobsAsk(np.array(rows, np.int64), np.array(targets, np.int64), num_top), owners


def take_answers(seqs: Sequence, owners: list[tuple[int, int]], got: Optional[PromptLogprobs]) -> None:
    """Append each owner's entries from the step's answer `got` (keeping its request's number of top entries)."""
    want = sum(n for _, n in owners)
    if got is None or got.chosen.shape[0] != want:
        raise PromptRowsError(f"the step asked for {want} prompt log-probabilities and got "
                              f"{0 if got is None else got.chosen.shape[0]}")
    chosen, ranks = got.chosen.tolist(), got.ranks.tolist()
    top_ids, top_lps = got.top_ids.tolist(), got.top_logprobs.tolist()
    j = 0
    for i, n in owners:
        seq = seqs[i]
        k = seq.request.sampling.prompt_logprobs
        seq.prompt_lp.extend((chosen[r], ranks[r], top_ids[r][:k], top_lps[r][:k]) for r in range(j, j + n))
        j += n
