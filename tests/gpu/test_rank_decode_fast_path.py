"""The rank's decode fast path (host metadata, one staging copy, graph replay, LM-head graph) gives the
same tokens and logits as the general path (device metadata, field copies, eager LM head)."""
import numpy as np
import pytest
import torch

from actors.batch import StepBatch
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
    fast = rt.execute(dec)  # writes the new token's K/V; the general path below rewrites the same values
    assert rt.runner.stats.snapshot()["steps"]["full_graph"] == before + 1
    head = rt._heads.get(rt.runner.decide(_device_step(rt, dec)).decode_key.batch)
    assert (head is not None) == (n <= 16)
    fast_logits = head[1][:n].clone() if head is not None else None
    logits = _general(rt, dec)
    np.testing.assert_array_equal(fast, logits.argmax(dim=-1).cpu().numpy())
    if fast_logits is not None:
        torch.testing.assert_close(fast_logits, logits, rtol=0, atol=0)
    seeded = StepBatch.from_sequences([[int(t)] for t in first], [len(p) for p in prompts], tables,
                                      temperature=[0.8] * n, top_k=[50] * n, seeds=list(range(n)))
    np.testing.assert_array_equal(rt.execute(seeded), rt.execute(seeded))


def test_head_graphs_cover_small_buckets_only(rt):
    st = rt.stats()
    assert st["head_graphs"]["buckets"] == [1, 2, 4, 8, 16]
    assert 0 < st["head_graphs"]["pool_bytes"] < 64 << 20
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
