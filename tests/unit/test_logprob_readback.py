"""A step's logprobs on their way back: the rank packs tokens and logprobs into one int32 array (one device-to-host
copy, `actors.step_sampler.pack_logprobs`), `PendingTokens` unpacks it, and the pipe path's frames carry them and
the sampler extras as raw arrays. Each path must give exactly the sampler's own outputs (bits, dtypes, shapes)."""
import dataclasses

import numpy as np
import pytest
import torch

from actors.batch import SampledTokens, SamplerExtras
from actors.decode_state import PendingTokens, unpack_logprobs
from actors.protocol import plan_step
from actors.step_sampler import GRAPH_LOGPROBS, StepSampler, pack_logprobs
from actors.wire import (LENGTH, REPLY_OK, WireError, decode_reply, decode_request, encode_request,
                         encode_tokens)
from bench.dist_bench import decode_batch, with_sampling
from modeling.sampler import SamplerParams

V = 3001


def _batch(n: int, mode: str, num_logprobs: int):
    b = with_sampling(decode_batch(n, 40, 16, 512, V), mode)
    return dataclasses.replace(b, extras=dataclasses.replace(b.extras, num_logprobs=num_logprobs))


def _logits(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    out = torch.randn(n, V, generator=g) * 3
    out[:, 7] = out[:, 11]  # ties: the lower id first
    return out


def _assert_same(got: SampledTokens, tokens, chosen, top_ids, top_logprobs, n: int):
    assert got.tokens.dtype == np.int64 and got.tokens.tolist() == tokens.tolist()
    lp = got.logprobs
    assert lp.chosen.dtype == np.float32 and lp.chosen.tobytes() == chosen.numpy().tobytes()
    assert lp.top_ids.dtype == np.int32 and lp.top_ids.shape == (len(tokens), n)
    assert lp.top_ids.tolist() == top_ids.tolist()
    assert lp.top_logprobs.dtype == np.float32 and lp.top_logprobs.shape == (len(tokens), n)
    assert np.ascontiguousarray(lp.top_logprobs).tobytes() == top_logprobs.contiguous().numpy().tobytes()


@pytest.mark.parametrize("n,mode,num_logprobs", [(1, "greedy_lp5", 5), (64, "greedy_lp5", 5),
                                                  (9, "t1_p0.9_lp5", 0), (33, "t1_p0.9_lp5", 20)])
def test_eager_sampler_read_back_equals_its_outputs(n, mode, num_logprobs):
    """The eager sampler's step through `StepSampler.sample`, the packed read-back and `PendingTokens.result`
    equals what `modeling.sampler.sample` returned field by field."""
    from modeling.sampler import sample

    batch = _batch(n, mode, num_logprobs)
    s = StepSampler(torch.device("cpu"), V, 512)
    logits = _logits(n, n)
    tokens, (packed, k) = s.sample(logits, batch)
    assert packed.dtype == torch.int32 and packed.shape == (n, 2 + 2 * num_logprobs) and k == num_logprobs
    host = s._host_batch(batch)
    want = sample(logits, s._params, num_logprobs=num_logprobs, variant=host.variant())
    got = PendingTokens(packed, None, logprobs=k).result()
    _assert_same(got, want.tokens, want.chosen_logprob, want.top_ids, want.top_logprobs, num_logprobs)
    assert got.tokens.tolist() == tokens.tolist()


@pytest.mark.parametrize("keep", [0, 3, GRAPH_LOGPROBS])
@pytest.mark.parametrize("mode,name", [("greedy_lp5", "greedy_lp"), ("t1_p0.9_lp5", "sample_p_lp")])
def test_captured_head_output_unpacks_to_the_first_n_entries(keep, mode, name):
    """A logprob head (run eagerly here, as its capture does first) packs GRAPH_LOGPROBS entries; a batch asking
    for `keep` of them reads back rows [0, n) and gets the first `keep`, exactly the separate outputs' values of
    the sampler over the batch's own rows (the greedy logprob head's block is never staged: greedy defaults)."""
    from modeling.sampler import sample

    bucket, n = 16, 11
    s = StepSampler(torch.device("cpu"), V, 512)
    heads = dict(s.graph_heads(lambda hidden, b: hidden, bucket))
    batch = _batch(n, mode, keep)
    assert s.stage_graph_rows(batch, bucket, lambda b, name: name) == name
    logits = _logits(bucket, 5)
    tokens, packed = heads[name](logits, bucket)
    assert packed.shape == (bucket, 2 + 2 * GRAPH_LOGPROBS)
    own = SamplerParams(bucket, "cpu")
    own.load(s._host_batch(batch), rows=n)  # rows [n, bucket): greedy defaults
    want = sample(logits, own, num_logprobs=GRAPH_LOGPROBS, variant=s._host_batch(batch).variant())
    if name == "greedy_lp":
        assert want.tokens[:n].tolist() == logits[:n].argmax(-1).tolist()
    got = PendingTokens(packed[:n], None, logprobs=keep).result()
    _assert_same(got, want.tokens[:n], want.chosen_logprob[:n], want.top_ids[:n, :keep], want.top_logprobs[:n, :keep],
                 keep)
    assert tokens[:n].tolist() == got.tokens.tolist()


def test_pack_round_trips_any_bits():
    """Packing keeps every fp32 bit pattern (negative zero, -inf, NaN payloads) and token ids up to 2^31 - 1."""
    g = torch.Generator().manual_seed(1)
    n, m = 6, 4
    tokens = torch.tensor([0, 1, 151935, 2 ** 31 - 1, 5, 6])
    bits = torch.randint(-2 ** 31, 2 ** 31 - 1, (n, 1 + m), generator=g, dtype=torch.int64).to(torch.int32)
    bits[0, 0] = -2 ** 31  # -0.0
    floats = bits.view(torch.float32)
    ids = torch.randint(0, 151936, (n, m), generator=g)
    out = unpack_logprobs(pack_logprobs(tokens, floats[:, 0], ids, floats[:, 1:]).numpy().copy(), m)
    _assert_same(out, tokens, floats[:, 0], ids, floats[:, 1:], m)


def _body(frame: bytes) -> memoryview:
    (n,) = LENGTH.unpack_from(frame, 0)
    assert len(frame) == LENGTH.size + n
    return memoryview(frame)[LENGTH.size:]


def test_request_carries_sampler_extras_as_raw_arrays():
    """Every `SamplerExtras` field survives the request frame (dtype, shape, values), with lists of any width."""
    rng = np.random.default_rng(4)
    for n, (k, m, p) in ((1, (0, 0, 0)), (5, (3, 1, 8)), (64, (1, 1, 1))):
        b = decode_batch(n, 40, 16, 512, V)
        ex = SamplerExtras(min_p=rng.random(n, np.float32), penalties=rng.random((n, 3), np.float32),
                           bias_ids=rng.integers(-1, V, (n, k), dtype=np.int32),
                           bias_vals=rng.random((n, k), np.float32), ban_ids=rng.integers(-1, V, (n, m), dtype=np.int32),
                           pen_ids=rng.integers(-1, V, (n, p), dtype=np.int32),
                           pen_counts=rng.integers(0, 9, (n, p), dtype=np.int32), num_logprobs=int(rng.integers(-1, 21)))
        plan = plan_step([dataclasses.replace(b, extras=ex)], cross_dp=False, decode_buckets=[64], token_buckets=[64])
        body = _body(encode_request(plan, 0))
        got = decode_request(body)[0][0].extras
        assert got.num_logprobs == ex.num_logprobs and got.allow_bits is ex.allow_bits is None
        for f in dataclasses.fields(SamplerExtras):
            if f.name not in ("num_logprobs", "allow_bits"):  # allow masks: test_sampler_allow_bits.py
                a, w = getattr(got, f.name), getattr(ex, f.name)
                assert a.dtype == w.dtype and a.shape == w.shape and a.tobytes() == w.tobytes(), f.name
        with pytest.raises(WireError, match="extras"):
            decode_request(body[:-4])


def test_logprob_reply_round_trips():
    """The rank's `SampledTokens` (views into its packed read-back) come back on the driver field for field."""
    packed = pack_logprobs(torch.tensor([4, 9, 2]), torch.tensor([-0.5, -1.0, 0.0]),
                           torch.tensor([[4, 1], [9, 2], [2, 0]]), torch.tensor([[-0.5, -2.0], [-1.0, -1.5], [0.0, -9.0]]))
    sent = unpack_logprobs(packed.numpy().copy(), 2)
    status, seconds, got = decode_reply(_body(encode_tokens(sent, 0.5))[:])
    assert status == REPLY_OK and seconds == 0.5 and isinstance(got, SampledTokens)
    assert got.tokens.tolist() == [4, 9, 2] and got.logprobs.top_ids.tolist() == [[4, 1], [9, 2], [2, 0]]
    assert got.logprobs.chosen.tolist() == [-0.5, -1.0, 0.0]
    assert got.logprobs.top_logprobs.tolist() == [[-0.5, -2.0], [-1.0, -1.5], [0.0, -9.0]]


def test_captured_head_rows_of_the_next_decode_step_equal_fresh_ones():
    """`StepSampler` reuses the previous step's derived rows when only the positions moved on; any other change
    (temperature, top_k, top_p, a seed, min_p, the batch size, extras or none) derives them again. Every step's
    rows equal those a fresh sampler derives, field for field, and a bad position still raises."""
    from modeling.sampler import HostBatch, SamplerParamError

    s = StepSampler(torch.device("cpu"), V, 512)
    batch = _batch(8, "t1_p0.9_lp5", 5)
    steps = [batch]
    for _ in range(3):
        steps.append(dataclasses.replace(steps[-1], num_history=steps[-1].num_history + 1))
    b = steps[-1]
    steps += [dataclasses.replace(b, temperature=b.temperature * 0.5), dataclasses.replace(b, top_k=b.top_k + 3),
              dataclasses.replace(b, top_p=np.full(8, 0.5, np.float32)), dataclasses.replace(b, seeds=b.seeds + 1),
              dataclasses.replace(b, extras=dataclasses.replace(b.extras, min_p=np.full(8, 0.1, np.float32))),
              dataclasses.replace(b, extras=None), b, _batch(9, "t1_p0.9_lp5", 5)]
    reused = 0
    for step in steps:
        last = s._last_rows
        got = s._graph_rows(step)[0]
        reused += last is not None and got is not last[1] and got.top_p is last[1].top_p
        want = StepSampler(torch.device("cpu"), V, 512)._graph_rows(step)[0]
        for name in {**HostBatch.SCALARS, **HostBatch.LISTS}:
            a, w = getattr(got, name), getattr(want, name)
            assert a.dtype == w.dtype and a.shape == w.shape and a.tobytes() == w.tobytes(), name
    assert reused == 3  # the three steps that only moved on
    s._graph_rows(b)[0]  # then the same rows at bad positions: not reused, `validate`'s error
    with pytest.raises(SamplerParamError, match="position"):
        s._graph_rows(dataclasses.replace(b, num_history=b.num_history - 1000))[0]
