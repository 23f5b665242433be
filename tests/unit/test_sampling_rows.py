"""`engine.sampling_rows.build_extras` (one pass, lists only for the rows that have them) builds exactly the
`SamplerExtras` of its per-row construction (kept here as the reference), for any mix of rows."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from actors.batch import SamplerExtras
from engine import Request, SamplingParams
from engine.sampling_rows import _banned, _penalised, build_extras, needs_extras
from engine.sequence import Sequence


def _padded(rows, dtype, fill) -> np.ndarray:
    width = max(1, max((len(r) for r in rows), default=0))
    out = np.full((len(rows), width), fill, dtype=dtype)
    for i, r in enumerate(rows):
        if len(r):
            out[i, :len(r)] = r
    return out


def _per_row_extras(seqs):
    """`build_extras` as it was: every row's every list, one row at a time."""
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


def _random_sampling(rng) -> SamplingParams:
    kind = rng.integers(0, 8)
    kw = {}
    if kind == 1:
        kw["logprobs"] = int(rng.integers(0, 21))
    elif kind == 2:
        kw.update(min_p=float(rng.choice([0.05, 0.3333333])), logprobs=5)
    elif kind == 3:
        kw.update(presence_penalty=0.7, frequency_penalty=-0.3)
    elif kind == 4:
        kw.update(repetition_penalty=1.15)
    elif kind == 5:
        kw["logit_bias"] = {int(t): float(v) for t, v in zip(rng.choice(500, 3, replace=False), [2.5, -100.0, 0.1])}
    elif kind == 6:
        kw["min_tokens"] = int(rng.integers(1, 6))
    elif kind == 7:
        kw["bad_words"] = [rng.integers(1, 500, int(rng.integers(1, 4))).tolist() for _ in range(3)]
        kw["min_tokens"] = int(rng.integers(0, 3))
    return SamplingParams(temperature=float(rng.choice([0.0, 0.8])), **kw)


@pytest.mark.parametrize("seed", range(8))
def test_build_extras_equals_the_per_row_construction(seed):
    rng = np.random.default_rng(seed)
    for b in (1, 3, 64):
        seqs = []
        for _ in range(b):
            stop = tuple(int(x) for x in rng.choice(500, int(rng.integers(0, 3)), replace=False))
            req = Request.make(rng.integers(1, 500, 6).tolist(), _random_sampling(rng), max_tokens=50,
                               stop_token_ids=stop)
            seq = Sequence(req)
            seq.token_ids += rng.integers(1, 500, int(rng.integers(0, 8))).tolist()
            seqs.append(seq)
        got, want = build_extras(seqs), _per_row_extras(seqs)
        assert (got is None) == (want is None)
        if want is None:
            continue
        assert got.num_logprobs == want.num_logprobs and got.allow_bits is want.allow_bits is None
        for f in dataclasses.fields(SamplerExtras):
            if f.name not in ("num_logprobs", "allow_bits"):
                a, w = getattr(got, f.name), getattr(want, f.name)
                assert a.dtype == w.dtype and a.shape == w.shape and a.tobytes() == w.tobytes(), f.name


@pytest.mark.parametrize("seed", range(6))
def test_bad_words_ban_the_last_id_after_the_others(seed):
    """`_banned` against a brute-force reading of vLLM's rule: a bad word's last id is banned when the output
    (never the prompt) ends with its other ids; a one-id word always; with the stop ids before `min_tokens`."""
    rng = np.random.default_rng(seed)
    words = [[7], [3, 4], [4, 3, 5], [9, 9]] + [rng.integers(1, 10, int(rng.integers(1, 4))).tolist() for _ in range(3)]
    for n_out in range(0, 12):
        prompt = [3, 4, 4, 3, 9]  # ends with prefixes of the words: the prompt must not count
        req = Request.make(prompt, SamplingParams(bad_words=words, min_tokens=4), max_tokens=50, stop_token_ids=(2,))
        seq = Sequence(req)
        out = rng.integers(1, 10, n_out).tolist()
        seq.token_ids += out
        want = {w[-1] for w in words if len(w) == 1 or (len(out) >= len(w) - 1 and out[len(out) - len(w) + 1:] ==
                                                       w[:-1])}
        want |= {2} if n_out < 4 else set()
        assert set(_banned(seq) or ()) == want, (out, words)
        assert needs_extras(seq)  # bad words' rows always take sampler extras (one step at a time)
