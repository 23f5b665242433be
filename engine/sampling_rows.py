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


def _padded(rows: Sequence[Sequence], dtype, fill) -> np.ndarray:
    width = max(1, max((len(r) for r in rows), default=0))
    out = np.full((len(rows), width), fill, dtype=dtype)
    for i, r in enumerate(rows):
        if len(r):
            out[i, :len(r)] = r
    return out


def build_extras(seqs: Sequence) -> Optional[SamplerExtras]:
    """The step's `SamplerExtras` for `seqs` (batch order), or None when no row needs any."""
    if not any(needs_extras(s) for s in seqs):
        return None
    b = len(seqs)
    min_p = np.zeros(b, np.float32)
    penalties = np.tile(np.array([0.0, 0.0, 1.0], np.float32), (b, 1))
    bias_ids, bias_vals, bans, pen_ids, pen_counts = [], [], [], [], []
    num_logprobs = -1
    for i, seq in enumerate(seqs):
        sp = seq.request.sampling
        min_p[i] = sp.min_p
        penalties[i] = (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty)
        bias_ids.append([t for t, _ in sp.logit_bias])
        bias_vals.append([v for _, v in sp.logit_bias])
        bans.append(_banned(seq) or [])
        if sp.presence_penalty != 0 or sp.frequency_penalty != 0 or sp.repetition_penalty != 1:
            ids, counts = _penalised(seq)
        else:
            ids, counts = np.zeros(0, np.int32), np.zeros(0, np.int32)
        pen_ids.append(ids)
        pen_counts.append(counts)
        if sp.logprobs is not None:
            num_logprobs = max(num_logprobs, sp.logprobs)
    return SamplerExtras(min_p, penalties, _padded(bias_ids, np.int32, -1), _padded(bias_vals, np.float32, 0.0),
                         _padded(bans, np.int32, -1), _padded(pen_ids, np.int32, -1), _padded(pen_counts, np.int32, 0),
                         num_logprobs)
