"""Grammar-constrained generation on the driver: which tokens a sequence may draw next, step by step.

A request may carry a `TokenGrammar` (built by the HTTP layer from `response_format`, `launch.structured`): a compiled
token matcher of the llguidance library (`llguidance.LLMatcher`), never advanced itself, and the width of the token
bitmask. Each sequence of such a request starts its own `GrammarState` from it (a deep copy, so `n > 1` samples
advance independently). Per step, on the engine thread:
- `fill(row)` writes the allowed tokens into the sequence's row of the step's `SamplerExtras.allow_bits` (int32
  `[W]`, W = ceil(V / 32), bit j % 32 of word j // 32 = token j allowed; `engine.sampling_rows.build_extras`);
- `advance(token)` takes the sampled token when the scheduler appends it (`Scheduler.update`) and says whether the
  grammar is now complete (nothing but end-of-sequence may follow), which finishes the sequence with reason `stop`.

Rows with a grammar need sampler extras, so their steps are one-step rounds, never scheduled ahead: the mask of step
k + 1 needs step k's token on the host. Preemption keeps the state (the tokens are recomputed, not sampled again).
Plain Python over the library's matcher; no torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


class GrammarViolation(RuntimeError):
    """A sampled token the grammar did not allow (the sampler ignored the mask): the sequence ends with an error."""


def mask_words(vocab_size: int) -> int:
    """int32 words of one row's token bitmask over `vocab_size` ids."""
    return (vocab_size + 31) // 32


@dataclass(frozen=True, eq=False)
class TokenGrammar:
    """A request's compiled constraint. `matcher`: an `llguidance.LLMatcher` over the model's vocabulary (ids past
    the tokenizer's are never allowed), at its start state and never advanced (each sequence copies it); `words`:
    `mask_words(vocab_size)`; `kind`: what the client asked for (e.g. "json_schema"), for logs and status;
    `executor`: shared by the grammars of one compiler (`fill_masks`)."""

    matcher: Any
    words: int
    kind: str
    executor: Any = None  # an `llguidance.LLExecutor` (a thread pool) that fills several rows at once; None: serial

    def start(self) -> "GrammarState":
        return GrammarState(self.matcher.deep_copy())


def fill_masks(mask: np.ndarray, rows: list[tuple[int, "GrammarState"]], executor: Any = None) -> None:
    """Fill row i of `mask` (int32 `[B, W]`, C-contiguous) with state's allowed tokens for each (i, state) of `rows`:
    on the `executor`'s threads (the library drops the GIL) when there are several rows and one is given, else one
    row after another."""
    if mask.dtype != np.int32 or mask.ndim != 2 or not mask.flags["C_CONTIGUOUS"]:
        raise ValueError("a grammar mask must be a contiguous int32 matrix")
    if executor is None or len(rows) < 2:
        for i, state in rows:
            state.fill(mask[i])
        return
    executor.unsafe_compute_mask_ptr([(state.matcher, i) for i, state in rows], mask.ctypes.data,
                                     mask.shape[1] * 4, mask.shape[0])


class GrammarState:
    """One sequence's position in its grammar (engine thread only)."""

    __slots__ = ("matcher",)

    def __init__(self, matcher: Any):
        self.matcher = matcher

    def fill(self, row: np.ndarray) -> None:
        """Write the allowed next tokens into `row` (int32 `[W]`, C-contiguous, e.g. a row of a fresh 2-D array)."""
        if row.dtype != np.int32 or row.ndim != 1 or not row.flags["C_CONTIGUOUS"]:
            raise ValueError("a grammar mask row must be a contiguous int32 vector")
        self.matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    def advance(self, token: int) -> bool:
        """Take the sampled `token`; True when the grammar is complete (only end-of-sequence may follow). Raises
        `GrammarViolation` for a token the grammar did not allow."""
        m = self.matcher
        if not m.consume_token(int(token)):
            raise GrammarViolation(f"token {int(token)} is outside the grammar: {m.get_error()}")
        return m.is_stopped()
