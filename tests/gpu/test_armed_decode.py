"""Armed decode (`actors.armed`): the rank enqueues its next decode step behind a host-opened gate.

Steps taken by an arm give the same tokens as the dispatched path; a cancelled arm writes no KV and leaves the
previous step's tokens intact for steps that refer to them; a request of another shape cancels the arm and
runs after its padding replay; an arm whose gate gave up is detected and the step runs the usual way. Sampled
steps (a captured sampler head) arm with their head: a go draws bitwise the unarmed tokens (and logprobs), and a
step needing another head cancels and still gets its own tokens."""
import dataclasses
import time

import numpy as np
import pytest
import torch

from actors.armed import ArmedDecode
from actors.batch import SamplerExtras, StepBatch, prev_token
from actors.host_gate import HostGate
from actors.step_sampler import GraphHead
from tests.gpu.helpers import Seqs, make_runtime, random_tokens

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def rt():
    return make_runtime(max_decode_batch=16, pcg_max_tokens=0, head_graph_max_batch=16)


def _prefill(rt, n: int, seed: int, extra: int):
    rng = np.random.default_rng(seed)
    seqs, vocab = Seqs(rt), rt.model_config.vocab_size
    prompts = [random_tokens(rng, int(rng.integers(5, 150)), vocab) for _ in range(n)]
    tables = [seqs.new(len(p) + extra) for p in prompts]
    return prompts, tables, rt.execute(StepBatch.from_sequences(prompts, [0] * n, tables))


def _logprob_extras(n: int, num_logprobs: int) -> SamplerExtras:
    """Sampler extras that ask only for logprobs (no min_p, penalties, bias or bans)."""
    none_i, none_f = np.full((n, 1), -1, np.int32), np.zeros((n, 1), np.float32)
    return SamplerExtras(np.zeros(n, np.float32), np.tile(np.array([0.0, 0.0, 1.0], np.float32), (n, 1)), none_i,
                         none_f, none_i.copy(), none_i.copy(), np.zeros((n, 1), np.int32), num_logprobs)


def _step(ids, hist, tables, sampling=None, num_logprobs=None) -> StepBatch:
    b = StepBatch.from_sequences([[int(t)] for t in ids], hist, tables, **(sampling or {}))
    return b if num_logprobs is None else dataclasses.replace(b, extras=_logprob_extras(len(hist), num_logprobs))


def _decode(rt, prompts, tables, first, k: int, arm: bool, sampling=None, num_logprobs=None) -> list:
    """`k` decode steps fed through the host (arming before each when `arm`): each step's token list, or with
    `num_logprobs` its (tokens, chosen, top ids, top logprobs) arrays."""
    got, ids = [], first
    for j in range(k):
        b = _step(ids, [len(p) + j for p in prompts], tables, sampling, num_logprobs)
        if arm:
            rt.arm_next()
        out = rt.launch(b, validated=True).result()
        if num_logprobs is None:
            ids = out
            got.append(out.tolist())
        else:
            ids = out.tokens
            got.append((out.tokens, out.logprobs.chosen, out.logprobs.top_ids, out.logprobs.top_logprobs))
    return got


@pytest.mark.parametrize("n", [1, 3])
def test_armed_steps_equal_dispatched_steps(rt, n):
    prompts, tables, first = _prefill(rt, n, 400 + n, 10)
    rt._lanes.clear()
    counts0 = dict(rt._armer.counts)
    full0 = rt.runner.stats.snapshot()["steps"].get("full_graph", 0)
    armed = _decode(rt, prompts, tables, first, 6, arm=True)
    c = rt._armer.counts
    # step 1 dispatches and makes the lane; steps 2-6 take the arm made after the step before
    assert c["went"] - counts0["went"] == 5 and c["expired"] == counts0["expired"]
    assert rt.runner.stats.snapshot()["steps"]["full_graph"] == full0 + 6
    rt._lanes.clear()
    rt._last_lane = None
    assert armed == _decode(rt, prompts, tables, first, 6, arm=False)  # rewrites the same K/V


@torch.inference_mode()
def test_cancelled_arm_writes_no_kv_and_keeps_previous_tokens(rt):
    prompts, tables, first = _prefill(rt, 2, 500, 10)
    _decode(rt, prompts, tables, first, 3, arm=False)  # a lane for batch 2 now exists
    b = StepBatch.from_sequences([[int(t)] for t in first], [len(p) for p in prompts], tables)
    host = rt.launch(b, validated=True).result()
    assert rt.arm_next()
    cancelled = rt._armer.counts["cancelled"]
    # the next step refers to the previous step's tokens on the device: the arm cannot take it, and its
    # padding replay must not have clobbered the tokens the reference reads
    ahead = StepBatch.from_sequences([[prev_token(0)], [prev_token(1)]], [len(p) + 1 for p in prompts], tables)
    got = rt.launch(ahead, validated=True).result()
    assert rt._armer.counts["cancelled"] == cancelled + 1
    fed = StepBatch.from_sequences([[int(t)] for t in host], [len(p) + 1 for p in prompts], tables)
    np.testing.assert_array_equal(got, rt.execute(fed))
    # a padding replay writes no KV at all
    again = StepBatch.from_sequences([[int(t)] for t in got], [len(p) + 2 for p in prompts], tables)
    rt.launch(again, validated=True).result()
    kv = [[t.clone() for t in layer] for layer in rt.kv_cache.layers]
    torch.cuda.synchronize()
    assert rt.arm_next()
    rt.disarm()
    assert rt._armer.counts["cancelled"] == cancelled + 2
    for layer, before in zip(rt.kv_cache.layers, kv):
        for t, k in zip(layer, before):
            assert torch.equal(t, k)


def test_other_shape_cancels_and_runs_behind_the_padding(rt):
    prompts, tables, first = _prefill(rt, 4, 600, 10)
    one = _decode(rt, prompts[:1], tables[:1], first[:1], 3, arm=True)
    assert rt._armer.armed is False
    rt.arm_next()  # armed for batch 1
    b = StepBatch.from_sequences([[int(t)] for t in first], [len(p) for p in prompts], tables)
    cancelled = rt._armer.counts["cancelled"]
    got = rt.launch(b, validated=True).result()
    assert rt._armer.counts["cancelled"] == cancelled + 1
    np.testing.assert_array_equal(got, rt.execute(b))
    assert len(one) == 3


def test_gate_that_gave_up_is_detected(rt):
    prompts, tables, first = _prefill(rt, 1, 700, 10)
    last = _decode(rt, prompts, tables, first, 2, arm=False)[-1]
    keep = rt._armer
    try:
        rt._armer = short = ArmedDecode(rt.device, wait_s=2e-4)
        short.gate.warm_up()
        short.wait_s = 60.0  # the host believes the arm fresh: only the gate's acknowledgement tells
        b = StepBatch.from_sequences([[int(last[0])]], [len(prompts[0]) + 2], tables)
        assert rt.arm_next()
        time.sleep(0.05)  # far past the gate's ~0.2 ms
        got = rt.launch(b, validated=True).result()
        assert short.counts["expired"] == 1 and short.counts["went"] == 0
        np.testing.assert_array_equal(got, rt.execute(b))
    finally:
        rt._armer = keep


def test_gate_waits_for_its_own_sequence_number():
    dev = torch.device("cuda", 0)
    gate = HostGate(dev, max_polls=20_000)
    gate.warm_up()
    stream = torch.cuda.Stream()
    done = torch.cuda.Event()
    with torch.cuda.stream(stream):
        gate.enqueue()
        done.record()
    seq = gate.take_seq()
    time.sleep(0.002)
    assert not done.query() and gate.ran(seq) is None  # still waiting
    gate.open(seq - 1, True)  # an earlier execution's number
    time.sleep(0.002)
    assert not done.query()
    gate.open(seq, True)
    done.synchronize()
    assert gate.ran(seq) is True
    t0 = time.perf_counter()
    with torch.cuda.stream(stream):
        gate.enqueue()
        done.record()
    seq = gate.take_seq()
    done.synchronize()  # nobody opens it: it gives up after its poll budget
    waited = time.perf_counter() - t0
    assert gate.ran(seq) is False
    print(f"gate gave up after {waited * 1e3:.2f} ms for {gate.max_polls} polls")
    assert 0.001 < waited < 2.0


def test_arm_serves_another_batch_size_of_its_bucket(rt):
    prompts, tables, first = _prefill(rt, 4, 800, 10)
    last = _decode(rt, prompts, tables, first, 2, arm=False)[-1]  # lanes for batch 4 ...
    _decode(rt, prompts[:3], tables[:3], first[:3], 2, arm=False)  # ... and batch 3 (same K/V rewritten)
    assert rt.runner.decide(Seqs(rt).step([[1]] * 3, [len(p) for p in prompts[:3]], tables[:3])).decode_key.batch == 4
    four = StepBatch.from_sequences([[t] for t in last], [len(p) + 2 for p in prompts], tables)
    toks = rt.launch(four, validated=True).result()
    assert rt.arm_next()  # the bucket-4 graph, armed after a batch-4 step
    went = rt._armer.counts["went"]
    three = StepBatch.from_sequences([[int(t)] for t in toks[:3]], [len(p) + 3 for p in prompts[:3]], tables[:3])
    got = rt.launch(three, validated=True).result()
    assert rt._armer.counts["went"] == went + 1
    np.testing.assert_array_equal(got, rt.execute(three))


def _top_p(n: int, seed: int) -> dict:
    return dict(temperature=[1.0] * n, top_p=[0.9] * n, seeds=[seed + i for i in range(n)])


@pytest.mark.parametrize("n", [1, 3])
def test_armed_sampled_steps_equal_unarmed_steps(rt, n):
    """Seeded T=1, top_p 0.9 rows: step 1 takes the captured "sample_p" head; steps 2-6 each take the arm made
    after the step before (that head, its parameters staged at go); the tokens equal the same steps unarmed."""
    prompts, tables, first = _prefill(rt, n, 900 + n, 10)
    sampling = _top_p(n, 31)
    counts0 = dict(rt._armer.counts)
    full0 = rt.runner.stats.snapshot()["steps"].get("full_graph", 0)
    armed = _decode(rt, prompts, tables, first, 6, arm=True, sampling=sampling)
    c = rt._armer.counts
    assert rt._last_head == GraphHead("sample_p", -1)
    assert c["went"] - counts0["went"] == 5 and c["expired"] == counts0["expired"]
    assert c["cancelled"] == counts0["cancelled"]
    assert rt.runner.stats.snapshot()["steps"]["full_graph"] == full0 + 6
    went = c["went"]
    unarmed = _decode(rt, prompts, tables, first, 6, arm=False, sampling=sampling)  # rewrites the same K/V
    assert rt._armer.counts["went"] == went
    assert armed == unarmed


@pytest.mark.parametrize("n", [1, 3])
def test_armed_logprob_steps_equal_unarmed_steps(rt, n):
    """Greedy rows asking for the top-5 logprobs take the captured "greedy_lp" head (no parameter block staged or
    uploaded); through armed goes their tokens, chosen logprobs and top-5 ids and logprobs are bitwise those of the
    same steps unarmed, and the tokens are the greedy head's."""
    prompts, tables, first = _prefill(rt, n, 950 + n, 10)
    counts0 = dict(rt._armer.counts)
    armed = _decode(rt, prompts, tables, first, 5, arm=True, num_logprobs=5)
    c = rt._armer.counts
    assert rt._last_head == GraphHead("greedy_lp", 5)
    assert c["went"] - counts0["went"] == 4 and c["expired"] == counts0["expired"]
    unarmed = _decode(rt, prompts, tables, first, 5, arm=False, num_logprobs=5)
    for a, u in zip(armed, unarmed):
        assert a[2].shape == (n, 5) and a[3].shape == (n, 5)
        for x, y in zip(a, u):
            assert x.dtype == y.dtype
            np.testing.assert_array_equal(x, y)  # bitwise: the same head graph on the same rows
    assert (armed[-1][1] <= 0).all()
    greedy = _decode(rt, prompts, tables, first, 5, arm=False)
    for a, g in zip(armed, greedy):
        np.testing.assert_array_equal(a[0], g)


def test_another_sampler_head_cancels_and_runs_behind_the_padding(rt):
    """An arm replays the head of the step before it: a step needing another variant (top_p -> top_k), other
    logprobs (5 -> 3), the greedy head, or a sampled one after a greedy step, cancels it on padding and
    gets the tokens (and logprobs) of the same step run unarmed."""
    n = 3
    prompts, tables, first = _prefill(rt, n, 990, 12)
    hist = [len(p) for p in prompts]
    top_k = dict(temperature=[0.7] * n, top_k=[20] * n, seeds=[60 + i for i in range(n)])
    cases = [(_top_p(n, 50), None, top_k, None), (None, 5, None, 3), (_top_p(n, 70), None, None, None),
             (None, None, _top_p(n, 80), None)]
    ids = first
    for j, (s0, lp0, s1, lp1) in enumerate(cases):
        h = [x + 2 * j for x in hist]
        out = rt.launch(_step(ids, h, tables, s0, lp0), validated=True).result()
        ids = out if lp0 is None else out.tokens
        assert rt.arm_next()
        c = dict(rt._armer.counts)
        nxt = _step(ids, [x + 1 for x in h], tables, s1, lp1)
        got = rt.launch(nxt, validated=True).result()
        assert rt._armer.counts["cancelled"] == c["cancelled"] + 1 and rt._armer.counts["went"] == c["went"]
        want = rt.execute(nxt)  # the same step unarmed (rewrites the same K/V)
        if lp1 is None:
            np.testing.assert_array_equal(got, want)
            ids = got
        else:
            np.testing.assert_array_equal(got.tokens, want.tokens)
            assert got.logprobs.top_ids.shape == (n, lp1)
            for x, y in zip(got.logprobs, want.logprobs):
                np.testing.assert_array_equal(x, y)
            ids = got.tokens
    # the step after a cancel arms with the head that step took (the last case's top_p step) and goes
    h = [x + 2 * len(cases) for x in hist]
    assert rt.arm_next() and rt._armer._arm.head == GraphHead("sample_p", -1)
    went = rt._armer.counts["went"]
    got = rt.launch(_step(ids, h, tables, _top_p(n, 90)), validated=True).result()
    assert rt._armer.counts["went"] == went + 1
    np.testing.assert_array_equal(got, rt.execute(_step(ids, h, tables, _top_p(n, 90))))
