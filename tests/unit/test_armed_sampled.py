"""Armed decode of sampled steps (`actors.armed`), the host side: which head an arm replays, when a request goes
or cancels, and the order of an arm and a go. Only the CUDA pieces are fakes (the gate kernel, pinned buffers,
CUDA events, graph replays); the sampler's parameter block, its ring of mirrors and the decisions are real.

The tokens themselves (an armed go draws bitwise what the unarmed path draws) are the GPU tests'
(tests/gpu/test_armed_decode.py)."""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from actors import armed
from actors.armed import ArmedDecode, arm_serves
from actors.batch import SamplerExtras, StepBatch, prev_token
from actors.decode_state import PendingTokens
from actors.rank_io import RankStepIO
from actors.step_sampler import GRAPH_LOGPROBS, GraphHead, StepSampler, pack_logprobs
from graphrunner.full_graph import DecodeGraphKey
from modeling.sampler.params import Q_POSITION, Q_SEED, F_TEMPERATURE, F_TOP_P

VOCAB, BUCKET = 1000, 4


def _sampler() -> StepSampler:
    s = StepSampler(torch.device("cpu"), VOCAB, 256)
    list(s.graph_heads(lambda h, b: h, max_rows=16))  # makes the heads' parameter block
    return s


def _captured(bucket: int, name: str):
    return () if bucket <= 16 else None


def _extras(n: int, num_logprobs: int, bias: bool = False) -> SamplerExtras:
    none_i, none_f = np.full((n, 1), -1, np.int32), np.zeros((n, 1), np.float32)
    bias_ids = np.full((n, 1), 3 if bias else -1, np.int32)
    return SamplerExtras(np.zeros(n, np.float32), np.tile(np.array([0.0, 0.0, 1.0], np.float32), (n, 1)), bias_ids,
                         none_f + (1.0 if bias else 0.0), none_i.copy(), none_i.copy(), np.zeros((n, 1), np.int32),
                         num_logprobs)


def _batch(n: int = 3, ids=None, temperature=None, top_p=None, top_k=None, seeds=None, extras=None) -> StepBatch:
    ids = [[5 + i] for i in range(n)] if ids is None else ids
    b = StepBatch.from_sequences(ids, [10 + i for i in range(n)], [[1 + i] for i in range(n)], temperature=temperature,
                                 top_k=top_k, top_p=top_p, seeds=seeds)
    return b if extras is None else dataclasses.replace(b, extras=extras)


def _top_p(n: int = 3, seed0: int = 7) -> StepBatch:
    return _batch(n, temperature=[1.0] * n, top_p=[0.9] * n, seeds=[seed0 + i for i in range(n)])


def _lp5(n: int = 3) -> StepBatch:  # greedy rows asking for the top-5 logprobs
    return _batch(n, extras=_extras(n, 5))


# ---- which head a step needs (StepSampler.graph_head) and when an arm serves it (arm_serves)
def test_graph_head_names_the_head_the_unarmed_path_stages():
    s = _sampler()
    cases = [(_top_p(), GraphHead("sample_p", -1)),
             (_batch(temperature=[0.7] * 3, top_k=[20] * 3, seeds=[1, 2, 3]), GraphHead("sample_k", -1)),
             (_batch(temperature=[0.0, 1.0, 0.0], seeds=[1, 2, 3], extras=_extras(3, 5)), GraphHead("sample_lp", 5)),
             (_batch(temperature=[1.0] * 3, top_k=[9] * 3, top_p=[0.8] * 3, seeds=[1, 2, 3], extras=_extras(3, 0)),
              GraphHead("sample_kp_lp", 0))]
    for batch, want in cases:
        head, rows, _ = s.graph_head(batch, BUCKET, _captured)
        assert head == want and rows.n == batch.batch_size
        assert s.stage_graph_rows(batch, BUCKET, _captured) == want.name
        assert s.head_params(head) is s.graph_params


def test_greedy_rows_asking_for_logprobs_take_the_head_that_stages_nothing():
    s = _sampler()
    before = [(m.rows_key, m.dirty, m.scalars_np.copy()) for m in s.graph_params._mirrors]
    for batch, want in [(_lp5(), GraphHead("greedy_lp", 5)), (_batch(extras=_extras(3, 3)), GraphHead("greedy_lp", 3)),
                        (_batch(top_k=[9] * 3, top_p=[0.5] * 3, extras=_extras(3, 0)), GraphHead("greedy_lp", 0)),
                        (_batch(temperature=[1e-6] * 3, extras=_extras(3, 1)), GraphHead("greedy_lp", 1))]:
        assert s.graph_head(batch, BUCKET, _captured) == (want, None, None)
        assert s.stage_graph_rows(batch, BUCKET, _captured) == want.name
        assert s.head_params(want) is None
    after = [(m.rows_key, m.dirty, m.scalars_np) for m in s.graph_params._mirrors]
    assert all(a[:2] == b[:2] and np.array_equal(a[2], b[2]) for a, b in zip(before, after))  # nothing staged
    assert s.head_params(None) is None
    # no head of that name captured for the bucket: the eager sampler's step; a processed batch: eager too
    assert s.graph_head(_lp5(), BUCKET, lambda b, name: None if name == "greedy_lp" else ()) is None
    assert s.graph_head(_batch(extras=_extras(3, 5, bias=True)), BUCKET, _captured) is None
    # the eager sampler's steps: no head
    assert s.graph_head(_batch(extras=_extras(3, GRAPH_LOGPROBS + 1)), BUCKET, _captured) is None
    assert s.graph_head(_batch(extras=_extras(3, -1, bias=True)), BUCKET, _captured) is None
    assert s.graph_head(_batch(temperature=[1.0] * 3, top_k=[500] * 3, seeds=[1, 2, 3]), BUCKET, _captured) is None
    assert s.graph_head(_top_p(), 32, _captured) is None  # no head captured for the bucket


def test_arm_serves_only_the_same_graph_and_head():
    key, other = DecodeGraphKey(4), DecodeGraphKey(8)
    lane, twin, far = SimpleNamespace(key=key), SimpleNamespace(key=DecodeGraphKey(4)), SimpleNamespace(key=other)
    p, lp5 = GraphHead("sample_p", -1), GraphHead("sample_lp", 5)
    assert arm_serves(lane, None, lane, None) and arm_serves(lane, None, twin, None)  # greedy, any lane of the graph
    assert arm_serves(lane, p, twin, GraphHead("sample_p", -1)) and arm_serves(lane, lp5, lane, lp5)
    assert not arm_serves(lane, p, far, p)  # another graph
    assert not arm_serves(lane, None, lane, p) and not arm_serves(lane, p, lane, None)  # greedy <-> sampled
    assert not arm_serves(lane, p, lane, GraphHead("sample_kp", -1))  # another variant
    assert not arm_serves(lane, lp5, lane, GraphHead("sample_lp", 3))  # other logprobs
    assert not arm_serves(lane, lp5, lane, GraphHead("sample_p_lp", 5))


# ---- the rank's go / cancel decision (RankStepIO._take_arm) over a recording armer
class _Armer:
    def __init__(self):
        self.calls = []

    def cancel(self):
        self.calls.append("cancel")

    def take(self, runner, lane, batch, pending, head=None, rows=None, rows_key=None):
        self.calls.append(("take", head, None if rows is None else rows.n))
        return None  # as if the arm could not take it: nothing else to fake


class _Rank(RankStepIO):
    def __init__(self):
        self.logits_observer = None
        self._sampler = _sampler()
        self.runner = SimpleNamespace(epilogue_outputs=_captured)

    def sampler(self):
        return self._sampler


@pytest.mark.parametrize("batch,greedy,want", [
    (_batch(), True, ("take", None, None)),
    (_top_p(), False, ("take", GraphHead("sample_p", -1), 3)),
    (_lp5(), False, ("take", GraphHead("greedy_lp", 5), None)),
    (_batch(temperature=[1.0, 0.0, 0.0], seeds=[1, 2, 3], extras=_extras(3, 5)), False,
     ("take", GraphHead("sample_lp", 5), 3)),
    (_batch(extras=_extras(3, -1, bias=True)), False, "cancel"),  # the eager sampler's step
    (_batch(extras=_extras(3, 8)), False, "cancel"),  # more logprobs than the heads yield
    (_batch(ids=[[prev_token(0)], [7], [8]], temperature=[1.0] * 3, top_p=[0.9] * 3, seeds=[1, 2, 3]), False,
     "cancel"),  # ids on the device
    (_batch(ids=[[prev_token(i)] for i in range(3)]), True, "cancel"),
])
def test_take_arm_goes_for_greedy_and_captured_heads_and_cancels_the_rest(batch, greedy, want):
    rank, armer = _Rank(), _Armer()
    assert rank._take_arm(armer, SimpleNamespace(key=DecodeGraphKey(BUCKET)), greedy, batch) is None
    assert armer.calls == [want]


def test_take_arm_cancels_without_a_lane_or_under_a_logits_observer():
    rank, armer = _Rank(), _Armer()
    rank._take_arm(armer, None, False, _top_p())
    rank.logits_observer = lambda lg: None
    rank._take_arm(armer, SimpleNamespace(key=DecodeGraphKey(BUCKET)), False, _top_p())
    assert armer.calls == ["cancel", "cancel"]


# ---- ArmedDecode: a sampled arm and its go / cancel, in order, over fake CUDA pieces
class _Gate:
    def __init__(self, device, max_polls):
        self.next_seq, self.calls, self.gave_up = 1, None, False

    def enqueue(self):
        self.calls.append("gate")

    def take_seq(self):
        self.next_seq += 1
        return self.next_seq - 1

    def open(self, seq, go):
        self.calls.append(("open", seq, go))
        self.last = (seq, go)

    def ran(self, seq):
        return None if self.last[0] != seq else (self.last[1] and not self.gave_up)


class _Event:
    def __init__(self):
        self.recorded = 0

    def record(self, stream=None):
        self.recorded += 1

    def query(self):
        return True

    def synchronize(self):
        pass


class _Runner:
    """The graph runner's armed-decode calls, recorded; the sampler heads' outputs are fixed tensors."""

    def __init__(self, calls, bucket=BUCKET):
        self.calls = calls
        b, k = bucket, GRAPH_LOGPROBS
        ar = torch.arange(b * k)
        tokens = torch.arange(200, 200 + b)
        self.lp = (-torch.arange(b, dtype=torch.float32), ar.view(b, k), -ar.view(b, k).float() / 8)
        self.outs = {"sample_p": (torch.arange(100, 100 + b),),
                     "sample_lp": (tokens, pack_logprobs(tokens, *self.lp)),  # as the captured logprob head
                     "greedy_lp": (tokens + 1, pack_logprobs(tokens + 1, *self.lp))}

    def arm_decode(self, key, gate):
        self.calls.append("pad staging")
        gate()
        self.calls += ["staging transfer", "decode graph"]

    def replay_epilogue(self, bucket, name):
        self.calls.append(("head", name))
        return self.outs[name]

    def epilogue_outputs(self, bucket, name):
        return self.outs.get(name)

    def stage_armed_decode(self, key, ids, num_history, block_tables, block_size):
        self.calls.append("stage decode")


def test_armed_goes_of_a_decode_loop_write_what_a_full_staging_does():
    """Goes over a decode loop (positions moving on, then other rows and other sizes) on a ring of mirrors: an arm's
    upload keeps the mirror's rows and a go with rows of the same key writes only their positions, yet the block
    each go leaves on the device equals staging that step from scratch."""
    from modeling.sampler.params import _Mirror

    s = _sampler()
    got = s.graph_params
    got._mirrors += [_Mirror(got.max_batch, got.layout.width, False) for _ in range(3)]
    for m in got._mirrors[1:]:
        got._reset_rows(m, 0, got.max_batch)

    def step(k: int, n: int = 3, temperature: float = 1.0) -> StepBatch:
        b = _batch(n, temperature=[temperature] * n, top_p=[0.9] * n, seeds=[7 + i for i in range(n)])
        return dataclasses.replace(b, num_history=b.num_history + k)

    steps = [step(k) for k in range(9)] + [step(9, temperature=0.5), step(10, temperature=0.5), step(11, n=2),
                                           step(12, n=2), step(13)] + [step(14 + k) for k in range(5)]
    positions_only = 0
    for batch in steps:
        head, rows, key = s.graph_head(batch, BUCKET, _captured)
        slot = got.arm_upload(BUCKET)
        before = got._mirrors[slot].scalars_np.copy()
        got.stage_armed(slot, rows, key)
        after = got._mirrors[slot].scalars_np
        changed = {int(c) for c in np.nonzero((before != after).any(0))[0]}
        positions_only += changed <= set(range(8 * Q_POSITION, 8 * Q_POSITION + 8))
        got.upload(BUCKET, lists=False)  # on CPU the arm's copy ran before the rows were written: copy again
        fresh = _sampler().graph_params
        fresh.stage(_sampler()._graph_rows(batch)[0])
        fresh.upload(BUCKET, lists=False)
        assert torch.equal(got.scalars[:BUCKET], fresh.scalars[:BUCKET])
    # a mirror of the ring of 4 writes whole rows when it last held other rows (another key or size): 5 of the first
    # 9 goes and 2 of the last 5 rewrote the positions alone
    assert positions_only == 7


@pytest.fixture
def parts(monkeypatch):
    monkeypatch.setattr(armed, "HostGate", _Gate)
    monkeypatch.setattr(armed, "_pinned", lambda shape, dtype: torch.zeros(shape, dtype=dtype))
    monkeypatch.setattr(armed, "_event", _Event)
    calls = []
    armer = ArmedDecode(torch.device("cpu"), wait_s=60.0)
    armer.gate.calls = calls
    sampler = _sampler()
    params = sampler.graph_params
    upload, stage_armed = params.upload, params.stage_armed
    monkeypatch.setattr(params, "upload", lambda *a, **k: (calls.append("params transfer"), upload(*a, **k)))
    monkeypatch.setattr(params, "stage_armed", lambda *a: (calls.append("stage params"), stage_armed(*a)))
    lane = SimpleNamespace(key=DecodeGraphKey(BUCKET), block_size=16, tokens=None)
    return SimpleNamespace(armer=armer, calls=calls, sampler=sampler, params=params, runner=_Runner(calls),
                           lane=lane)


def _mirror(params, slot):
    return params._mirrors[slot].scalars_np.copy()


def test_sampled_arm_orders_gate_decode_graph_params_head_then_copies(parts):
    a, head = parts.armer, GraphHead("sample_p", -1)
    a.arm(parts.runner, parts.lane, head, parts.params)
    assert parts.calls == ["pad staging", "gate", "staging transfer", "decode graph", "params transfer",
                           ("head", "sample_p")]
    arm = a._arm
    assert a.armed and a.counts["armed"] == 1 and arm.event.recorded == 1
    # padding: the (fresh) mirror the armed transfer reads holds default rows (greedy, seed 0) until a go writes it;
    # a mirror that served a step keeps that step's rows (test_armed_goes_of_a_decode_loop_...)
    m = _mirror(parts.params, arm.slot)
    assert (m.view(np.float32)[:, F_TEMPERATURE] == 0).all() and (m.view(np.int64)[:, Q_SEED] == 0).all()
    assert torch.equal(arm.host[0], parts.runner.outs["sample_p"][0])  # the head's whole bucket is copied


def test_sampled_go_writes_both_mirrors_before_it_opens_the_gate(parts):
    a, head = parts.armer, GraphHead("sample_p", -1)
    a.arm(parts.runner, parts.lane, head, parts.params)
    slot, seq = a._arm.slot, a._arm.seq
    del parts.calls[:]
    batch = _top_p(3, seed0=40)
    need, rows, _ = parts.sampler.graph_head(batch, BUCKET, _captured)
    assert need == head
    got = a.take(parts.runner, parts.lane, batch, PendingTokens, need, rows)
    assert parts.calls == ["stage decode", "stage params", ("open", seq, True)]
    assert a.counts["went"] == 1 and not a.armed
    np.testing.assert_array_equal(got.result(), [100, 101, 102])
    # the mirror the armed transfer reads now holds the live rows, exactly what the unarmed staging writes
    m = _mirror(parts.params, slot)
    ref = _sampler().graph_params
    ref.stage(rows)
    np.testing.assert_array_equal(m, _mirror(ref, ref._cur))
    q = m.view(np.int64)
    np.testing.assert_array_equal(q[:3, Q_SEED], [40, 41, 42])
    np.testing.assert_array_equal(q[:3, Q_POSITION], [11, 12, 13])  # num_history + 1
    np.testing.assert_allclose(m.view(np.float32)[:3, F_TOP_P], 0.9)
    assert (m.view(np.float32)[3:, F_TEMPERATURE] == 0).all()  # the bucket's padding rows stay greedy
    (whole, _), = a._free_sampled[(BUCKET, 1)]  # its buffers come back whole for the next arm
    assert len(whole) == 1 and whole[0].shape == (BUCKET,)


@pytest.mark.parametrize("name", ["sample_lp", "greedy_lp"])
def test_logprob_go_reads_back_the_steps_top_n_like_the_unarmed_path(parts, name):
    """A sampled logprob head's go stages its rows into the heads' block; the greedy logprob head's arm uploads no
    block and its go stages nothing (`StepSampler.head_params`)."""
    a, head = parts.armer, GraphHead(name, 5)
    params = parts.sampler.head_params(head)
    assert (params is None) == (name == "greedy_lp")
    mirrors = [(m.rows_key, m.dirty, m.scalars_np.copy()) for m in parts.params._mirrors]
    a.arm(parts.runner, parts.lane, head, params)
    batch = _lp5(3) if name == "greedy_lp" else _batch(3, temperature=[1.0] * 3, seeds=[1, 2, 3],
                                                       extras=_extras(3, 5))
    need, rows, _ = parts.sampler.graph_head(batch, BUCKET, _captured)
    assert need == head
    out = a.take(parts.runner, parts.lane, batch, PendingTokens, need, rows).result()
    if name == "greedy_lp":
        assert all(a_[:2] == b_[:2] and np.array_equal(a_[2], b_[2])
                   for a_, b_ in zip(mirrors, [(m.rows_key, m.dirty, m.scalars_np) for m in parts.params._mirrors]))
    outs, (chosen, top_ids, top_lp) = parts.runner.outs[name], parts.runner.lp
    np.testing.assert_array_equal(out.tokens, outs[0][:3].numpy())
    np.testing.assert_array_equal(out.logprobs.chosen, chosen[:3].numpy())
    np.testing.assert_array_equal(out.logprobs.top_ids, top_ids[:3, :5].numpy())
    np.testing.assert_array_equal(out.logprobs.top_logprobs, top_lp[:3, :5].numpy())
    assert out.logprobs.top_ids.dtype == np.int32 and out.logprobs.top_ids.shape == (3, 5)
    (whole, _), = a._free_sampled[(BUCKET, 2)]
    assert [t.shape for t in whole] == [(BUCKET,), (BUCKET, 2 + 2 * GRAPH_LOGPROBS)]


@pytest.mark.parametrize("need", [GraphHead("sample_p", -1), GraphHead("sample_lp", 3), None])
def test_another_head_cancels_on_padding(parts, need):
    """An arm of the top-5 logprob head: a step needing another variant, other logprobs or the greedy head
    cancels: the gate opens on padding, nothing is staged, the mirrors stay padding."""
    a = parts.armer
    a.arm(parts.runner, parts.lane, GraphHead("sample_lp", 5), parts.params)
    slot, seq = a._arm.slot, a._arm.seq
    before = _mirror(parts.params, slot)
    del parts.calls[:]
    batch = _top_p() if need is not None and need.num_logprobs < 0 else (_batch(extras=_extras(3, 3))
                                                                          if need is not None else _batch())
    rows = None if need is None else parts.sampler.graph_head(batch, BUCKET, _captured)[1]
    assert a.take(parts.runner, parts.lane, batch, PendingTokens, need, rows) is None
    assert parts.calls == [("open", seq, False)]
    assert a.counts["cancelled"] == 1 and a.counts["went"] == 0 and not a.armed
    np.testing.assert_array_equal(_mirror(parts.params, slot), before)
    assert len(a._free_sampled[(BUCKET, 2)]) == 1


def test_a_greedy_arm_cancels_for_a_sampled_step_and_a_sampled_go_follows(parts):
    a = parts.armer
    parts.runner.outs["greedy"] = (torch.arange(300, 300 + BUCKET),)
    parts.lane.head_out = parts.runner.outs["greedy"][0]
    parts.lane.replay_head = lambda runner: parts.calls.append(("head", "greedy"))
    a.arm(parts.runner, parts.lane)
    assert a._arm.head is None and "params transfer" not in parts.calls
    batch = _top_p()
    need, rows, _ = parts.sampler.graph_head(batch, BUCKET, _captured)
    assert a.take(parts.runner, parts.lane, batch, PendingTokens, need, rows) is None
    assert a.counts["cancelled"] == 1
    a.arm(parts.runner, parts.lane, need, parts.params)  # the rank arms again with the head that step took
    got = a.take(parts.runner, parts.lane, _top_p(2), PendingTokens, *parts.sampler.graph_head(_top_p(2), BUCKET,
                                                                                              _captured))
    np.testing.assert_array_equal(got.result(), [100, 101])  # another batch size of the same bucket
    assert a.counts == {"armed": 2, "went": 1, "cancelled": 1, "expired": 0}


def test_a_sampled_go_whose_gate_gave_up_takes_the_usual_path(parts):
    a = parts.armer
    a.arm(parts.runner, parts.lane, GraphHead("sample_p", -1), parts.params)
    a.gate.gave_up = True
    assert a.take(parts.runner, parts.lane, _top_p(), PendingTokens,
                  *parts.sampler.graph_head(_top_p(), BUCKET, _captured)) is None
    assert a.counts["expired"] == 1 and a.counts["went"] == 0 and len(a._free_sampled[(BUCKET, 1)]) == 1


def test_arm_upload_then_stage_armed_uploads_what_stage_and_upload_do():
    """The parameter block a go leaves on the device equals the unarmed staging's, for every batch size."""
    for n in (1, 3, 4):
        rows = _sampler().graph_head(_top_p(n), BUCKET, _captured)[1]
        ref, got = _sampler().graph_params, _sampler().graph_params
        ref.stage(rows)
        ref.upload(BUCKET, lists=False)
        slot = got.arm_upload(BUCKET)  # on CPU the copy runs at once: write the live rows, then copy again
        got.stage_armed(slot, rows)
        got.upload(BUCKET, lists=False)
        assert torch.equal(got.scalars[:BUCKET], ref.scalars[:BUCKET])
