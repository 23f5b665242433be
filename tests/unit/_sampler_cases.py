"""Shared helpers of the sampler tests: a batch of many rows with one row's parameters, and the reference
distribution of one logit vector computed independently in float64 from the definitions (vLLM order: bias and
bans, penalties, temperature, min-p, top-k, top-p on the renormalised rest)."""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from modeling.sampler import HostBatch, RowSpec, SamplerParams
from modeling.sampler import numerics as nx

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


def boundary_logits(v: int) -> torch.Tensor:
    """fp32 logits `[v]` (row max 0; for T = 1, top_p = 0.5) whose top-p target ceil(total / 2) is exactly the mass of
    the six tokens z = 0, -1, ..., -3 (the top mass bins down to the bin of -3): the crossing token is the last
    one of its bin. Below: tokens at z in [-6, -3.5] and a few of tiny mass (found by bisection over fp32 values)
    that make the mass below exactly equal the mass above; every other token at -40 (mass 0); ids shuffled."""
    def q(z: torch.Tensor) -> torch.Tensor:
        return nx.mass(z.reshape(1, -1), torch.zeros(1), torch.ones(1, z.numel(), dtype=torch.bool))[0]

    upper = torch.tensor([0.0, -1.0, -1.5, -2.0, -2.5, -3.0])
    want = int(q(upper).sum())
    lower = []
    for z in torch.linspace(-3.5, -6.0, 400).tolist():
        if int(q(torch.tensor(lower + [z])).sum()) <= want:
            lower.append(z)
    lo_bits = torch.tensor([-3.5]).view(torch.int32).item()  # negative floats: larger bits = smaller value
    hi_bits = torch.tensor([-23.0]).view(torch.int32).item()
    gap = want - int(q(torch.tensor(lower)).sum())
    while gap > 0:  # the largest z in [-23, -3.5] whose mass fits the gap (masses fall with z)
        a, b = lo_bits, hi_bits
        while a < b:
            mid = (a + b) // 2
            if int(q(torch.tensor([mid], dtype=torch.int32).view(torch.float32))) <= gap:
                b = mid
            else:
                a = mid + 1
        z = torch.tensor([a], dtype=torch.int32).view(torch.float32)
        lower.append(float(z))
        gap -= int(q(z))
    vals = torch.cat([upper, torch.tensor(lower)])
    assert vals.numel() <= v and int(q(vals).sum()) == 2 * want
    x = torch.full((v,), -40.0)
    x[torch.randperm(v, generator=torch.Generator().manual_seed(v))[: vals.numel()]] = vals
    return x
