"""The rarer per-row sampling inputs of a step (`actors.batch.SamplerExtras`), built from the sequences' requests.

A step carries extras only when a row needs one: min_p, a penalty, a logit bias, banned ids (the stop ids while a
request has fewer than `min_tokens` output tokens) or logprobs. Penalty inputs follow vLLM: repetition_penalty
over the distinct tokens of prompt and output, presence / frequency over the output tokens (their counts). Plain
numpy, no torch.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from actors.batch import SamplerExtras


def needs_extras(seq) -> bool:
    sp = seq.request.sampling
    return (sp.min_p > 0 or sp.presence_penalty != 0 or sp.frequency_penalty != 0 or sp.repetition_penalty != 1
            or bool(sp.logit_bias) or sp.logprobs is not None or _banned(seq) is not None)


def _banned(seq) -> Optional[list[int]]:
    sp = seq.request.sampling
    if sp.min_tokens and seq.num_output_tokens < sp.min_tokens and seq.stop_ids:
        return sorted(seq.stop_ids)
    return None


def _penalised(seq) -> tuple[np.ndarray, np.ndarray]:
    """(distinct token ids of prompt + output, their counts among the output tokens), int32."""
    sp = seq.request.sampling
    out = np.asarray(seq.token_ids[seq.prompt_len:], dtype=np.int64)
    ids, counts = np.unique(out, return_counts=True)
    if sp.repetition_penalty != 1:
        prompt_only = np.setdiff1d(np.asarray(seq.token_ids[:seq.prompt_len], dtype=np.int64), ids)
        ids = np.concatenate([ids, prompt_only])
        counts = np.concatenate([counts, np.zeros(len(prompt_only), dtype=counts.dtype)])
    return ids.astype(np.int32), counts.astype(np.int32)


def _padded(b: int, rows: dict[int, Sequence], dtype, fill) -> np.ndarray:
    """`[b, W]` of `fill` with row i starting with `rows[i]` (rows not given: none), W = max(1, longest row)."""
    width = max(1, max((len(r) for r in rows.values()), default=0))
    out = np.full((b, width), fill, dtype=dtype)
    for i, r in rows.items():
        if len(r):
            out[i, :len(r)] = r
    return out


def build_extras(seqs: Sequence) -> Optional[SamplerExtras]:
    """The step's `SamplerExtras` for `seqs` (batch order), or None when no row needs any. Once per step on the
    driver: one pass over the rows, the lists built only for the rows that have them."""
    if not any(needs_extras(s) for s in seqs):
        return None
    b = len(seqs)
    sps = [s.request.sampling for s in seqs]
    min_p = np.array([sp.min_p for sp in sps], np.float32)
    penalties = np.array([(sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty) for sp in sps],
                         np.float32).reshape(b, 3)
    bias_ids: dict[int, list] = {}
    bias_vals: dict[int, list] = {}
    bans: dict[int, list] = {}
    pen_ids: dict[int, np.ndarray] = {}
    pen_counts: dict[int, np.ndarray] = {}
    num_logprobs = -1
    for i, (seq, sp) in enumerate(zip(seqs, sps)):
        if sp.logit_bias:
            bias_ids[i] = [t for t, _ in sp.logit_bias]
            bias_vals[i] = [v for _, v in sp.logit_bias]
        if sp.min_tokens:
            banned = _banned(seq)
            if banned:
                bans[i] = banned
        if sp.presence_penalty != 0 or sp.frequency_penalty != 0 or sp.repetition_penalty != 1:
            pen_ids[i], pen_counts[i] = _penalised(seq)
        if sp.logprobs is not None and sp.logprobs > num_logprobs:
            num_logprobs = sp.logprobs
    return SamplerExtras(min_p, penalties, _padded(b, bias_ids, np.int32, -1), _padded(b, bias_vals, np.float32, 0.0),
                         _padded(b, bans, np.int32, -1), _padded(b, pen_ids, np.int32, -1),
                         _padded(b, pen_counts, np.int32, 0), num_logprobs)
