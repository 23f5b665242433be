"""The rarer per-row sampling inputs of a step (`actors.batch.SamplerExtras`), built from the sequences' requests.

A step carries extras only when a row needs one: min_p, a penalty, a logit bias, banned ids (the stop ids while a
request has fewer than `min_tokens` output tokens), logprobs, or an allowed-token bitmask (int32 words, bit j % 32 of
word j // 32 = id j): a grammar's next tokens (`engine.grammar`) and / or the request's `allowed_token_ids`, ANDed;
the other rows of that step allow every id. Penalty inputs follow vLLM:
repetition_penalty over the distinct tokens of prompt and output, presence / frequency over the output tokens (their
counts). Plain numpy, no torch.

Which of these a request uses is fixed with its `SamplingParams`: `extras_flags` sums it up once per sequence
(`Sequence.extras_flags`), so that a step's rows are checked with one int each, and a step whose rows only ask for
logprobs builds its arrays without a pass over their parameters.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Optional, Sequence

import numpy as np

from actors.batch import SamplerExtras
from engine.grammar import fill_masks
from engine.sampling_params import BAD_WORD_MAX_TOKENS

# `extras_flags` bits: a row with MIN_P, PENALTY, BIAS, LOGPROBS, GRAMMAR, BAD_WORDS or ALLOWED always needs extras
# (bad words' bans depend on the last token, so their rows take one step at a time); one with MIN_TOKENS only while it
# has fewer output tokens than min_tokens and stop ids to ban (`_banned`). Above the bits (FLAG_BITS),
# the request's logprobs + 1 (0: none), so that the largest flags of a step's rows carry its largest logprobs.
MIN_P, PENALTY, BIAS, LOGPROBS, MIN_TOKENS, GRAMMAR, BAD_WORDS, ALLOWED = 1, 2, 4, 8, 16, 32, 64, 128
FLAG_BITS = 8
ALWAYS = MIN_P | PENALTY | BIAS | LOGPROBS | GRAMMAR | BAD_WORDS | ALLOWED
_MASKS = GRAMMAR | ALLOWED  # rows with an allowed-token bitmask
_BANS = MIN_TOKENS | BAD_WORDS
_LISTS = PENALTY | BIAS | _BANS  # rows with per-row lists


def extras_flags(sp, grammar: bool = False) -> int:
    """The `SamplingParams`' use of sampler extras as bits (and GRAMMAR for a constrained request), with its
    logprobs + 1 above them (min_p and penalties compare by value: -0.0 is off)."""
    return (GRAMMAR if grammar else 0) | ((MIN_P if sp.min_p > 0 else 0)
            | (PENALTY if sp.presence_penalty != 0 or sp.frequency_penalty != 0 or sp.repetition_penalty != 1 else 0)
            | (BIAS if sp.logit_bias else 0) | (LOGPROBS if sp.logprobs is not None else 0)
            | (MIN_TOKENS if sp.min_tokens else 0) | (BAD_WORDS if sp.bad_words else 0)
            | (ALLOWED if sp.allowed_token_ids is not None else 0)
            | (0 if sp.logprobs is None else sp.logprobs + 1) << FLAG_BITS)


def needs_extras(seq) -> bool:
    """Whether `seq`'s row of a step needs sampler extras this step."""
    f = seq.extras_flags
    return bool(f & ALWAYS) or (bool(f & MIN_TOKENS) and _banned(seq) is not None)


def _banned(seq) -> Optional[list[int]]:
    """The ids `seq` may not draw next: its stop ids before `min_tokens`, and the last id of every bad word whose
    other ids end its output (None: none)."""
    sp = seq.request.sampling
    out = set(seq.stop_ids) if sp.min_tokens and seq.num_output_tokens < sp.min_tokens else set()
    if sp.bad_words:
        n = seq.num_output_tokens
        tail = seq.token_ids[len(seq.token_ids) - min(n, BAD_WORD_MAX_TOKENS - 1):] if n else []
        for w in sp.bad_words:
            k = len(w) - 1
            if k == 0 or (k <= len(tail) and tuple(tail[len(tail) - k:]) == w[:k]):
                out.add(w[-1])
    return sorted(out) if out else None


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


def build_extras(seqs: Sequence, mask_words: int = 0) -> Optional[SamplerExtras]:
    """The step's `SamplerExtras` for `seqs` (batch order), or None when no row needs any. `mask_words`: the
    allowed-token bitmask's width, ceil(vocab / 32) (needed when a row has `allowed_token_ids`). Once per step on the
    driver: the rows' `extras_flags` decide which arrays come from the rows' parameters and which rows build lists;
    an array no row sets is the off value (min_p 0, penalties (0, 0, 1), lists of one unused column), read-only and
    shared by every step of that batch size (`SamplerExtras.off`: a logprobs-only step's extras are that, whole)."""
    flags = [s.extras_flags for s in seqs]
    union = 0
    for f in set(flags):
        union |= f
    union &= (1 << FLAG_BITS) - 1
    if not union & ALWAYS and not (union & MIN_TOKENS and any(needs_extras(s) for s in seqs)):
        return None
    b = len(seqs)
    num_logprobs = (max(flags) >> FLAG_BITS) - 1  # the rows' largest logprobs (-1: none asks)
    off = SamplerExtras.off(b, num_logprobs)
    if not union & (MIN_P | _LISTS | _MASKS):  # logprobs only: every array off
        return off
    allow = _allowed(seqs, flags, mask_words) if union & _MASKS else None
    off = (off.min_p, off.penalties, off.bias_ids, off.bias_vals, off.ban_ids, off.pen_ids, off.pen_counts)
    if union & MIN_P:
        min_p = np.array([s.request.sampling.min_p for s in seqs], np.float32)
    else:
        min_p = off[0]
    if union & PENALTY:
        penalties = np.array([(sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty)
                              for sp in (s.request.sampling for s in seqs)], np.float32).reshape(b, 3)
    else:
        penalties = off[1]
    bias_ids: dict[int, list] = {}
    bias_vals: dict[int, list] = {}
    bans: dict[int, list] = {}
    pen_ids: dict[int, np.ndarray] = {}
    pen_counts: dict[int, np.ndarray] = {}
    if union & _LISTS:
        for i, (seq, f) in enumerate(zip(seqs, flags)):
            if not f & _LISTS:
                continue
            sp = seq.request.sampling
            if f & BIAS:
                bias_ids[i] = [t for t, _ in sp.logit_bias]
                bias_vals[i] = [v for _, v in sp.logit_bias]
            if f & _BANS:
                banned = _banned(seq)
                if banned:
                    bans[i] = banned
            if f & PENALTY:
                pen_ids[i], pen_counts[i] = _penalised(seq)
    lists = [_padded(b, rows, dtype, fill) if rows else off[k] for k, (rows, dtype, fill) in enumerate(
        ((bias_ids, np.int32, -1), (bias_vals, np.float32, 0.0), (bans, np.int32, -1), (pen_ids, np.int32, -1),
         (pen_counts, np.int32, 0)), 2)]
    return SamplerExtras(min_p, penalties, *lists, num_logprobs, allow_bits=allow)


def _allowed(seqs: Sequence, flags: list[int], mask_words: int) -> np.ndarray:
    """The step's `SamplerExtras.allow_bits`: int32 `[B, W]`, each constrained row its grammar's next tokens ANDed
    with its `allowed_token_ids`, the other rows every id (-1 words)."""
    rows = [(i, s) for i, (s, f) in enumerate(zip(seqs, flags)) if f & GRAMMAR]
    words = rows[0][1].request.grammar.words if rows else mask_words
    if words <= 0:
        raise ValueError("a row has allowed_token_ids but the step's mask width (ceil(vocab / 32)) is unknown")
    allow = np.full((len(seqs), words), -1, np.int32)
    if rows:
        fill_masks(allow, [(i, s.grammar) for i, s in rows], rows[0][1].request.grammar.executor)
    for i, (s, f) in enumerate(zip(seqs, flags)):
        if f & ALLOWED:
            allow[i] &= allowed_words(s.request.sampling.allowed_token_ids, words)
    return allow


@lru_cache(maxsize=256)
def allowed_words(ids: tuple[int, ...], words: int) -> np.ndarray:
    """The bitmask of `ids` (sorted, distinct, each < 32 * words): int32 `[words]`, read-only (shared by every step
    of the requests that send the same ids)."""
    a = np.asarray(ids, dtype=np.int64)
    bits = np.zeros(words, dtype=np.uint32)
    np.bitwise_or.at(bits, a >> 5, (np.uint32(1) << (a & 31).astype(np.uint32)))
    out = bits.view(np.int32)
    out.flags.writeable = False
    return out
