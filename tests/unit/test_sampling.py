"""Sampling: greedy, seeded reproducibility independent of batch composition, top-k / top-p support."""
import pytest
import torch

from modeling.sampling import SamplingParams, SamplingParamsError, sample


def test_greedy_is_argmax():
    logits = torch.randn(5, 50)
    assert torch.equal(sample(logits, [SamplingParams()] * 5, [0] * 5), logits.argmax(-1))


def test_seeded_sampling_independent_of_batch():
    torch.manual_seed(0)
    logits = torch.randn(3, 100)
    p = SamplingParams(temperature=1.0, seed=7)
    together = sample(logits, [p, p, p], [4, 5, 6])
    alone = torch.stack([sample(logits[i : i + 1], [p], [4 + i])[0] for i in range(3)])
    assert torch.equal(together, alone)
    assert torch.equal(together, sample(logits, [p, p, p], [4, 5, 6]))


def test_top_k_and_top_p_restrict_support():
    logits = torch.tensor([[5.0, 4.0, 3.0, -1.0, -2.0]])
    seen_k, seen_p = set(), set()
    for s in range(200):
        seen_k.add(int(sample(logits, [SamplingParams(temperature=2.0, top_k=2, seed=s)], [0])[0]))
        seen_p.add(int(sample(logits, [SamplingParams(temperature=1.0, top_p=0.7, seed=s)], [0])[0]))
    assert seen_k == {0, 1}
    assert seen_p == {0, 1}  # p(0) = 0.66 < 0.7, so the nucleus is {0, 1}


@pytest.mark.parametrize("kw", [dict(temperature=-1), dict(top_k=-2), dict(top_p=0.0), dict(top_p=1.5)])
def test_bad_params(kw):
    with pytest.raises(SamplingParamsError):
        SamplingParams(**kw)
