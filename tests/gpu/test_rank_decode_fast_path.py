"""The rank's decode fast path (host metadata, one staging copy, graph replay, LM-head graph) gives the
same tokens and logits as the general path (device metadata, field copies, eager LM head)."""
import numpy as np
import pytest
import torch

import dataclasses

from actors.batch import BatchError, SamplerExtras, StepBatch, prev_token
from actors.protocol import StepHints
from graphrunner.step import ForwardStep
from modeling.attn_metadata import build_step_from_arrays
from tests.gpu.helpers import Seqs, make_runtime, random_tokens

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def rt():
    return make_runtime(max_decode_batch=64, pcg_max_tokens=0, head_graph_max_batch=16)


def _device_step(rt, b: StepBatch) -> ForwardStep:
    ids, pos, meta = build_step_from_arrays(b.token_ids, b.q_seqlens, b.num_history, b.block_tables,
                                            rt.cfg.block_size, rt.device)
    return ForwardStep(ids, pos, rt.kv_cache.layers, meta)


def _general(rt, b: StepBatch):
    step = _device_step(rt, b)
    return rt.model.compute_logits(rt.runner(step), step.attn_metadata.last_token_index)


@pytest.mark.parametrize("n", [1, 3, 16, 20, 64])
@torch.inference_mode()
def test_fast_path_equals_general_path(rt, n):
    rng = np.random.default_rng(n)
    seqs, vocab = Seqs(rt), rt.model_config.vocab_size
    prompts = [random_tokens(rng, int(rng.integers(5, 150)), vocab) for _ in range(n)]
    tables = [seqs.new(len(p) + 4) for p in prompts]
    pre = StepBatch.from_sequences(prompts, [0] * n, tables)
    first = rt.execute(pre)
    dec = StepBatch.from_sequences([[int(t)] for t in first], [len(p) for p in prompts], tables)
    before = rt.runner.stats.snapshot()["steps"].get("full_graph", 0)
    fast = rt.execute(dec)  # greedy head: writes the new token's K/V; the paths below rewrite the same values
    seen = []
    rt.logits_observer = lambda lg: seen.append(lg.clone())
    try:
        fast_with_logits = rt.execute(dec)  # the logits head
    finally:
        rt.logits_observer = None
    assert rt.runner.stats.snapshot()["steps"]["full_graph"] == before + 2
    head = rt.runner.epilogue_outputs(rt.runner.decide(_device_step(rt, dec)).decode_key.batch, "greedy")
    assert (head is not None) == (n <= 16)
    logits = _general(rt, dec)
    np.testing.assert_array_equal(fast, logits.argmax(dim=-1).cpu().numpy())
    np.testing.assert_array_equal(fast_with_logits, fast)
    torch.testing.assert_close(seen[0], logits, rtol=0, atol=0)
    seeded = StepBatch.from_sequences([[int(t)] for t in first], [len(p) for p in prompts], tables,
                                      temperature=[0.8] * n, top_k=[50] * n, seeds=list(range(n)))
    np.testing.assert_array_equal(rt.execute(seeded), rt.execute(seeded))


def test_head_graphs_cover_small_buckets_only(rt):
    st = rt.stats()
    assert st["head_graphs"]["buckets"] == [1, 2, 4, 8, 16]
    assert set(st["head_graphs"]["names"]) == {"greedy", "logits", "sample", "sample_k", "sample_p", "sample_kp",
                                               "sample_lp", "sample_k_lp", "sample_p_lp", "sample_kp_lp", "greedy_lp"}
    assert 0 < st["head_graphs"]["pool_bytes"] < 256 << 20
    rt.reset()
    assert rt.stats()["head_graphs"]["buckets"] == []
    rt.capture_all()
    assert rt.stats()["head_graphs"]["buckets"] == [1, 2, 4, 8, 16]


@pytest.mark.parametrize("n", [1, 3, 20])
@torch.inference_mode()
def test_multi_step_decode_on_device_equals_single_steps(rt, n):
    rng = np.random.default_rng(100 + n)
    seqs, vocab, k = Seqs(rt), rt.model_config.vocab_size, 6
    prompts = [random_tokens(rng, int(rng.integers(5, 150)), vocab) for _ in range(n)]
    tables = [seqs.new(len(p) + k + 1) for p in prompts]
    first = rt.execute(StepBatch.from_sequences(prompts, [0] * n, tables))
    dec = StepBatch.from_sequences([[int(t)] for t in first], [len(p) for p in prompts], tables)
    graphs_before = rt.runner.stats.snapshot()["steps"].get("full_graph", 0)
    multi = rt.execute(dec, num_steps=k)
    assert multi.shape == (n, k)
    assert rt.runner.stats.snapshot()["steps"]["full_graph"] == graphs_before + k
    b, want = dec, []
    for _ in range(k):  # the same positions again, one step at a time (rewrites identical K/V)
        toks = rt.execute(b)
        want.append(toks)
        b = StepBatch.from_sequences([[int(t)] for t in toks], (b.num_history + 1).tolist(), tables)
    np.testing.assert_array_equal(multi, np.stack(want, axis=1))


@pytest.mark.parametrize("n", [1, 3, 20])
@torch.inference_mode()
def test_steps_launched_ahead_with_previous_step_references_equal_host_feedback(rt, n):
    """Two steps in flight, every token id a reference to the previous step's tokens (rows reversed each step,
    so references gather): the same tokens as steps fed through the host; a multi-step call too."""
    rng = np.random.default_rng(200 + n)
    seqs, vocab, k = Seqs(rt), rt.model_config.vocab_size, 8
    prompts = [random_tokens(rng, int(rng.integers(5, 150)), vocab) for _ in range(n)]
    tables = [seqs.new(len(p) + k + 4) for p in prompts]
    first = rt.execute(StepBatch.from_sequences(prompts, [0] * n, tables))
    hist, order, got = [len(p) for p in prompts], list(range(n)), [[int(t)] for t in first]
    in_flight = []
    for _ in range(k):
        cur = order[::-1]
        batch = StepBatch.from_sequences([[prev_token(order.index(s))] for s in cur], [hist[s] for s in cur],
                                         [tables[s] for s in cur])
        in_flight.append((rt.launch(batch, validated=True), cur))
        hist = [h + 1 for h in hist]
        order = cur
        if len(in_flight) == 2:
            pending, rows = in_flight.pop(0)
            for s, t in zip(rows, pending.result().tolist()):
                got[s].append(int(t))
    pending, rows = in_flight.pop(0)
    for s, t in zip(rows, pending.result().tolist()):
        got[s].append(int(t))
    multi = rt.launch(StepBatch.from_sequences([[prev_token(order.index(s))] for s in range(n)], hist, tables),
                      validated=True, num_steps=3).result()
    assert multi.shape == (n, 3)
    want, b = [[int(t)] for t in first], None
    for j in range(k + 3):  # the same positions again, tokens through the host (rewrites identical K/V)
        b = StepBatch.from_sequences([[w[-1]] for w in want], [len(p) + j for p in prompts], tables)
        for w, t in zip(want, rt.execute(b).tolist()):
            w.append(int(t))
    assert got == [w[:k + 1] for w in want]
    np.testing.assert_array_equal(multi, np.array([w[k + 1:] for w in want]))


@torch.inference_mode()
def test_bad_previous_step_reference_raises_before_any_device_work(rt):
    seqs = Seqs(rt)
    table = seqs.new(16)
    rt.execute(StepBatch.from_sequences([[5, 6, 7]], [0], [table]))
    before = rt.runner.stats.snapshot()["steps"]
    kv = rt.kv_cache.layers[0][0].clone() if isinstance(rt.kv_cache.layers[0], (tuple, list)) else None
    with pytest.raises(BatchError, match="refers to row 1 of the previous step, which had 1 rows"):
        rt.launch(StepBatch.from_sequences([[prev_token(1)]], [3], [table]), validated=True)
    with pytest.raises(BatchError, match="refers to row 4 of the previous step, which had 1"):
        rt.execute(StepBatch.from_sequences([[prev_token(4)]], [3], [table]))
    assert rt.runner.stats.snapshot()["steps"] == before
    if kv is not None:
        torch.testing.assert_close(rt.kv_cache.layers[0][0], kv, rtol=0, atol=0)


@pytest.mark.parametrize("n", [1, 5])
def test_decode_lane_equals_dispatched_steps(rt, n):
    """Greedy decode steps of one shape, launched as the coordinator does (validated): from the second on they
    take the rank's decode lane (no runner dispatch). Their tokens equal the same steps run through the dispatch
    (`execute` with checks), and the runner still counts them as full-graph steps."""
    rng = np.random.default_rng(300 + n)
    seqs, vocab, k = Seqs(rt), rt.model_config.vocab_size, 5
    prompts = [random_tokens(rng, int(rng.integers(5, 150)), vocab) for _ in range(n)]
    tables = [seqs.new(len(p) + k + 2) for p in prompts]
    first = rt.execute(StepBatch.from_sequences(prompts, [0] * n, tables))

    def decode(checked: bool) -> list[list[int]]:
        got, ids = [], first
        for j in range(k):
            b = StepBatch.from_sequences([[int(t)] for t in ids], [len(p) + j for p in prompts], tables)
            ids = rt.execute(b) if checked else rt.launch(b, validated=True).result()
            got.append(ids.tolist())
        return got

    rt._lanes.clear()
    before = rt.runner.stats.snapshot()["steps"].get("full_graph", 0)
    lane = decode(checked=False)
    assert (n, n, StepHints()) in rt._lanes
    assert rt.runner.stats.snapshot()["steps"]["full_graph"] == before + k
    assert lane == decode(checked=True)  # rewrites the same K/V at the same positions


SAMPLED_CASES = {  # name of the captured head that must serve it: temperature, top_k, top_p (min_p)
    "sample": ([1.0], [0], [1.0]),
    "sample_k": ([0.7], [50], [1.0]),
    "sample_p": ([1.0], [0], [0.9]),
    "sample_kp": ([1.3], [20], [0.8]),
}


def _graph_and_eager(rt, dec: StepBatch):
    """Run `dec` twice: on the fast path (recording which captured sampler head `stage_graph_rows` picked) and on
    the eager sampler (a logits observer forces it). Returns (fast result, eager result, [head name or None])."""
    staged = []
    orig = rt.sampler().stage_graph_rows
    rt.sampler().stage_graph_rows = lambda *a: staged.append(orig(*a)) or staged[-1]
    try:
        graph = rt.execute(dec)
    finally:
        del rt.sampler().stage_graph_rows
    rt.logits_observer = lambda lg: None
    try:
        eager = rt.execute(dec)
    finally:
        rt.logits_observer = None
    return graph, eager, staged


@pytest.mark.parametrize("n", [1, 3, 16])
@pytest.mark.parametrize("case", sorted(SAMPLED_CASES))
@torch.inference_mode()
def test_captured_sampler_head_equals_eager_sampler(rt, case, n):
    """A sampled decode step served by the captured sampler head of its bucket draws exactly the tokens of the
    eager sampler over the logits head (a logits observer forces that path), rows mixing greedy and sampled."""
    rng = np.random.default_rng(400 + n)
    seqs, vocab = Seqs(rt), rt.model_config.vocab_size
    prompts = [random_tokens(rng, int(rng.integers(5, 150)), vocab) for _ in range(n)]
    tables = [seqs.new(len(p) + 4) for p in prompts]
    first = rt.execute(StepBatch.from_sequences(prompts, [0] * n, tables))
    t, k, p = (v * n for v in SAMPLED_CASES[case])
    t = [0.0 if i % 3 == 2 else x for i, x in enumerate(t)]  # some greedy rows among the sampled
    dec = StepBatch.from_sequences([[int(x)] for x in first], [len(q) for q in prompts], tables, temperature=t,
                                   top_k=k, top_p=p, seeds=[1000 + i for i in range(n)])
    graph, eager, staged = _graph_and_eager(rt, dec)
    assert staged == [case]
    np.testing.assert_array_equal(graph, eager)
    assert graph.min() >= 0 and graph.max() < vocab


def _logprob_extras(n: int, num_logprobs: int) -> SamplerExtras:
    """Sampler extras that ask only for logprobs (no min_p, penalties, bias or bans)."""
    none_i, none_f = np.full((n, 1), -1, np.int32), np.zeros((n, 1), np.float32)
    return SamplerExtras(np.zeros(n, np.float32), np.tile(np.array([0.0, 0.0, 1.0], np.float32), (n, 1)), none_i,
                         none_f, none_i.copy(), none_i.copy(), np.zeros((n, 1), np.int32), num_logprobs)


@pytest.mark.parametrize("n", [1, 3, 16])
@pytest.mark.parametrize("case,num_logprobs", [("sample", 0), ("sample_p", 5), ("sample_k", 3), ("sample_kp", 1),
                                               ("greedy", 5), ("greedy", 2)])
@torch.inference_mode()
def test_captured_logprob_head_equals_eager_sampler(rt, case, num_logprobs, n):
    """A decode step asking for up to GRAPH_LOGPROBS logprobs is served by the captured logprob head of its
    variant and returns exactly the eager sampler's tokens, chosen logprobs and top-N (ids and values); all-greedy
    rows take the "greedy_lp" head (nothing staged) and their tokens are the greedy head's."""
    rng = np.random.default_rng(600 + n + num_logprobs)
    seqs, vocab = Seqs(rt), rt.model_config.vocab_size
    prompts = [random_tokens(rng, int(rng.integers(5, 150)), vocab) for _ in range(n)]
    tables = [seqs.new(len(p) + 4) for p in prompts]
    first = rt.execute(StepBatch.from_sequences(prompts, [0] * n, tables))
    t, k, p = (v * n for v in SAMPLED_CASES.get(case, ([0.0], [0], [1.0])))
    t = [0.0 if i % 3 == 2 else x for i, x in enumerate(t)]  # greedy rows with logprobs among the sampled
    dec = StepBatch.from_sequences([[int(x)] for x in first], [len(q) for q in prompts], tables, temperature=t,
                                   top_k=k, top_p=p, seeds=[2000 + i for i in range(n)])
    dec = dataclasses.replace(dec, extras=_logprob_extras(n, num_logprobs))
    graph, eager, staged = _graph_and_eager(rt, dec)
    assert staged == [case + "_lp"]
    if case == "greedy":
        np.testing.assert_array_equal(graph.tokens, rt.execute(dataclasses.replace(dec, extras=None)))
    np.testing.assert_array_equal(graph.tokens, eager.tokens)
    assert graph.logprobs.top_ids.shape == (n, num_logprobs)
    np.testing.assert_array_equal(graph.logprobs.top_ids, eager.logprobs.top_ids)
    # the head samples the bucket's rows: other chunk counts, so sums of exponentials round differently
    np.testing.assert_allclose(graph.logprobs.chosen, eager.logprobs.chosen, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(graph.logprobs.top_logprobs, eager.logprobs.top_logprobs, rtol=1e-5, atol=1e-5)
    assert (graph.logprobs.chosen <= 0).all()


@torch.inference_mode()
def test_sampled_multi_step_equals_single_sampled_steps(rt):
    """Multi-step decode of sampled rows: each step's draw is keyed by its own position, as single steps are."""
    rng = np.random.default_rng(500)
    n, k = 5, 4
    seqs, vocab = Seqs(rt), rt.model_config.vocab_size
    prompts = [random_tokens(rng, int(rng.integers(5, 150)), vocab) for _ in range(n)]
    tables = [seqs.new(len(p) + k + 1) for p in prompts]
    first = rt.execute(StepBatch.from_sequences(prompts, [0] * n, tables))
    kw = dict(temperature=[1.0] * n, top_p=[0.9] * n, seeds=[7 + i for i in range(n)])
    dec = StepBatch.from_sequences([[int(x)] for x in first], [len(q) for q in prompts], tables, **kw)
    multi = rt.execute(dec, num_steps=k)
    b, want = dec, []
    for _ in range(k):
        toks = rt.execute(b)
        want.append(toks)
        b = StepBatch.from_sequences([[int(x)] for x in toks], (b.num_history + 1).tolist(), tables, **kw)
    np.testing.assert_array_equal(multi, np.stack(want, axis=1))
