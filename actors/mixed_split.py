"""A chunked-prefill step split into its two halves: the decode rows and the prefill rows (pure, host only).

The chunked scheduler (`engine.chunking`) sends one step per DP rank with every decoding sequence's one token
first, then the prompt chunks. Run as one step, the whole batch takes the token bucket's piecewise plan: the
decode rows lose their full decode graph, and each layer's attention boundary launches from Python for all of
them. Split, the leading rows of one new token each run as a decode step (a full decode graph and its LM head,
sampled or greedy) and the rest as a prefill step (a full prefill graph when one serves it, else its piecewise
plan), back to back on the rank's forward stream; the step's tokens are the two halves' in row order. The rows
are independent sequences, so their KV writes and draws (keyed by seed and position) do not depend on the
split. `actors.rank_decode.RankDecodeSteps` decides when the split applies (`RuntimeConfig.split_mixed_steps`).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

from actors.batch import StepBatch


def decode_prefix(batch: StepBatch) -> int:
    """How many leading rows of `batch` feed one token each (a prefill row of one token counts too: it is the
    same computation), when at least one row after them feeds more; 0 otherwise (no decode rows first, or every
    row decodes)."""
    q = batch.q_seqlens
    longer = np.flatnonzero(q != 1)
    return 0 if longer.size == 0 else int(longer[0])


def split_rows(batch: StepBatch, n: int) -> tuple[StepBatch, StepBatch]:
    """(rows [0, n), rows [n, B)) of `batch` as two `StepBatch`es of views, for `n = decode_prefix(batch) > 0`:
    the first holds one token per row, so its token ids are the first n. Sampler extras are not split (the
    caller does not split a batch that carries them)."""
    if batch.extras is not None:
        raise ValueError("split_rows: a batch with sampler extras is not split")
    if not 0 < n < batch.batch_size:
        raise ValueError(f"split_rows: n must be in (0, {batch.batch_size}), got {n}")

    def part(lo: int, hi: int, t_lo: int, t_hi: int) -> StepBatch:
        return dataclasses.replace(batch, token_ids=batch.token_ids[t_lo:t_hi], q_seqlens=batch.q_seqlens[lo:hi],
                                   num_history=batch.num_history[lo:hi], block_tables=batch.block_tables[lo:hi],
                                   temperature=batch.temperature[lo:hi], top_k=batch.top_k[lo:hi],
                                   top_p=batch.top_p[lo:hi], seeds=batch.seeds[lo:hi])

    b = batch.batch_size
    return part(0, n, 0, n), part(n, b, n, batch.num_tokens)


def splittable(batch: StepBatch, has_observer: bool, local_phase: bool, enabled: bool) -> Optional[int]:
    """The decode rows to split off (`decode_prefix`), or None when the step runs whole: the split is off, a
    logits observer wants the whole batch's logits, the step carries sampler extras (logprobs, penalties: one
    sampler pass per step), or the coordinator fixed the step's phase for collectives across DP groups
    (`local_phase` False: every DP rank must run the same graphs)."""
    if not enabled or has_observer or not local_phase or batch.extras is not None:
        return None
    n = decode_prefix(batch)
    return n or None
