"""Shared helpers of the sampler tests: a batch of many rows with one row's parameters, and the reference
distribution of one logit vector computed independently in float64 from the definitions (vLLM order: bias and
bans, penalties, temperature, min-p, top-k, top-p on the renormalised rest)."""
from __future__ import annotations

import dataclasses

import numpy as np

from modeling.sampler import HostBatch, RowSpec, SamplerParams

CAPS = dict(max_bias=8, max_ban=4, max_penalty_tokens=16)


def tiled_params(spec: RowSpec, n: int, vocab: int, device: str = "cpu", vary: str = "position") -> SamplerParams:
    """A block of n rows with `spec`'s parameters; `vary` ("position" or "seed") runs over 0 .. n-1 (plus spec's)."""
    one = HostBatch.from_rows([spec], vocab_size=vocab, **CAPS)
    arrays = {k: np.repeat(getattr(one, k), n, axis=0) for k in {**HostBatch.SCALARS, **HostBatch.LISTS}}
    arrays[vary] = arrays[vary] + np.arange(n, dtype=np.int64)
    p = SamplerParams(n, device, **CAPS)
    p.load(HostBatch(**arrays, vocab_size=vocab))
    return p


def reference_probs(logits: np.ndarray, spec: RowSpec) -> np.ndarray:
    """float64 probabilities `[V]` of drawing each token (one-hot argmax for greedy rows)."""
    x = logits.astype(np.float64).copy()
    for tok, b in (spec.logit_bias or {}).items():
        x[tok] += b
    x[list(spec.banned_ids)] = -np.inf
    out = np.asarray(spec.output_token_ids, dtype=np.int64)
    counts = np.bincount(out, minlength=x.size) if out.size else np.zeros(x.size, np.int64)
    seen = counts > 0
    if spec.repetition_penalty != 1.0:
        rep = seen.copy()
        rep[np.asarray(spec.prompt_token_ids, dtype=np.int64)] = True
        r = spec.repetition_penalty
        x = np.where(rep, np.where(x > 0, x / r, x * r), x)
    x = x - spec.frequency_penalty * counts - spec.presence_penalty * seen
    if spec.temperature == 0:
        p = np.zeros_like(x)
        p[int(np.argmax(x))] = 1.0
        return p
    z = x / spec.temperature
    keep = np.isfinite(z)
    e = np.exp(z - z[keep].max())
    if spec.min_p > 0:
        keep &= e >= spec.min_p * e.max()
    if 0 < spec.top_k < x.size:
        kth = np.sort(np.where(keep, z, -np.inf))[::-1][spec.top_k - 1]
        keep &= z >= kth
    if spec.top_p < 1.0:
        w = np.where(keep, e, 0.0)
        w = w / w.sum()
        order = np.argsort(-w, kind="stable")
        cum = np.cumsum(w[order])
        cross = int(np.searchsorted(cum, spec.top_p))  # first prefix whose mass reaches p
        keep &= w >= w[order[cross]]
    p = np.where(keep, e, 0.0)
    return p / p.sum()


def with_seed(spec: RowSpec, seed: int) -> RowSpec:
    return dataclasses.replace(spec, seed=seed)
