"""Dispatch policy, descriptor selection, eager reasons, the CPU runner and stats (pure CPU).

The model is `graphrunner.testing.ToyDecoder`, a small real module implementing the
runner's contract (it runs; nothing here is mocked).
"""
import dataclasses
import json

import pytest
import torch

from graphrunner import CUDAGraphRunner, GraphRunnerConfig
from graphrunner.dispatch import DispatchPolicy, Path
from graphrunner.errors import GraphCaptureError
from graphrunner.full_graph import DecodeGraphKey
from graphrunner.standard import StandardGraphDescriptor, select_descriptor
from graphrunner.stats import EagerReason, ExecPath, RunnerStats
from graphrunner.testing import ToyDecoder, toy_dummy_factory, toy_kv_caches, toy_step

BS, W = 4, 32


@pytest.fixture(scope="module")
def model():
    return ToyDecoder(max_tokens=128)


@pytest.fixture
def kv(model):
    return toy_kv_caches(model, 64, BS, "cpu")


def prefill(kv, lens=(5,), **fields):
    seqs, b = [], 1
    for n in lens:
        nb = -(-n // BS)
        seqs.append((list(range(1, n + 1)), 0, list(range(b, b + nb))))
        b += nb
    return toy_step(seqs, kv, BS, W, "cpu", **fields)


def decode(kv, batch, **fields):
    return toy_step([([7], 3, [1 + i]) for i in range(batch)], kv, BS, W, "cpu", **fields)


class PublishedPlans:
    """The piecewise facts a policy needs: the real descriptor selection + a set of published descriptors."""

    def __init__(self, buckets, published=()):
        self.buckets = tuple(buckets)
        self.published = set(published)

    def select(self, step):
        return select_descriptor(step, self.buckets)

    def has_plan(self, descriptor):
        return descriptor in self.published


class NoGraphToy(ToyDecoder):
    def supports_cuda_graph(self, step):
        return False


def policy(model, *, decode_buckets=(1, 2, 4, 8), captured=(1, 2, 4, 8), plans=None, eager=False, cuda=True,
           off=None):
    keys = {DecodeGraphKey(b, 1, ()) for b in captured}
    return DispatchPolicy(model=model, eager_mode=eager, cuda=cuda, decode_buckets=decode_buckets,
                          has_decode_graph=keys.__contains__, piecewise=plans, piecewise_off_reason=off)


def desc(bucket, names=("input_ids", "position_ids"), constants=()):
    return StandardGraphDescriptor(bucket, names, constants)


# ---------------------------------------------------------------- descriptor selection


def test_descriptor_selection_and_request_count_not_in_descriptor(kv):
    buckets = (32, 64, 128)
    a = select_descriptor(prefill(kv, (20,)), buckets)
    b = select_descriptor(prefill(kv, (5, 5, 10)), buckets)
    assert a == b == desc(32)
    assert select_descriptor(prefill(kv, (33,)), buckets) == desc(64)
    assert select_descriptor(prefill(kv, (5,), token_bucket_hint=70), buckets) == desc(128)
    assert select_descriptor(prefill(kv, (5,), extras={"b": 1, "a": 0.5}), buckets) == desc(32, constants=(("a", 0.5), ("b", 1)))
    step = prefill(kv, (6,))
    step = dataclasses.replace(step, mrope_position_ids=torch.zeros(3, 6, dtype=torch.int64))
    assert select_descriptor(step, buckets).graph_input_names == ("input_ids", "position_ids", "mrope_position_ids")


@pytest.mark.parametrize(
    "fields,reason",
    [
        ({"chunked_prefill": True}, EagerReason.CHUNKED_PREFILL),
        ({"micro_batch": True}, EagerReason.MICRO_BATCH),
        ({"adapter_ids": torch.zeros(1, dtype=torch.int64)}, EagerReason.LIVE_ADAPTER),
        ({"extras": {"scale": torch.ones(1)}}, EagerReason.DYNAMIC_EXTRAS),
        ({"extras": {"ids": [1, 2]}}, EagerReason.DYNAMIC_EXTRAS),
        ({"token_bucket_hint": 129}, EagerReason.TOO_MANY_TOKENS),
    ],
)
def test_descriptor_rejections(kv, fields, reason):
    assert select_descriptor(prefill(kv, (5,), **fields), (32, 64, 128)) is reason


def test_too_many_tokens(kv):
    assert select_descriptor(prefill(kv, (30, 30)), (32,)) is EagerReason.TOO_MANY_TOKENS
    assert select_descriptor(prefill(kv, (5,)), ()) is EagerReason.TOO_MANY_TOKENS


# ---------------------------------------------------------------- three-way dispatch


def test_decode_full_graph(model, kv):
    d = policy(model).decide(decode(kv, 3))
    assert d.path is Path.FULL_GRAPH and d.decode_key == DecodeGraphKey(4, 1, ())
    d = policy(model).decide(decode(kv, 3, batch_bucket_hint=5))
    assert d.decode_key.batch == 8


@pytest.mark.parametrize(
    "fields,reason",
    [
        ({"micro_batch": True}, EagerReason.MICRO_BATCH),
        ({"adapter_ids": torch.zeros(2, dtype=torch.int64)}, EagerReason.LIVE_ADAPTER),
        ({"extras": {"x": torch.ones(1)}}, EagerReason.DYNAMIC_EXTRAS),
        ({"batch_bucket_hint": 9}, EagerReason.BATCH_TOO_LARGE),
    ],
)
def test_decode_rejections_go_eager_with_decode_reason(model, kv, fields, reason):
    d = policy(model).decide(decode(kv, 2, **fields))
    assert d.path is Path.EAGER and d.reason is reason


def test_decode_rejections_without_pcg(model, kv):
    assert policy(model).decide(decode(kv, 9)).reason is EagerReason.BATCH_TOO_LARGE
    assert policy(model, captured=(1, 2)).decide(decode(kv, 3)).reason is EagerReason.NOT_CAPTURED
    assert policy(NoGraphToy(max_tokens=8)).decide(decode(kv, 3)).reason is EagerReason.NOT_SUPPORTED_BY_MODEL
    assert policy(model, decode_buckets=(), captured=()).decide(decode(kv, 3)).reason is \
        EagerReason.DECODE_GRAPHS_DISABLED
    # scalar extras are part of the decode key: a graph captured without them does not serve them
    assert policy(model).decide(decode(kv, 3, extras={"output_scale": 2.0})).reason is EagerReason.NOT_CAPTURED


def test_decode_falls_back_to_token_plan(model, kv):
    plans = PublishedPlans((32, 64), published={desc(32)})
    d = policy(model, plans=plans).decide(decode(kv, 9))
    assert d.path is Path.PIECEWISE and d.descriptor == desc(32)
    # the coordinator's global prefill: a locally decoding rank replays the token plan
    d = policy(model, plans=plans).decide(decode(kv, 3, global_decode=False))
    assert d.path is Path.PIECEWISE
    # ... or goes eager with the piecewise reason when there is no plan
    d = policy(model, plans=PublishedPlans((32,))).decide(decode(kv, 3, global_decode=False))
    assert d.path is Path.EAGER and d.reason is EagerReason.NO_PLAN
    # a decode rejection that PCG cannot serve either keeps the decode reason
    d = policy(model, plans=PublishedPlans((32,))).decide(decode(kv, 9))
    assert d.reason is EagerReason.BATCH_TOO_LARGE


def test_prefill_paths(model, kv):
    plans = PublishedPlans((32, 64), published={desc(32)})
    p = policy(model, plans=plans)
    assert p.decide(prefill(kv, (20,))).path is Path.PIECEWISE
    assert p.decide(prefill(kv, (40,))).reason is EagerReason.NO_PLAN  # serving never builds
    assert p.decide(prefill(kv, (40,)), preparing=True).path is Path.BUILD
    assert p.decide(prefill(kv, (20,)), preparing=True).path is Path.PIECEWISE
    assert p.decide(prefill(kv, (70,))).reason is EagerReason.TOO_MANY_TOKENS
    assert p.decide(prefill(kv, (20,), chunked_prefill=True)).reason is EagerReason.CHUNKED_PREFILL
    assert p.decide(prefill(kv, (20,), micro_batch=True), preparing=True).reason is EagerReason.MICRO_BATCH
    assert p.decide(prefill(kv, (20,), extras={"v": torch.ones(2)})).reason is EagerReason.DYNAMIC_EXTRAS
    assert p.decide(prefill(kv, (20,), adapter_ids=torch.zeros(1))).reason is EagerReason.LIVE_ADAPTER


def test_static_eager_reasons(model, kv):
    assert policy(model, eager=True).decide(decode(kv, 2)).reason is EagerReason.EAGER_MODE
    assert policy(model, cuda=False).decide(decode(kv, 2)).reason is EagerReason.NO_CUDA
    assert policy(model).decide(prefill(kv, (5,))).reason is EagerReason.PCG_DISABLED
    assert policy(model, off=EagerReason.PCG_UNSUPPORTED_BY_MODEL).decide(prefill(kv, (5,))).reason is \
        EagerReason.PCG_UNSUPPORTED_BY_MODEL
    empty = toy_step([([1], 0, [1])], kv, BS, W, "cpu")
    empty = dataclasses.replace(empty, input_ids=empty.input_ids[:0])
    assert policy(model).decide(empty).reason is EagerReason.EMPTY_STEP


# ---------------------------------------------------------------- the runner on CPU


def make_runner(model, kv, **cfg):
    created = []
    cfg = {"max_decode_batch": 8, "pcg_max_tokens": 64, "pcg_token_stride": 32, **cfg}
    runner = CUDAGraphRunner(model, GraphRunnerConfig(**cfg), "cpu", toy_dummy_factory(kv, BS, W, "cpu", created), W)
    return runner, created


def test_cpu_runner_is_eager_and_equals_model(model, kv):
    runner, _ = make_runner(model, kv)
    assert runner.stream is None and not runner.piecewise_enabled
    step = prefill(kv, (5, 3))
    ref_kv = [(k.clone(), v.clone()) for k, v in kv]
    out = runner(step)
    with torch.inference_mode():
        ref = model(step.input_ids, step.position_ids, ref_kv, step.attn_metadata)
    assert out.shape == (8, 32) and torch.equal(out, ref)
    assert torch.equal(kv[0][0], ref_kv[0][0])
    runner(decode(kv, 2))
    snap = runner.stats.snapshot()
    assert snap["steps"] == {"full_graph": 0, "prefill_graph": 0, "piecewise": 0, "eager": 2}
    assert snap["eager_reasons"] == {"no_cuda": 2}
    assert runner.decide(decode(kv, 2)).reason is EagerReason.NO_CUDA


def test_cpu_startup_protocol_runs_eager_warmups(model, kv):
    runner, created = make_runner(model, kv)
    assert runner.decode_capture_sizes() == [8, 4, 2, 1]
    assert runner.prefill_capture_sizes() == [64, 32]
    for b in runner.decode_capture_sizes():
        assert runner.capture_decode(b) >= 0.0
    for t in runner.prefill_capture_sizes():
        assert runner.capture_prefill(t) >= 0.0
    assert [(s.num_tokens, s.batch_size, s.is_decoding) for s in created] == \
        [(8, 8, True), (4, 4, True), (2, 2, True), (1, 1, True), (64, 1, False), (32, 1, False)]
    snap = runner.stats.snapshot()
    assert set(snap["capture"]["decode"]) == {"8", "4", "2", "1"}
    assert not any(v["graph"] for v in snap["capture"]["decode"].values())
    assert snap["captured_decode"] == 0 and snap["captured_prefill"] == 0
    assert snap["steps"]["eager"] == 0  # warm-ups are not serving steps
    with pytest.raises(GraphCaptureError):
        runner.capture_decode(3)
    with pytest.raises(GraphCaptureError):
        runner.capture_prefill(48)


def test_eager_mode_reason(model, kv):
    runner, _ = make_runner(model, kv, eager_mode=True)
    runner(prefill(kv, (4,)))
    assert runner.stats.snapshot()["eager_reasons"] == {"eager_mode": 1}


def test_reset_runs_every_hook_and_raises_the_first_error(model, kv):
    runner, _ = make_runner(model, kv)
    calls = []
    first = RuntimeError("first")
    runner.add_reset_hook(lambda: calls.append("a"))

    def bad():
        calls.append("bad")
        raise first

    runner.add_reset_hook(bad)
    runner.add_reset_hook(lambda: (calls.append("c"), (_ for _ in ()).throw(ValueError("second"))))
    runner.add_reset_hook(lambda: calls.append("d"))
    with pytest.raises(RuntimeError) as ei:
        runner.reset()
    assert ei.value is first and calls == ["a", "bad", "c", "d"]
    assert runner.stats.snapshot()["resets"] == 1


def test_toy_decode_matches_recompute(model):
    """The test model itself is right: prefill 5 + decode 1 == prefill 6 (last token)."""
    kv1, kv2 = toy_kv_caches(model, 16, BS, "cpu"), toy_kv_caches(model, 16, BS, "cpu")
    with torch.inference_mode():
        s = toy_step([(list(range(1, 7)), 0, [1, 2])], kv1, BS, W, "cpu")
        full = model(s.input_ids, s.position_ids, kv1, s.attn_metadata)
        s1 = toy_step([(list(range(1, 6)), 0, [1, 2])], kv2, BS, W, "cpu")
        model(s1.input_ids, s1.position_ids, kv2, s1.attn_metadata)
        s2 = toy_step([([6], 5, [1, 2])], kv2, BS, W, "cpu")
        out = model(s2.input_ids, s2.position_ids, kv2, s2.attn_metadata)
    torch.testing.assert_close(out[0], full[-1], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- stats


def test_stats_snapshot_is_json_and_counts():
    s = RunnerStats()
    s.record_step(ExecPath.FULL_GRAPH, 3, 4)
    s.record_step(ExecPath.PIECEWISE, 100, 512)
    s.record_step(ExecPath.EAGER, 10, 10, EagerReason.CHUNKED_PREFILL)
    s.record_step(ExecPath.EAGER, 10, 10, EagerReason.CHUNKED_PREFILL)
    s.record_capture("decode", 4, 0.5, True)
    s.record_capture("prefill", 512, 1.5, True)
    s.decode_graph_pool_bytes = 1 << 20
    snap = json.loads(json.dumps(s.snapshot()))
    assert snap["steps"] == {"full_graph": 1, "prefill_graph": 0, "piecewise": 1, "eager": 2}
    assert snap["eager_reasons"] == {"chunked_prefill": 2}
    assert snap["tokens"]["real_total"] == 123 and snap["tokens"]["padded_total"] == 536
    assert snap["capture"]["decode"]["4"] == {"seconds": 0.5, "graph": True}
    assert snap["captured_decode"] == 1 and snap["captured_prefill"] == 1
    assert snap["memory"]["decode_graph_pool_bytes"] == 1 << 20
    s.on_reset()
    snap = s.snapshot()
    assert snap["resets"] == 1 and snap["capture"]["decode"] == {} and snap["steps"]["eager"] == 2
    assert snap["memory"]["decode_graph_pool_bytes"] == 0
    with pytest.raises(ValueError):
        s.record_capture("encode", 1, 0.1, True)
