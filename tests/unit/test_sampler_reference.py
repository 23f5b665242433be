"""The torch sampler path: counter-based noise (Philox known-answer vectors, reproducible whatever the batch and
row), logprobs of the raw logits, greedy rows, exact radix thresholds (ties kept), log / exp accuracy."""
import numpy as np
import pytest
import torch

from modeling.sampler import HostBatch, RowSpec, SamplerParams, SamplerVariant, sample
from modeling.sampler import numerics as nx
from modeling.sampler.collectives import ShardGroup
from modeling.sampler.reference import radix_select
from tests.unit._sampler_cases import CAPS

V = 3000


def _params(rows, device="cpu"):
    p = SamplerParams(len(rows), device, **CAPS)
    p.load(HostBatch.from_rows(rows, vocab_size=V, **CAPS))
    return p


def _logits(b, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, V, generator=g) * 3).to(dtype)


def test_philox_known_answers():
    """Random123's kat_vectors for philox4x32_10."""
    t = lambda *v: [torch.tensor([x], dtype=torch.int64) for x in v]  # noqa: E731
    cases = [((0, 0, 0, 0, 0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
             ((0xFFFFFFFF,) * 6, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
             ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344, 0xA4093822, 0x299F31D0),
              (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]
    for args, want in cases:
        assert tuple(int(w) for w in nx.philox4x32(*t(*args))) == want


def test_log_and_exp_are_accurate():
    x = torch.cat([torch.rand(200_000) * 0.999 + 1e-7, torch.tensor([2.0 ** -24, 1 - 2.0 ** -24, 0.5, 22.0])])
    rel = ((nx.plog(x).double() - x.double().log()) / x.double().log().abs()).abs()
    assert rel.max() < 3e-7
    y = -torch.rand(200_000) * 23
    assert ((nx.pexp(y).double() / y.double().exp()) - 1).abs().max() < 3e-7
    assert nx.pexp(torch.zeros(1)).item() == 1.0


def test_keys_order_floats_and_pack_breaks_ties_by_lowest_id():
    x = torch.tensor([float("-inf"), -3.5, -0.0, 0.0, 1e-30, 2.0, float("inf")])
    k = nx.ordered_key(x)
    assert (k[1:] >= k[:-1]).all() and k[2] == k[3] and k[0] == nx.KEY_NEG_INF
    assert torch.equal(nx.key_to_float(k)[[0, 1, 4, 5, 6]], x[[0, 1, 4, 5, 6]])
    p = nx.pack(torch.tensor([1.0, 1.0, 0.5]), torch.tensor([7, 3, 1]))
    assert p.argmax().item() == 1 and nx.unpack_id(p).tolist() == [7, 3, 1]


def test_same_seed_and_position_draw_the_same_token_in_any_batch_and_row():
    target = RowSpec(temperature=1.0, top_p=0.95, top_k=200, seed=987654321, position=4242)
    g = np.random.default_rng(5)
    logits_row = _logits(1, seed=9)
    tokens = set()
    for b in (1, 8, 64):
        for idx in {0, b // 2, b - 1}:
            rows = [RowSpec(temperature=float(g.uniform(0.3, 2)), seed=int(g.integers(1 << 40)),
                            position=int(g.integers(1 << 20)), top_p=0.9) for _ in range(b)]
            rows[idx] = target
            logits = _logits(b, seed=b * 31 + idx)
            logits[idx] = logits_row[0]
            for variant in (SamplerVariant(top_k=True, top_p=True), SamplerVariant.full()):
                tokens.add(int(sample(logits, _params(rows), variant=variant).tokens[idx]))
    assert len(tokens) == 1


def test_noise_is_per_global_token_id():
    """Shards see the same noise for the same global ids (TP), whatever the shard's start (not 4-aligned too)."""
    seed, pos = torch.tensor([12345, -7]), torch.tensor([99, 1 << 40])
    full = nx.gumbel(seed, pos, 0, 1000)
    for start, width in ((0, 1000), (1, 7), (333, 401), (998, 2)):
        assert torch.equal(nx.gumbel(seed, pos, start, width), full[:, start: start + width])
    assert not torch.equal(nx.gumbel(seed, pos + 1, 0, 1000), full)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-5)])
def test_logprobs_are_of_the_raw_logits(dtype, tol):
    rows = [RowSpec(temperature=0.7, top_k=5, seed=1, logit_bias={3: 10.0}, banned_ids=[int(i)])
            for i in range(6)] + [RowSpec(repetition_penalty=1.5, prompt_token_ids=[1, 2])]
    logits = _logits(len(rows), seed=3, dtype=dtype)
    out = sample(logits, _params(rows), num_logprobs=20)
    ref = torch.log_softmax(logits.float(), dim=-1)
    assert torch.allclose(out.chosen_logprob, ref.gather(1, out.tokens[:, None]).squeeze(1), atol=tol, rtol=0)
    assert out.top_ids.dtype == torch.int64 and out.top_logprobs.dtype == torch.float32
    for r in range(len(rows)):  # descending logprob, lower id first on ties (bf16 has many)
        order = np.lexsort((np.arange(V), -logits[r].float().numpy()))[:20]
        assert out.top_ids[r].tolist() == order.tolist()
        assert torch.allclose(out.top_logprobs[r], ref[r, order], atol=tol, rtol=0)
    none = sample(logits, _params(rows))
    assert none.top_ids.shape == (len(rows), 0) and torch.equal(none.tokens, out.tokens)


def test_greedy_rows_are_the_argmax_of_the_processed_logits():
    rows = [RowSpec(), RowSpec(logit_bias={11: 50.0}), RowSpec(banned_ids=[0, 1, 2]),
            RowSpec(top_k=3, top_p=0.1, min_p=0.5), RowSpec(repetition_penalty=3.0, frequency_penalty=1.0,
                                                          output_token_ids=[5, 6])]
    logits = _logits(len(rows), seed=4)
    logits[2, :3] = 100.0
    logits[4, 5] = logits[4, 6] = 12.0  # the max before the penalty, 12 / 3 - 1 = 3 after it
    out = sample(logits, _params(rows)).tokens
    assert out[0] == logits[0].argmax() and out[1] == 11 and out[3] == logits[3].argmax()
    assert out[2] == logits[2, 3:].argmax() + 3
    penalised = logits[4].clone()
    penalised[[5, 6]] = 3.0
    assert out[4] == penalised.argmax() and out[4] not in (5, 6)
    tied = torch.zeros(1, V)
    tied[0, [40, 9, 700]] = 1.0
    assert sample(tied, _params([RowSpec()])).tokens.item() == 9  # lowest index on ties


def test_radix_select_is_the_exact_threshold_with_ties():
    g = torch.Generator().manual_seed(0)
    keys = torch.randint(0, 1 << 32, (16, 5000), generator=g)
    keys[:8] = keys[:8] % 50 + 2 ** 31  # heavy ties
    weights = torch.randint(0, 1 << 20, keys.shape, generator=g)
    need = torch.randint(1, 5000, (16,), generator=g)
    active = torch.ones(16, dtype=torch.bool)
    active[3] = False
    group = ShardGroup(None)
    t = radix_select(keys, None, need, active, group)
    tw_need = (weights.sum(1) * torch.rand(16, generator=g)).long().clamp(min=1)
    tw = radix_select(keys, weights, tw_need, active, group)
    for r in range(16):
        if r == 3:
            assert t[r] == 0 and tw[r] == 0
            continue
        srt, order = keys[r].sort(descending=True)
        assert t[r] == srt[need[r] - 1]  # the need-th largest key, ties included
        cum = weights[r][order].cumsum(0)
        first = int((cum < tw_need[r]).sum())  # first prefix reaching the mass
        assert tw[r] == srt[first]


def test_top_k_keeps_every_token_tied_at_the_threshold():
    logits = torch.full((1, V), -10.0)
    logits[0, [5, 6, 7, 8]] = torch.tensor([3.0, 2.0, 2.0, 2.0])
    rows = [RowSpec(temperature=1.0, top_k=2, seed=s) for s in range(400)]
    p = SamplerParams(len(rows), "cpu", **CAPS)
    p.load(HostBatch.from_rows(rows, vocab_size=V, **CAPS))
    drawn = set(sample(logits.expand(len(rows), V), p).tokens.tolist())
    assert drawn == {5, 6, 7, 8}
