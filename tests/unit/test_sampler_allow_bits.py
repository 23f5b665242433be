"""Allow masks of structured outputs (`SamplerExtras.allow_bits`) on the torch path (the CPU sampler and the Triton
kernels' oracle), through the step batch, the wire and `StepSampler`: masked ids are never drawn (greedy or
sampled, with top-k / top-p / min-p, under TP shards at offsets that are not multiples of 32), an all-ones mask
changes no bit of tokens or logprobs, logprobs stay those of the raw logits, a masked row draws what the plain path
draws from logits with its masked ids at -inf. The kernels' side: `test_sampler_allow_bits_interpret.py`."""
import dataclasses

import numpy as np
import pytest
import torch
import torch.distributed as dist

from actors.batch import BatchError, SamplerExtras, StepBatch
from modeling.sampler import HostBatch, RowSpec, SamplerParamError, SamplerParams, SamplerVariant, sample
from modeling.sampler.allow_bits import mask_words, pack_allowed
from modeling.sampler.reference import allowed_columns
from tests.unit._ranks import run_ranks
from tests.unit._sampler_cases import CAPS

V = 1000  # not a multiple of 32: the last word is partial
SPECS = {"greedy": RowSpec(), "t1": RowSpec(temperature=1.0), "top_k": RowSpec(temperature=1.0, top_k=5),
         "top_p": RowSpec(temperature=0.8, top_p=0.5), "min_p": RowSpec(temperature=1.0, min_p=0.2),
         "all": RowSpec(temperature=1.2, top_k=40, top_p=0.9, min_p=0.05)}


def _unpack(bits: np.ndarray, vocab: int) -> np.ndarray:
    """bool `[n, vocab]` from the documented layout, independently of the sampler's code."""
    j = np.arange(vocab)
    return np.ascontiguousarray((bits[:, j >> 5] >> (j & 31)) & 1, dtype=bool)


def _logits(n: int, vocab: int = V, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def _run(x: torch.Tensor, rows: list, bits=None, n: int = 3, variant=None, vocab: int = V, **kw):
    """Sample `x` with `rows` (and allow mask `bits`) on the torch path; variant: the batch's own by default."""
    host = HostBatch.from_rows(rows, vocab_size=vocab, **CAPS, allow_bits=bits)
    p = SamplerParams(len(rows), "cpu", **CAPS)
    p.load(host, rows=len(rows))
    return sample(x, p, num_logprobs=n, variant=variant or host.variant(), **kw)


def _rows(spec: RowSpec, n: int) -> list:
    return [dataclasses.replace(spec, seed=1000 + i, position=7 * i) for i in range(n)]


def test_pack_allowed_follows_the_token_bitmask_layout():
    bits = pack_allowed([[0, 31, 32, 999], None, []], V)
    assert bits.dtype == np.int32 and bits.shape == (3, mask_words(V)) == (3, 32)
    assert bits[0, 0] == np.int32(-(2**31) + 1) and bits[0, 1] == 1 and bits[0, 31] == 1 << (999 & 31)
    assert (bits[1] == -1).all() and (bits[2] == 0).all()
    got = _unpack(bits, V)
    assert np.flatnonzero(got[0]).tolist() == [0, 31, 32, 999] and got[1].all() and not got[2].any()
    for voff, v in ((0, V), (9, 40), (1001 - 992, 500)):
        assert torch.equal(allowed_columns(torch.from_numpy(bits), voff, v), torch.from_numpy(got[:, voff:voff + v]))


def test_greedy_rows_take_the_best_allowed_id():
    rng = np.random.default_rng(1)
    x = _logits(16)
    allowed = [rng.choice(V, int(rng.integers(1, 60)), replace=False) for _ in range(16)]
    allowed[3] = np.argsort(-x[3].numpy())[5:9]  # the best ids are masked
    allowed[4] = None
    bits = pack_allowed(allowed, V)
    out = _run(x, [RowSpec()] * 16, bits)
    want = np.where(_unpack(bits, V), x.numpy(), -np.inf).argmax(1)
    assert out.tokens.tolist() == want.tolist()
    assert out.tokens[4] == x[4].argmax() and out.tokens[3] != x[3].argmax()


@pytest.mark.parametrize("name", list(SPECS))
def test_sampled_rows_draw_only_allowed_ids(name):
    n = 400
    x = _logits(1, seed=2).expand(n, V).contiguous()
    order = np.argsort(-x[0].numpy())
    rng = np.random.default_rng(3)
    # row r % 4: the best 40 ids masked; a few middling ids; one id; a random half
    masks = [order[40:], order[100:106], order[500:501], rng.choice(V, V // 2, replace=False)]
    bits = pack_allowed([masks[r % 4] for r in range(n)], V)
    out = _run(x, _rows(SPECS[name], n), bits, n=0)
    ok = _unpack(bits, V)
    assert ok[np.arange(n), out.tokens.numpy()].all()
    if name != "greedy":
        assert len(set(out.tokens[3::4].tolist())) > 1  # rows of the random half still sample
    # the plain path over logits with the masked ids at -inf draws the very same tokens
    plain = _run(torch.where(torch.from_numpy(ok), x, float("-inf")), _rows(SPECS[name], n), None, n=0)
    assert torch.equal(out.tokens, plain.tokens)


def test_all_ones_mask_changes_no_bit():
    n = 12
    x = _logits(n, seed=4)
    rows = [dataclasses.replace(s, seed=50 + i, position=i) for i, s in enumerate(list(SPECS.values()) * 2)]
    rows[5] = dataclasses.replace(rows[5], logit_bias={3: 5.0}, banned_ids=[7])
    ones = np.full((n, mask_words(V)), -1, np.int32)
    for variant in (None, SamplerVariant.full()):
        a, b = _run(x, rows, ones, n=5, variant=variant), _run(x, rows, None, n=5, variant=variant)
        for f in ("tokens", "chosen_logprob", "top_ids", "top_logprobs"):
            assert torch.equal(getattr(a, f), getattr(b, f)), f
    plain = [dataclasses.replace(r, logit_bias=None, banned_ids=()) for r in rows]
    assert _run(x, plain, None).tokens.tolist() == _run(x, plain, ones).tokens.tolist()


def test_logprobs_are_of_the_raw_logits():
    x = _logits(4, seed=5)
    top = torch.argsort(x, dim=1, descending=True)
    bits = pack_allowed([top[i, 10:12].tolist() for i in range(4)], V)
    out = _run(x, [RowSpec(), RowSpec(temperature=1.0, seed=1)] * 2, bits, n=5)
    lsm = torch.log_softmax(x, dim=1)
    assert torch.equal(out.top_ids, top[:, :5])  # the masked best ids: top-N is of the raw logits
    assert torch.allclose(out.top_logprobs, lsm.gather(1, top[:, :5]), atol=1e-5)
    assert all(t in top[i, 10:12].tolist() for i, t in enumerate(out.tokens.tolist()))
    assert torch.allclose(out.chosen_logprob, lsm.gather(1, out.tokens[:, None]).squeeze(1), atol=1e-5)


def test_a_row_allowing_nothing_draws_token_0_and_leaves_the_others_alone():
    x = _logits(4, seed=6)
    rows = [RowSpec(), RowSpec(temperature=1.0, seed=2), RowSpec(temperature=1.0, top_p=0.9, seed=3), RowSpec()]
    bits = pack_allowed([[], [], None, None], V)
    bits[1, -1] = -1 << (V & 31)  # only bits of ids >= V set: nothing in [0, V)
    out = _run(x, rows, bits)
    alone = _run(x[2:], rows[2:], None)
    assert out.tokens[:2].tolist() == [0, 0] and torch.equal(out.tokens[2:], alone.tokens)
    assert torch.isfinite(out.chosen_logprob).all()


def test_bits_past_the_vocabulary_are_never_read():
    x = _logits(2, seed=7)
    bits = pack_allowed([[5, 990], [5, 990]], V)
    bits[1, -1] |= np.int32(-1 << (V & 31))  # ids 1000..1023 "allowed": they do not exist
    out = _run(x, [RowSpec(temperature=1.0, seed=9)] * 2, bits)
    assert out.tokens[0] == out.tokens[1] and out.tokens[0] in (5, 990)


# ---- TP: two shards on gloo, the second at an offset that is not a multiple of 32
V_TP, SPLIT = 2003, 1001  # 1001 = 31 * 32 + 9


def _tp_case():
    x = _logits(8, V_TP, seed=8)
    order = torch.argsort(x, dim=1, descending=True)
    rows = [RowSpec(), RowSpec(temperature=1.0, seed=1), RowSpec(temperature=0.7, top_k=3, seed=2),
            RowSpec(temperature=1.0, top_p=0.6, seed=3), RowSpec(temperature=1.0, min_p=0.3, seed=4), RowSpec(),
            RowSpec(temperature=1.5, top_k=20, top_p=0.8, seed=5), RowSpec(temperature=1.0, seed=6)]
    allowed = [order[0, 3:6].tolist() + [SPLIT - 1, SPLIT], list(range(990, 1012)), order[2, 5:40].tolist(), None,
               list(range(SPLIT, V_TP)), [SPLIT + 3], order[6, ::3].tolist(), list(range(0, V_TP, 7))]
    return x, rows, pack_allowed(allowed, V_TP)


def _tp_rank(rank: int, init: str, q) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        x, rows, bits = _tp_case()
        lo, hi = (0, SPLIT) if rank == 0 else (SPLIT, V_TP)
        o = _run(x[:, lo:hi].contiguous(), rows, bits, n=4, vocab=V_TP, vocab_offset=lo, tp_group=dist.group.WORLD,
                 shard_width=max(SPLIT, V_TP - SPLIT))
        q.put((rank, o.tokens.tolist(), o.top_ids.tolist()))
    finally:
        dist.destroy_process_group()


def test_two_shards_equal_one_rank_with_masks():
    x, rows, bits = _tp_case()
    want = _run(x, rows, bits, n=4, vocab=V_TP)
    ok = _unpack(bits, V_TP)
    assert ok[np.arange(8), want.tokens.numpy()].all()
    got = run_ranks(_tp_rank, 2)
    for r in range(2):
        assert got[r][0] == want.tokens.tolist() and got[r][1] == want.top_ids.tolist(), r


# ---- host and parameter block
def test_host_batch_checks_the_mask_and_the_block_copies_it_only_for_masked_steps():
    rows = [RowSpec(temperature=1.0, seed=1), RowSpec()]
    for bad in (np.full((2, 31), -1, np.int32), np.full((2, 32), -1, np.int64), np.full((1, 32), -1, np.int32),
                np.full(64, -1, np.int32)):
        with pytest.raises(SamplerParamError, match="allow_bits"):
            HostBatch.from_rows(rows, vocab_size=V, **CAPS, allow_bits=bad)
    p = SamplerParams(4, "cpu", **CAPS)
    plain = HostBatch.from_rows(rows, vocab_size=V, **CAPS)
    p.load(plain, rows=2)
    assert p.allow_bits is None and not p.masked  # a block that never saw a mask holds none
    masked = HostBatch.from_rows(rows, vocab_size=V, **CAPS, allow_bits=pack_allowed([[4], [6]], V))
    assert masked.variant().processed and not plain.variant().processed
    p.load(masked, rows=2)
    assert p.masked and p.allow_bits.shape == (4, 32)
    assert sample(_logits(2), p, variant=masked.variant()).tokens.tolist() == [4, 6]
    p.load(plain, rows=2)  # the next step without a mask: the mask is not applied
    out = sample(_logits(2), p, variant=SamplerVariant(processed=True))
    assert not p.masked and out.tokens[1] == _logits(2)[1].argmax()


# ---- SamplerExtras, the wire, StepSampler
def _extras(n: int, bits) -> SamplerExtras:
    return dataclasses.replace(SamplerExtras.off(n, -1), allow_bits=bits)


def test_extras_with_a_mask_are_processed_and_validated():
    n = 3
    bits = pack_allowed([[1], None, [2, 3]], V)
    ex = _extras(n, bits)
    assert ex.processed and not ex.logprobs_only and SamplerExtras.off(n, 5).allow_bits is None
    assert not SamplerExtras.off(n, 5).processed
    ex.validate(n, V)
    full = dataclasses.replace(ex, **{f.name: getattr(ex, f.name).copy() for f in dataclasses.fields(SamplerExtras)
                                      if f.name not in ("num_logprobs", "allow_bits")})
    assert full.processed and dataclasses.replace(full, allow_bits=None).processed is False
    for bad in (bits[:, :-1], bits.astype(np.int64), bits[:2], bits.ravel(), bits.astype(np.uint32), bits.tolist()):
        with pytest.raises(BatchError, match="allow_bits"):
            _extras(n, bad).validate(n, V)
    with pytest.raises(BatchError, match="allow_bits"):
        ex.validate(n, V + 32)  # one more word expected
    ex.validate(n, V + 24)  # the same word count
    b = StepBatch.from_sequences([[5]] * n, [10] * n, [[1]] * n)
    with pytest.raises(BatchError, match="allow_bits"):
        dataclasses.replace(b, extras=_extras(n, bits[:, 1:])).check_runnable(V, 16, 8, 64)


@pytest.mark.parametrize("with_bits", [False, True])
@pytest.mark.parametrize("lists", [False, True])
def test_wire_round_trips_allow_bits(with_bits, lists):
    from actors.protocol import plan_step
    from actors.wire import LENGTH, WireError, decode_request, encode_request

    rng = np.random.default_rng(9)
    for n in (1, 5, 64):
        b = StepBatch.from_sequences([[5 + i] for i in range(n)], [10] * n, [[1 + i] for i in range(n)])
        bits = rng.integers(-(2**31), 2**31, (n, mask_words(V)), dtype=np.int64).astype(np.int32) if with_bits \
            else None
        ex = _extras(n, bits) if not lists else SamplerExtras(
            rng.random(n, np.float32), rng.random((n, 3), np.float32), rng.integers(-1, V, (n, 2), dtype=np.int32),
            rng.random((n, 2), np.float32), rng.integers(-1, V, (n, 3), dtype=np.int32),
            rng.integers(-1, V, (n, 1), dtype=np.int32), rng.integers(0, 9, (n, 1), dtype=np.int32), 4, bits)
        plan = plan_step([dataclasses.replace(b, extras=ex)], cross_dp=False, decode_buckets=[64], token_buckets=[64])
        frame = encode_request(plan, 0)
        got = decode_request(memoryview(frame)[LENGTH.size:])[0][0].extras
        assert got.num_logprobs == ex.num_logprobs
        for f in dataclasses.fields(SamplerExtras):
            a, w = getattr(got, f.name), getattr(ex, f.name)
            if f.name == "num_logprobs" or w is None:
                assert a == w, f.name
            else:
                assert a.dtype == w.dtype and a.shape == w.shape and a.tobytes() == w.tobytes(), f.name
        assert got.processed == ex.processed
        if bits is not None:
            with pytest.raises(WireError, match="extras"):
                decode_request(memoryview(frame)[LENGTH.size:-4])


def test_step_sampler_applies_the_batch_mask_on_the_eager_path():
    from actors.step_sampler import StepSampler

    n = 6
    s = StepSampler(torch.device("cpu"), V, max_model_len=64, capacity=4)
    b = StepBatch.from_sequences([[5]] * n, [10 + i for i in range(n)], [[1]] * n,
                                 temperature=[0.0, 1.0, 1.0, 0.7, 0.0, 1.0], top_k=[0, 0, 5, 0, 0, 0],
                                 top_p=[1.0, 1.0, 1.0, 0.8, 1.0, 1.0], seeds=[-1, 1, 2, 3, -1, 4])
    x = _logits(n, seed=10)
    bits = pack_allowed([[7, 8], list(range(300, 340)), None, [1, 2, 3], None, [999]], V)
    masked = dataclasses.replace(b, extras=_extras(n, bits))
    masked.validate(V, 16)
    assert s.graph_head(masked, 8, lambda *_: object()) is None  # no captured head: the eager sampler
    tokens, lp = s.sample(x, masked)
    assert lp is None and _unpack(bits, V)[np.arange(n), tokens.numpy()].all()
    assert tokens[5] == 999 and tokens[4] == x[4].argmax()
    plain, _ = s.sample(x, b)  # the next step without a mask: nothing of it is left
    ones, _ = s.sample(x, dataclasses.replace(b, extras=_extras(n, np.full_like(bits, -1))))
    assert torch.equal(plain, ones) and tokens[2] == plain[2]


def test_warm_up_compiles_the_copy_with_and_without_a_mask():
    """The masked copy is a compile of its own (`HAS_MASK`): the start-up warm-up runs processed classes both ways,
    and its masked rows are valid batches (the launches themselves: test_sampler_warm_up.py, on the GPU
    tests/gpu/test_sampler_compiles.py)."""
    from modeling.sampler.warm_up import warm_up_classes, warm_up_mask, warm_up_masked, warm_up_row

    classes = warm_up_classes()
    assert {warm_up_masked(v, n) for v, n in classes if v.processed} == {False, True}
    assert not any(warm_up_masked(v, n) for v, n in classes if not v.processed)
    for v, n in classes:
        if warm_up_masked(v, n):
            host = HostBatch.from_rows([warm_up_row(v, V)], vocab_size=V, **CAPS, allow_bits=warm_up_mask(V))
            assert host.variant() == v and _unpack(host.allow_bits, V)[0, 1:].all()
