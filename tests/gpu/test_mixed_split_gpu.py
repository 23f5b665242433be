"""A chunked-prefill step split into its decode half (a full decode graph and its LM head) and its prefill half
(a full prefill graph) on one GPU (`actors.mixed_split`, `RuntimeConfig.split_mixed_steps`): the step's tokens are
bitwise those of the two halves run as their own steps, greedy and sampled, with token ids on the host or
referring to the previous step; in fp32 they equal the step run whole (the piecewise plan); a step the split does
not serve (logprobs, no decode graph for its rows) runs whole."""
import dataclasses
import gc

import numpy as np
import pytest
import torch

from actors.batch import SamplerExtras, StepBatch, prev_token
from tests.gpu.helpers import Seqs, make_runtime, random_tokens

pytestmark = pytest.mark.gpu


def _runtime(dtype=None):
    return make_runtime(dtype=dtype, max_decode_batch=16, pcg_max_tokens=1024, pcg_token_stride=512,
                        prefill_graph_max_tokens=1024, prefill_graph_max_seqs=4, head_graph_max_batch=16)


@pytest.fixture(scope="module")
def rt():
    r = _runtime()
    yield r
    del r
    gc.collect()
    torch.cuda.empty_cache()


def _paths(rt):
    return dict(rt.runner.stats.snapshot()["steps"])


def _setup(rt, n: int, chunk: int, seed: int):
    """n sequences prefilled (their first tokens sampled) and one new prompt of `chunk` tokens: (decode rows'
    ids, histories, tables; the chunk's ids and table)."""
    rng = np.random.default_rng(seed)
    seqs, vocab = Seqs(rt), rt.model_config.vocab_size
    prompts = [random_tokens(rng, int(rng.integers(20, 200)), vocab) for _ in range(n)]
    tables = [seqs.new(len(p) + 4) for p in prompts]
    first = rt.execute(StepBatch.from_sequences(prompts, [0] * n, tables))
    chunk_ids = random_tokens(rng, chunk, vocab)
    return [[int(x)] for x in first], [len(p) for p in prompts], tables, chunk_ids, seqs.new(chunk + 1)


def _mixed(dec_ids, hist, tables, chunk_ids, chunk_table, sampled: bool):
    n = len(hist)
    kw = {}
    if sampled:
        kw = dict(temperature=[1.0 if i % 2 else 0.0 for i in range(n + 1)], top_k=[0] * (n + 1),
                  top_p=[0.9] * (n + 1), seeds=[300 + i for i in range(n + 1)])
    return StepBatch.from_sequences(dec_ids + [chunk_ids], hist + [0], tables + [chunk_table], **kw)


@pytest.mark.parametrize("sampled", [False, True])
@pytest.mark.parametrize("n,chunk", [(1, 37), (5, 300), (16, 1000)])
@torch.inference_mode()
def test_split_mixed_step_equals_its_halves_run_alone(rt, n, chunk, sampled):
    dec_ids, hist, tables, chunk_ids, chunk_table = _setup(rt, n, chunk, 10 * n + chunk)
    mixed = _mixed(dec_ids, hist, tables, chunk_ids, chunk_table, sampled)
    before = _paths(rt)
    got = rt.execute(mixed)
    after = _paths(rt)
    assert after.get("full_graph", 0) == before.get("full_graph", 0) + 1, (before, after)
    assert after.get("prefill_graph", 0) == before.get("prefill_graph", 0) + 1, (before, after)
    assert after.get("piecewise", 0) == before.get("piecewise", 0)
    keep = dict(temperature=mixed.temperature, top_k=mixed.top_k, top_p=mixed.top_p, seeds=mixed.seeds)
    head = StepBatch.from_sequences(dec_ids, hist, tables, **{k: v[:n] for k, v in keep.items()})
    tail = StepBatch.from_sequences([chunk_ids], [0], [chunk_table], **{k: v[n:] for k, v in keep.items()})
    alone = np.concatenate([rt.execute(head), rt.execute(tail)])  # rewrites the same K/V
    np.testing.assert_array_equal(got, alone)
    assert got.shape == (n + 1,)


@torch.inference_mode()
def test_split_mixed_step_with_previous_step_references_equals_host_ids(rt):
    n, chunk = 6, 200
    dec_ids, hist, tables, chunk_ids, chunk_table = _setup(rt, n, chunk, 77)
    step1 = StepBatch.from_sequences(dec_ids, hist, tables)
    toks = rt.execute(step1)
    hist2 = [h + 1 for h in hist]
    ref = StepBatch.from_sequences([[prev_token(i)] for i in range(n)] + [chunk_ids], hist2 + [0],
                                   tables + [chunk_table])
    before = _paths(rt)
    got = rt.execute(ref)
    assert _paths(rt).get("prefill_graph", 0) == before.get("prefill_graph", 0) + 1
    rt.execute(step1)  # the previous step again (same K/V), then the same step with host ids
    host = StepBatch.from_sequences([[int(t)] for t in toks] + [chunk_ids], hist2 + [0], tables + [chunk_table])
    np.testing.assert_array_equal(got, rt.execute(host))


@torch.inference_mode()
def test_steps_the_split_does_not_serve_run_whole(rt):
    n, chunk = 4, 100
    dec_ids, hist, tables, chunk_ids, chunk_table = _setup(rt, n, chunk, 5)
    mixed = _mixed(dec_ids, hist, tables, chunk_ids, chunk_table, sampled=False)
    lp = dataclasses.replace(mixed, extras=SamplerExtras.off(n + 1, 3))
    before = _paths(rt)
    out = rt.execute(lp)
    after = _paths(rt)
    assert after.get("full_graph", 0) == before.get("full_graph", 0)  # one step: logprobs come from one pass
    assert out.logprobs.top_ids.shape == (n + 1, 3)
    split_cfg = rt.cfg
    rt.cfg = dataclasses.replace(split_cfg, split_mixed_steps=False)
    try:
        before = _paths(rt)
        rt.execute(mixed)
        assert _paths(rt).get("full_graph", 0) == before.get("full_graph", 0)
    finally:
        rt.cfg = split_cfg
    big = _setup(rt, 17, 50, 9)  # 17 decode rows: above the largest decode graph (16)
    before = _paths(rt)
    rt.execute(_mixed(*big, sampled=False))
    assert _paths(rt).get("full_graph", 0) == before.get("full_graph", 0)


@torch.inference_mode()
def test_split_equals_the_whole_step_in_fp32():
    r = _runtime("float32")
    try:
        for n, chunk, seed in [(3, 120, 1), (12, 700, 2)]:
            dec_ids, hist, tables, chunk_ids, chunk_table = _setup(r, n, chunk, seed)
            mixed = _mixed(dec_ids, hist, tables, chunk_ids, chunk_table, sampled=False)
            split = r.execute(mixed)
            cfg = r.cfg
            r.cfg = dataclasses.replace(cfg, split_mixed_steps=False)
            try:
                whole = r.execute(mixed)
            finally:
                r.cfg = cfg
            np.testing.assert_array_equal(split, whole)
    finally:
        del r
        gc.collect()
        torch.cuda.empty_cache()
