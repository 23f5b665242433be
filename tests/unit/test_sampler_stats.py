"""Statistics of the torch sampler path (the kernels draw the same tokens bitwise: test_sampler_interpret.py).

For fixed logit vectors (peaked, flat, random; no near-ties at any threshold: checked) and parameter sets, 100k
draws (one batch of 100k rows, one seed, positions 0 .. 99999, so each row has its own Philox stream) are
compared with the float64 reference distribution of `_sampler_cases.reference_probs` by Pearson's chi-square:
p > 1e-3 per case (fixed seeds: the outcome is deterministic). Tokens outside the allowed set are never drawn.
"""
import numpy as np
import pytest
import torch
from scipy import stats

from modeling.sampler import RowSpec, SamplerVariant, sample
from tests.unit._sampler_cases import reference_probs, tiled_params

N = 100_000
V = 48
ALPHA = 1e-3


def _logits(kind: str) -> np.ndarray:
    g = np.random.default_rng({"peaked": 1, "flat": 2, "random": 3}[kind])
    if kind == "peaked":
        x = g.normal(0, 1, V) - np.arange(V) * 0.15
        x[7] += 6.0
    elif kind == "flat":
        x = g.uniform(-0.5, 0.5, V)
    else:
        x = g.normal(0, 2, V)
    return x.astype(np.float32)


CASES = {
    "peaked T=1": ("peaked", RowSpec(temperature=1.0, seed=11)),
    "flat T=2": ("flat", RowSpec(temperature=2.0, seed=12)),
    "random T=0.5": ("random", RowSpec(temperature=0.5, seed=13)),
    "random top_k=5": ("random", RowSpec(temperature=1.0, top_k=5, seed=14)),
    "flat top_k=20 T=1": ("flat", RowSpec(temperature=1.0, top_k=20, seed=15)),
    "peaked top_p=0.9": ("peaked", RowSpec(temperature=1.0, top_p=0.9, seed=16)),
    "random top_p=0.7 T=1.5": ("random", RowSpec(temperature=1.5, top_p=0.7, seed=17)),
    "random min_p=0.1": ("random", RowSpec(temperature=1.0, min_p=0.1, seed=18)),
    "random top_k+top_p+min_p": ("random", RowSpec(temperature=1.0, top_k=12, top_p=0.8, min_p=0.02, seed=19)),
    "peaked penalties + bias": ("peaked", RowSpec(temperature=1.0, seed=20, repetition_penalty=1.4,
                                                  frequency_penalty=0.3, presence_penalty=0.5,
                                                  prompt_token_ids=[7, 1, 2, 30], output_token_ids=[7, 7, 3, 40],
                                                  logit_bias={5: 2.5, 9: -1.0}, banned_ids=[0])),
}


def _check_no_near_ties(x: np.ndarray, spec: RowSpec) -> None:
    """The float64 reference and the sampler's fixed-point definitions agree unless a threshold is a near-tie."""
    p = reference_probs(x, RowSpec(temperature=spec.temperature, logit_bias=spec.logit_bias,
                                   banned_ids=spec.banned_ids, repetition_penalty=spec.repetition_penalty,
                                   frequency_penalty=spec.frequency_penalty, presence_penalty=spec.presence_penalty,
                                   prompt_token_ids=spec.prompt_token_ids, output_token_ids=spec.output_token_ids,
                                   min_p=spec.min_p, top_k=spec.top_k))
    if spec.top_p < 1:
        cum = np.cumsum(np.sort(p)[::-1])
        assert np.abs(cum - spec.top_p).min() > 1e-4, "top_p sits on a near-tie: pick other logits"
    if spec.min_p > 0:
        full = reference_probs(x, RowSpec(temperature=spec.temperature))
        assert np.abs(full / full.max() - spec.min_p).min() > 1e-4


def _draw(x: np.ndarray, spec: RowSpec, dtype=torch.float32) -> np.ndarray:
    params = tiled_params(spec, N, V)
    logits = torch.from_numpy(x).to(dtype).unsqueeze(0).expand(N, V)
    variant = SamplerVariant(processed=True, top_k=spec.top_k > 0, top_p=spec.top_p < 1)
    out = sample(logits, params, variant=variant)
    return np.bincount(out.tokens.numpy(), minlength=V)


def _chisquare(counts: np.ndarray, probs: np.ndarray) -> float:
    allowed = probs > 0
    assert counts[~allowed].sum() == 0, f"drew disallowed tokens {np.flatnonzero(counts * ~allowed)}"
    exp = probs[allowed] * counts.sum()
    obs = counts[allowed]
    small = exp < 5  # pool sparse cells so the chi-square approximation holds
    if small.any():
        exp = np.append(exp[~small], exp[small].sum())
        obs = np.append(obs[~small], obs[small].sum())
    if exp.size < 2:
        return 1.0
    return float(stats.chisquare(obs, exp).pvalue)


@pytest.mark.parametrize("name", list(CASES))
def test_draws_match_the_reference_distribution(name):
    kind, spec = CASES[name]
    x = _logits(kind)
    _check_no_near_ties(x, spec)
    probs = reference_probs(x, spec)
    pval = _chisquare(_draw(x, spec), probs)
    assert pval > ALPHA, f"{name}: chi-square p = {pval:.2e}"


def test_bf16_logits_match_the_reference_distribution():
    x = torch.from_numpy(_logits("random")).bfloat16()
    spec = RowSpec(temperature=1.0, top_p=0.85, seed=21)
    xr = x.float().numpy()
    _check_no_near_ties(xr, spec)
    pval = _chisquare(_draw(xr, spec, torch.bfloat16), reference_probs(xr, spec))
    assert pval > ALPHA, f"bf16: chi-square p = {pval:.2e}"


def test_the_chi_square_detects_a_wrong_temperature():
    """Power check: the same draws tested against T = 1.1 instead of 1 are rejected."""
    x = _logits("random")
    counts = _draw(x, RowSpec(temperature=1.0, seed=22))
    assert _chisquare(counts, reference_probs(x, RowSpec(temperature=1.1))) < 1e-6
