"""Full prefill graphs on CPU: bucket policy, the dispatch choice, and the model's buffer contract run for real
(the Qwen3 model on the torch backend over bucket-padded buffers equals it over the live step).

The CUDA capture and replay are in tests/gpu/test_prefill_graph_gpu.py.
"""
import numpy as np
import pytest
import torch

from graphrunner import GraphRunnerConfig
from graphrunner.dispatch import DispatchPolicy, Path
from graphrunner.errors import GraphRunnerConfigError
from graphrunner.forward_args import model_kwargs
from graphrunner.full_graph import DecodeGraphKey
from graphrunner.prefill_graph import PrefillGraphKey, PrefillGraphRunner
from graphrunner.step import ForwardStep, GraphMeta
from graphrunner.testing import ToyDecoder, toy_kv_caches, toy_step
from modeling.attn_metadata import build_prefill_step_host, build_step_from_arrays
from modeling.config import get_preset
from modeling.kv_cache import KVCacheSpec, PagedKVCache
from modeling.loader import init_random
from modeling.qwen3 import Qwen3ForCausalLM

BS, W = 4, 32


def test_prefill_graph_buckets_and_validation():
    assert GraphRunnerConfig().prefill_graph_buckets() == ((), ())
    tokens, seqs = GraphRunnerConfig(prefill_graph_max_tokens=2048).prefill_graph_buckets()
    assert tokens == (16, 32, 64, 128, 256, 512, 1024, 1536, 2048) and seqs == (1, 2, 4)
    assert GraphRunnerConfig(prefill_graph_max_tokens=100, prefill_graph_max_seqs=6).prefill_graph_buckets() == (
        (16, 32, 64, 100), (1, 2, 4, 6))
    for bad in ({"prefill_graph_max_tokens": -1}, {"prefill_graph_max_seqs": 0},
                {"prefill_graph_max_tokens": 1.5}, {"prefill_graph_max_seqs": True}):
        with pytest.raises(GraphRunnerConfigError, match=next(iter(bad))):
            GraphRunnerConfig(**bad)


class PrefillToy(ToyDecoder):
    """The toy decoder, declaring full prefill graphs supported except while `refuse` is set."""

    refuse = False

    def supports_prefill_graph(self, step):
        return not self.refuse


class Captured:
    """The selector facts a policy needs: the real key rule of `PrefillGraphRunner` + a set of captured keys."""

    def __init__(self, model, tokens, seqs, captured):
        meta = GraphMeta(8, max(tokens), W, torch.device("cpu"))
        self.keys = PrefillGraphRunner(model, tokens, seqs, meta, None)
        self.captured = set(captured)

    def key_for(self, step):
        return self.keys.key_for(step)

    def has_graph(self, key):
        return key in self.captured


def _policy(model, selector):
    keys = {DecodeGraphKey(b, 1, ()) for b in (1, 2, 4)}
    return DispatchPolicy(model=model, eager_mode=False, cuda=True, decode_buckets=(1, 2, 4),
                          has_decode_graph=keys.__contains__, piecewise=None, prefill_graphs=selector)


def _prefill(kv, lens, hist=0, **fields):
    seqs, b = [], 1
    for n in lens:
        nb = -(-(n + hist) // BS)
        seqs.append((list(range(1, n + 1)), hist, list(range(b, b + nb))))
        b += nb
    return toy_step(seqs, kv, BS, W, "cpu", **fields)


def test_policy_prefers_prefill_graph_for_non_decode_steps_that_fit():
    model = PrefillToy(max_tokens=128)
    kv = toy_kv_caches(model, 64, BS, "cpu")
    captured = {PrefillGraphKey(t, s) for t in (16, 32, 64) for s in (1, 2, 4)}
    pol = _policy(model, Captured(model, (16, 32, 64), (1, 2, 4), captured))
    d = pol.decide(_prefill(kv, (20,)))
    assert d.path is Path.PREFILL_GRAPH and d.prefill_key == PrefillGraphKey(32, 1)
    assert pol.decide(_prefill(kv, (5, 5, 3), hist=6)).prefill_key == PrefillGraphKey(16, 4)
    assert pol.decide(_prefill(kv, (5,), token_bucket_hint=40)).prefill_key == PrefillGraphKey(64, 1)
    # decode steps keep their decode graphs; a decode step without one may take a prefill graph
    decode = toy_step([([7], 3, [1 + i]) for i in range(2)], kv, BS, W, "cpu")
    assert pol.decide(decode).path is Path.FULL_GRAPH
    wide = toy_step([([7], 3, [1 + i]) for i in range(3)], kv, BS, W, "cpu", global_decode=False)
    assert pol.decide(wide).prefill_key == PrefillGraphKey(16, 4)
    # too many sequences or tokens, dynamic extras, micro-batches, a refusing model: not a prefill graph
    assert pol.decide(_prefill(kv, (2,) * 5)).path is Path.EAGER
    assert pol.decide(_prefill(kv, (65,))).path is Path.EAGER
    assert pol.decide(_prefill(kv, (5,), extras={"t": torch.ones(1)})).path is Path.EAGER
    assert pol.decide(_prefill(kv, (5,), micro_batch=True)).path is Path.EAGER
    model.refuse = True
    assert pol.decide(_prefill(kv, (5,))).path is Path.EAGER
    model.refuse = False
    # scalar extras are part of the key: a graph captured without them does not serve them
    assert pol.decide(_prefill(kv, (5,), extras={"output_scale": 2.0})).path is Path.EAGER


def test_policy_without_a_captured_key_falls_through():
    model = PrefillToy(max_tokens=128)
    kv = toy_kv_caches(model, 64, BS, "cpu")
    pol = _policy(model, Captured(model, (16, 32), (1,), {PrefillGraphKey(32, 1)}))
    assert pol.decide(_prefill(kv, (20,))).path is Path.PREFILL_GRAPH
    assert pol.decide(_prefill(kv, (10,))).path is Path.EAGER  # bucket 16 not captured


@pytest.fixture(scope="module")
def qwen():
    torch.manual_seed(0)
    m = Qwen3ForCausalLM(get_preset("qwen3-tiny"))
    init_random(m, seed=3)
    return m.eval()


def _cache(model, blocks=48, bs=16):
    return PagedKVCache(KVCacheSpec.for_model(model.config, blocks, bs, 1), torch.device("cpu"))


@pytest.mark.parametrize("tokens_bucket,seqs_bucket", [(64, 4), (128, 8)])
@torch.inference_mode()
def test_qwen_over_padded_prefill_buffers_equals_the_live_step(qwen, tokens_bucket, seqs_bucket):
    """Two prompts (one with cached history) and a decode row in one step: the model over the bucket-padded
    buffers gives the live step's hidden rows, writes the same KV, and its padding writes nothing."""
    bs, width = 16, 8
    rng = np.random.default_rng(1)
    vocab = qwen.config.vocab_size
    live_cache, padded_cache = _cache(qwen), _cache(qwen)
    for (k1, v1), (k2, v2) in zip(live_cache.layers, padded_cache.layers):
        k1.normal_()
        v1.normal_()
        k2.copy_(k1)
        v2.copy_(v1)
    q_lens = np.array([23, 9, 1], np.int32)
    hist = np.array([0, 20, 33], np.int32)
    tables = np.zeros((3, width), np.int32)
    tables[0, :2], tables[1, :2], tables[2, :3] = [1, 2], [3, 4], [5, 6, 7]
    ids = rng.integers(1, vocab, int(q_lens.sum())).astype(np.int64)
    results = []
    for cache, padded in ((live_cache, False), (padded_cache, True)):
        i, p, meta = build_step_from_arrays(ids, q_lens, hist, tables, bs, "cpu")
        step = ForwardStep(i, p, cache.layers, meta)
        if padded:
            bufs = qwen.make_prefill_buffers(128, 8, width + 2, torch.device("cpu"))
            bufs["input_ids"].fill_(5)  # stale rows of an earlier, larger step
            bufs["slot_mapping"].fill_(7)
            bufs["q_seqlens"].fill_(3)
            qwen.fill_prefill_buffers(bufs, step, tokens_bucket, seqs_bucket)
            ctx = qwen.prefill_context(bufs, step, tokens_bucket, seqs_bucket)
            assert ctx.num_tokens == tokens_bucket and ctx.attn_metadata.batch_size == seqs_bucket
            assert ctx.attn_metadata.max_q_seqlen == tokens_bucket
            assert int(ctx.attn_metadata.slot_mapping[step.num_tokens:].max()) == -1
            assert int(ctx.attn_metadata.q_seqlens[3:].abs().sum()) == 0
            out = qwen(**model_kwargs(ctx))
            assert out.shape[0] == tokens_bucket
            results.append(qwen.get_outputs(out, step.num_tokens))
        else:
            results.append(qwen(**model_kwargs(step)))
    torch.testing.assert_close(results[1], results[0], atol=1e-5, rtol=1e-5)
    for (k1, v1), (k2, v2) in zip(live_cache.layers, padded_cache.layers):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


@pytest.mark.parametrize("tokens_bucket,seqs_bucket", [(64, 4), (128, 8)])
def test_host_staged_prefill_fills_the_buffers_exactly_as_the_device_step(qwen, tokens_bucket, seqs_bucket):
    """The rank's prefill fast path (`HostPrefillMetadata`: the metadata derived on the host into the mirror, one
    transfer) leaves every field's bucket prefix equal to the field-by-field fill from the device step that
    `build_step_from_arrays` makes, over stale buffers of an earlier, larger step; the LM head's rows are the
    staged last-token indices."""
    bs, width = 16, 8
    q_lens = np.array([23, 9, 1], np.int32)
    hist = np.array([0, 20, 33], np.int32)
    tables = np.zeros((3, width - 3), np.int32)
    tables[0, :2], tables[1, :2], tables[2, :3] = [1, 2], [3, 4], [5, 6, 7]
    ids = np.random.default_rng(2).integers(1, 1000, int(q_lens.sum())).astype(np.int64)
    filled = []
    for host in (False, True):
        bufs = qwen.make_prefill_buffers(128, 8, width, torch.device("cpu"))
        for name in ("input_ids", "position_ids", "slot_mapping", "last_token_index", "q_seqlens", "kv_seqlens",
                     "q_start_loc", "block_tables"):
            bufs[name].fill_(9)
            bufs["_host"][name].fill(9)
        if host:
            i, meta = build_prefill_step_host(ids, q_lens, hist, tables, bs)
            step = ForwardStep(i, i, [], meta)
        else:
            i, p, meta = build_step_from_arrays(ids, q_lens, hist, tables, bs, "cpu")
            step = ForwardStep(i, p, [], meta)
        qwen.fill_prefill_buffers(bufs, step, tokens_bucket, seqs_bucket)
        filled.append((bufs, meta))
    (dev, dev_meta), (staged, host_meta) = filled
    for name in ("input_ids", "position_ids", "slot_mapping"):
        assert torch.equal(staged[name][:tokens_bucket], dev[name][:tokens_bucket]), name
    for name in ("last_token_index", "q_seqlens", "kv_seqlens", "q_start_loc", "block_tables"):
        assert torch.equal(staged[name][:seqs_bucket], dev[name][:seqs_bucket]), name
    assert torch.equal(host_meta.last_token_index, dev_meta.last_token_index)
    assert host_meta.last_token_index.tolist() == [22, 31, 32]


def test_fill_rejects_a_step_over_the_bucket(qwen):
    i, p, meta = build_step_from_arrays(np.arange(1, 21, dtype=np.int64), np.array([20], np.int32),
                                        np.zeros(1, np.int32), np.array([[1, 2]], np.int32), 16, "cpu")
    bufs = qwen.make_prefill_buffers(64, 2, 4, torch.device("cpu"))
    with pytest.raises(ValueError, match="does not fit"):
        qwen.fill_prefill_buffers(bufs, ForwardStep(i, p, [], meta), 16, 1)


def test_models_without_capturable_kernels_decline_prefill_graphs():
    moe = Qwen3ForCausalLM(get_preset("qwen3-moe-tiny"))
    dense = Qwen3ForCausalLM(get_preset("qwen3-tiny"))
    i, p, meta = build_step_from_arrays(np.arange(1, 5, dtype=np.int64), np.array([4], np.int32),
                                        np.zeros(1, np.int32), np.array([[1]], np.int32), 16, "cpu")
    step = ForwardStep(i, p, [], meta)
    assert not moe.supports_prefill_graph(step)  # the torch backend: neither capturable nor routed experts
    assert not dense.supports_prefill_graph(step)


def test_capture_token_bucket_captures_each_sequence_bucket_once_largest_first(qwen):
    """The start-up loop over sequence buckets (the CUDA capture itself is replaced by a recorder here; the GPU
    tests capture for real): every missing (T, S) once, largest S first, none twice."""
    meta = GraphMeta(8, 64, 4, torch.device("cpu"))
    pg = PrefillGraphRunner(qwen, (16, 32, 64), (1, 2, 4), meta, None)
    calls = []

    def record(step, tokens, seqs):
        calls.append((tokens, seqs))
        pg._graphs[PrefillGraphKey(tokens, seqs, ())] = (None, None, 0)

    pg.capture = record
    i, p, m = build_step_from_arrays(np.zeros(32, np.int64), np.array([32], np.int32), np.zeros(1, np.int32),
                                     np.zeros((1, 4), np.int32), 16, "cpu")
    step = ForwardStep(i, p, [], m)
    pg.capture_token_bucket(step, 32)
    assert calls == [(32, 4), (32, 2), (32, 1)]
    pg.capture_token_bucket(step, 32)
    assert len(calls) == 3 and pg.num_graphs == 3
    assert pg.key_for(step) == PrefillGraphKey(32, 1) and pg.has_graph(pg.key_for(step))
