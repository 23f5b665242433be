"""The `StepBatch` of a list of scheduled rows: each row is one sequence's chunk of tokens after its history."""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from actors.batch import StepBatch
from engine.sampling_rows import build_extras
from engine.sequence import Sequence as Seq

_GREEDY_ROW = (0.0, 0, 1.0, -1)


def block_tables(seqs: Sequence[Seq]) -> np.ndarray:
    """int32 `[B, W]`: row i is `seqs[i].block_table`, zero-padded to the longest. From each sequence's cached array
    (`Seq.block_table_array`, made again only when its table changed), so a step costs one row copy per sequence,
    not a list conversion of its whole table (`python -m bench.block_tables`)."""
    rows = [s.block_table_array() for s in seqs]
    tables = np.zeros((len(rows), max(len(r) for r in rows)), dtype=np.int32)
    for i, r in enumerate(rows):
        tables[i, : len(r)] = r
    return tables


def build_batch(seqs: Sequence[Seq], hist: Sequence[int], q: Sequence[int],
                tokens: Optional[Sequence[int]] = None, mask_words: int = 0) -> StepBatch:
    """Row i feeds `seqs[i].token_ids[hist[i]:hist[i] + q[i]]` after `hist[i]` cached tokens (or, with `tokens`,
    one given token id per row, e.g. a previous-step reference, with every q 1). Block tables are the sequences'
    whole tables (they cover at least hist + q tokens; entries past a table's end are 0).

    Returns token_ids int64 `[sum(q)]`, q_seqlens / num_history int32 `[B]`, block_tables int32 `[B, W]`, and the
    sampling rows (temperature float32, top_k int32, top_p float32, seeds int64, each `[B]`; the rarer inputs in
    `extras` when a row needs them, `engine.sampling_rows`; `mask_words`: ceil(vocab / 32), the width of the
    `allowed_token_ids` masks)."""
    n = len(seqs)
    tables = block_tables(seqs)
    if tokens is None:
        if all(x == 1 for x in q):  # decode rows (and one-token chunks): one token each
            tokens = [s.token_ids[h] for s, h in zip(seqs, hist)]
        else:
            tokens = [t for s, h, k in zip(seqs, hist, q) for t in s.token_ids[h:h + k]]
    rows = [s.sampling_row for s in seqs]
    extras = build_extras(seqs, mask_words)
    if rows.count(_GREEDY_ROW) == n:  # every row greedy (with or without extras): no pass over the rows
        temperature, top_k, top_p = np.zeros(n, np.float32), np.zeros(n, np.int32), np.ones(n, np.float32)
        seeds = np.full(n, -1, np.int64)
    else:
        temps, ks, ps, ss = zip(*rows)
        temperature, top_k = np.array(temps, dtype=np.float32), np.array(ks, dtype=np.int32)
        top_p, seeds = np.array(ps, dtype=np.float32), np.array(ss, dtype=np.int64)
    return StepBatch(
        token_ids=np.array(tokens, dtype=np.int64), q_seqlens=np.array(q, dtype=np.int32),
        num_history=np.array(hist, dtype=np.int32), block_tables=tables, temperature=temperature, top_k=top_k,
        top_p=top_p, seeds=seeds, extras=extras,
    )
