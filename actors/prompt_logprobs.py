"""Prompt log-probabilities across the process boundary (plain numpy, no torch): what a step asks for and what it
returns.

A prompt token t at position p (p >= 1) gets the log-probability the model gave it at position p - 1, from that
position's raw logits (vLLM's `prompt_logprobs`; OpenAI's `echo` with `logprobs`). A step whose rows compute prompt
positions that still lack entries carries a `PromptLogprobsAsk`: for each such position, its index in the step's
`token_ids` (its hidden state predicts the next token) and that next prompt token. The rank returns a
`PromptLogprobs` of the same length and order, with the driver's rows to match them back (`engine.prompt_rows`).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from actors.batch import MAX_LOGPROBS, BatchError

_I64 = np.dtype(np.int64)


class PromptLogprobsAsk(NamedTuple):
    """rows int64 `[M]`: indices into the step's `token_ids` (strictly increasing); targets int64 `[M]`: the token
    that follows each (the prompt token whose log-probability is wanted); num_top: how many top entries per
    position (0 .. MAX_LOGPROBS; 0: the target's only)."""

    rows: np.ndarray
    targets: np.ndarray
    num_top: int

    def validate(self, num_tokens: int, vocab_size: int) -> None:
        """Raise `BatchError` unless the rows index `num_tokens` tokens in order and the targets are token ids."""
        rows, targets = self.rows, self.targets
        if not isinstance(rows, np.ndarray) or not isinstance(targets, np.ndarray) or rows.dtype != _I64 \
                or targets.dtype != _I64 or rows.ndim != 1 or rows.shape != targets.shape or not rows.size:
            raise BatchError("prompt logprobs: rows and targets must be int64 vectors of one non-zero length")
        if int(rows[0]) < 0 or int(rows[-1]) >= num_tokens or (rows.size > 1 and int(np.diff(rows).min()) <= 0):
            raise BatchError(f"prompt logprobs: rows must increase within [0, {num_tokens})")
        if int(targets.min()) < 0 or int(targets.max()) >= vocab_size:
            raise BatchError(f"prompt logprobs: targets must be token ids in [0, {vocab_size})")
        if not 0 <= self.num_top <= MAX_LOGPROBS:
            raise BatchError(f"prompt logprobs: num_top must be in [0, {MAX_LOGPROBS}]")


class PromptLogprobs(NamedTuple):
    """A step's answer to its `PromptLogprobsAsk` (same M, same order), of the raw logits in float32: chosen `[M]`
    (each target's log-probability), ranks int32 `[M]` (1 + how many ids have a larger one), top_ids int32
    `[M, K]` and top_logprobs `[M, K]` (K = the ask's num_top, best first)."""

    chosen: np.ndarray
    ranks: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray
