"""Allow masks (structured outputs) in the Triton sampler on one GPU, against the CPU torch path.

bf16 logits `[B, 151936]` at batches 1, 8 and 64, rows of every kind (greedy, temperature, top-k, top-p, min-p,
processed) mixed with unconstrained rows of the same batch: tokens equal the CPU path's bit for bit and are allowed,
top-N ids equal (raw logits); an all-ones mask changes no bit of any output; a row allowing nothing draws token 0;
a shard at an offset that is not a multiple of 32; and `StepSampler` over a run of steps with and without masks of
changing batch sizes (the pinned mirrors, the device mask and its `masked` flag from step to step).
"""
import dataclasses

import numpy as np
import pytest
import torch

from actors.batch import SamplerExtras, StepBatch
from modeling.sampler import HostBatch, RowSpec, SamplerParams, SamplerVariant, sample
from modeling.sampler.allow_bits import mask_words, pack_allowed
from tests.gpu.test_sampler_gpu import _logits  # bf16 [b, V] rows with 8 clear leaders

pytestmark = pytest.mark.gpu

V = 151936
CAPS = dict(max_bias=8, max_ban=4, max_penalty_tokens=32)


def _rows(b: int, salt: int) -> list:
    g = np.random.default_rng(b * 5 + salt)
    kinds = [RowSpec(), RowSpec(temperature=1.0), RowSpec(temperature=0.8, top_p=0.9),
             RowSpec(temperature=1.0, top_k=50), RowSpec(temperature=1.0, min_p=0.1),
             RowSpec(temperature=0.8, top_k=200, top_p=0.7, min_p=0.01),
             RowSpec(temperature=1.0, top_p=0.8, logit_bias={int(g.integers(V)): 8.0}, banned_ids=[151643],
                     repetition_penalty=1.3, prompt_token_ids=g.integers(0, V, 12).tolist(),
                     output_token_ids=g.integers(0, V, 6).tolist())]
    return [dataclasses.replace(kinds[(i + salt) % len(kinds)], seed=int(g.integers(1 << 62)),
                                position=int(g.integers(1 << 20))) for i in range(b)]


def _masks(x: torch.Tensor, salt: int) -> np.ndarray:
    """Every third row unconstrained; the others: a few ids below the best ones, a JSON-like small set, a random
    tenth of the vocabulary, or only ids of the best few."""
    b = x.shape[0]
    order = torch.argsort(x.float(), dim=1, descending=True).cpu()
    g = np.random.default_rng(salt)
    allowed = []
    for i in range(b):
        kind = (i + salt) % 6
        allowed.append(None if kind % 3 == 0 else order[i, 8:40].tolist() if kind == 1 else
                       [13, 90, 220, 1, 515, 4913, 151643] if kind == 2 else
                       g.choice(V, V // 10, replace=False).tolist() if kind == 4 else order[i, :3].tolist())
    return pack_allowed(allowed, V)


def _unpack(bits: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    return ((bits[np.arange(len(tokens)), tokens >> 5] >> (tokens & 31)) & 1).astype(bool)


def _run(x: torch.Tensor, rows: list, bits, variant, n: int, dev: str, **kw):
    p = SamplerParams(len(rows), dev, **CAPS)
    p.load(HostBatch.from_rows(rows, vocab_size=V, **CAPS, allow_bits=bits), rows=len(rows))
    return sample(x.to(dev), p, num_logprobs=n, variant=variant, **kw)


@pytest.mark.parametrize("variant", [SamplerVariant.full(), SamplerVariant(processed=True)], ids=["full", "processed"])
@pytest.mark.parametrize("b", (1, 8, 64))
def test_masked_kernels_equal_the_cpu_reference(b, variant):
    for salt in (1, 2):
        rows = _rows(b, salt)
        if not variant.top_k:
            rows = [RowSpec(temperature=r.temperature, min_p=r.min_p, seed=r.seed, position=r.position) for r in rows]
            rows = [dataclasses.replace(r, banned_ids=[7]) if i % 4 == 3 else r for i, r in enumerate(rows)]
        x = _logits(b, salt)
        bits = _masks(x, salt)
        got = _run(x, rows, bits, variant, 5, "cuda")
        torch.cuda.synchronize()
        ref = _run(x, rows, bits, variant, 5, "cpu")
        assert torch.equal(got.tokens.cpu(), ref.tokens), (b, salt, (got.tokens.cpu() != ref.tokens).nonzero())
        assert torch.equal(got.top_ids.cpu(), ref.top_ids)
        assert _unpack(bits, got.tokens.cpu().numpy()).all()
        lsm = torch.log_softmax(x.float(), dim=-1)  # logprobs of the raw logits
        assert torch.allclose(got.chosen_logprob, lsm.gather(1, got.tokens[:, None]).squeeze(1), atol=2e-3)
        assert torch.allclose(got.top_logprobs, lsm.gather(1, got.top_ids), atol=2e-3)


@pytest.mark.parametrize("b", (1, 8, 64))
def test_all_ones_mask_changes_no_bit_and_a_row_allowing_nothing_draws_0(b):
    rows = _rows(b, 3)
    x = _logits(b, 3)
    ones = np.full((b, mask_words(V)), -1, np.int32)
    a = _run(x, rows, ones, SamplerVariant.full(), 5, "cuda")
    plain = _run(x, rows, None, SamplerVariant.full(), 5, "cuda")
    for f in ("tokens", "chosen_logprob", "top_ids", "top_logprobs"):
        assert torch.equal(getattr(a, f), getattr(plain, f)), f
    none = ones.copy()
    none[0] = 0
    c = _run(x, rows, none, SamplerVariant.full(), 5, "cuda")
    assert c.tokens[0] == 0 and torch.equal(c.tokens[1:], plain.tokens[1:])
    # rows without lists: the unprocessed kernels (no copy) against the masked processed ones
    free = [RowSpec(temperature=r.temperature, top_k=r.top_k, top_p=r.top_p, min_p=r.min_p, seed=r.seed,
                    position=r.position) for r in rows]
    own = HostBatch.from_rows(free, vocab_size=V, **CAPS).variant()
    assert not own.processed
    a = _run(x, free, ones, SamplerVariant(True, own.top_k, own.top_p, own.large_top_k), 5, "cuda")
    plain = _run(x, free, None, own, 5, "cuda")
    for f in ("tokens", "chosen_logprob", "top_ids", "top_logprobs"):
        assert torch.equal(getattr(a, f), getattr(plain, f)), f


def test_a_shard_at_an_offset_not_a_multiple_of_32():
    b, off = 8, 75968 + 9
    rows = _rows(b, 4)
    x = _logits(b, 4)
    bits = _masks(x, 4)
    bits[:, off // 32: off // 32 + 2] = -1  # ids either side of the offset allowed in every row
    got = _run(x[:, off:].contiguous(), rows, bits, SamplerVariant.full(), 3, "cuda", vocab_offset=off)
    torch.cuda.synchronize()
    ref = _run(x[:, off:].contiguous(), rows, bits, SamplerVariant.full(), 3, "cpu", vocab_offset=off)
    assert torch.equal(got.tokens.cpu(), ref.tokens) and torch.equal(got.top_ids.cpu(), ref.top_ids)


def test_step_sampler_steps_with_and_without_masks_equal_the_cpu_sampler():
    from actors.step_sampler import StepSampler

    samplers = {dev: StepSampler(torch.device(dev), V, max_model_len=256, capacity=8) for dev in ("cuda", "cpu")}
    for step, (b, masked) in enumerate(((8, True), (8, False), (3, True), (64, True), (5, False), (64, True))):
        rows = _rows(b, 10 + step)
        batch = StepBatch.from_sequences([[5]] * b, [r.position for r in rows], [[1] * 16] * b,
                                         temperature=[r.temperature for r in rows], top_k=[r.top_k for r in rows],
                                         top_p=[r.top_p for r in rows],
                                         seeds=[r.seed if r.temperature else -1 for r in rows])
        x = _logits(b, 10 + step).float()
        bits = _masks(x, step) if masked else None
        if masked:
            batch = dataclasses.replace(batch, extras=dataclasses.replace(SamplerExtras.off(b, 2), allow_bits=bits))
        got = {dev: s.sample(x.to(dev), batch) for dev, s in samplers.items()}
        torch.cuda.synchronize()
        assert torch.equal(got["cuda"][0].cpu(), got["cpu"][0]), (step, b, masked)
        if masked:
            assert _unpack(bits, got["cpu"][0].numpy()).all()
            assert torch.equal(got["cuda"][1][0][:, 2:4].cpu(), got["cpu"][1][0][:, 2:4])  # top-2 ids (raw)
