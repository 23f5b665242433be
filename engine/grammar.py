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
from typing import Any, Optional

import numpy as np


class GrammarViolation(RuntimeError):
    """A sampled token the grammar did not allow (the sampler ignored the mask): the sequence ends with an error."""


def mask_words(vocab_size: int) -> int:
    """int32 words of one row's token bitmask over `vocab_size` ids."""
    return (vocab_size + 31) // 32


FIRST, REASONING, CONSTRAINED = 0, 1, 2  # `GrammarState.phase` with a `ThinkGate` (without one: CONSTRAINED)


@dataclass(frozen=True)
class ThinkGate:
    """Reasoning-aware grammars (a chat with a reasoning parser): the grammar constrains only what follows the think
    block. `start` / `end`: the think tags' token ids; `open`: the prompt leaves the model inside a block (else its
    first token may open one: `<think>` or what the grammar allows first)."""

    start: int
    end: int
    open: bool


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
    think: Optional[ThinkGate] = None  # reasoning-aware: the grammar starts after the think block

    def start(self) -> "GrammarState":
        g = self.think
        return GrammarState(self.matcher.deep_copy(), g,
                            CONSTRAINED if g is None else REASONING if g.open else FIRST)


def fill_masks(mask: np.ndarray, rows: list[tuple[int, "GrammarState"]], executor: Any = None) -> None:
    """Fill row i of `mask` (int32 `[B, W]`, C-contiguous) with state's allowed tokens for each (i, state) of `rows`:
    on the `executor`'s threads (the library drops the GIL) when there are several rows and one is given, else one
    row after another. A row inside its think block allows every id; one that may still open it, also `<think>`."""
    if mask.dtype != np.int32 or mask.ndim != 2 or not mask.flags["C_CONTIGUOUS"]:
        raise ValueError("a grammar mask must be a contiguous int32 matrix")
    grammar_rows = [(i, st) for i, st in rows if st.phase != REASONING]
    if executor is None or len(grammar_rows) < 2:
        for i, state in grammar_rows:
            state.matcher.unsafe_compute_mask_ptr(mask[i].ctypes.data, mask[i].nbytes)
    else:
        executor.unsafe_compute_mask_ptr([(state.matcher, i) for i, state in grammar_rows], mask.ctypes.data,
                                         mask.shape[1] * 4, mask.shape[0])
    for i, state in rows:
        if state.phase == REASONING:
            mask[i] = -1
        elif state.phase == FIRST:
            t = state.think.start
            mask[i, t >> 5] |= np.int32(np.uint32(1 << (t & 31)).view(np.int32))


class GrammarState:
    """One sequence's position in its grammar (engine thread only)."""

    __slots__ = ("matcher", "think", "phase")

    def __init__(self, matcher: Any, think: Optional[ThinkGate] = None, phase: int = CONSTRAINED):
        self.matcher, self.think, self.phase = matcher, think, phase

    def fill(self, row: np.ndarray) -> None:
        """Write the allowed next tokens into `row` (int32 `[W]`, C-contiguous, e.g. a row of a fresh 2-D array)."""
        if row.dtype != np.int32 or row.ndim != 1 or not row.flags["C_CONTIGUOUS"]:
            raise ValueError("a grammar mask row must be a contiguous int32 vector")
        fill_masks(row[None, :], [(0, self)])

    def advance(self, token: int) -> bool:
        """Take the sampled `token`; True when the grammar is complete (only end-of-sequence may follow). Raises
        `GrammarViolation` for a token the grammar did not allow. Think tags move a gated state's phase."""
        if self.phase == FIRST:
            self.phase = CONSTRAINED
            if token == self.think.start:
                self.phase = REASONING
                return False
        elif self.phase == REASONING:
            if token == self.think.end:
                self.phase = CONSTRAINED
            return False
        m = self.matcher
        if not m.consume_token(int(token)):
            raise GrammarViolation(f"token {int(token)} is outside the grammar: {m.get_error()}")
        return m.is_stopped()
