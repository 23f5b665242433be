"""Full prefill graphs on one GPU (qwen3-0.6b and the MoE preset qwen3-moe-small, Triton kernels): a captured prefill step equals the model run
eagerly over the same bucket-padded buffers exactly and the live step closely, at every token and sequence
bucket shape, with and without cached history; greedy tokens through the rank equal those without prefill
graphs (fp32); steps that do not fit take the piecewise plans; reset drops the graphs and capture restores them."""
import gc

import numpy as np
import pytest
import torch

from actors.batch import StepBatch
from graphrunner.dispatch import Path
from graphrunner.forward_args import model_kwargs
from graphrunner.step import ForwardStep
from modeling.attn_metadata import build_prefill_step_host
from tests.gpu.helpers import Seqs, make_runtime, random_tokens

pytestmark = pytest.mark.gpu

MAX_TOKENS, MAX_SEQS = 1024, 4


@pytest.fixture(scope="module", params=["qwen3-0.6b", "qwen3-moe-small"])
def pg_rt(request):
    rt = make_runtime(request.param, max_decode_batch=8, pcg_max_tokens=1024, pcg_token_stride=512,
                      prefill_graph_max_tokens=MAX_TOKENS, prefill_graph_max_seqs=MAX_SEQS)
    yield rt
    del rt
    gc.collect()
    torch.cuda.empty_cache()


def _bucket(n, buckets):
    return min(b for b in buckets if b >= n)


def _step(rt, rng, partition, history):
    seqs = Seqs(rt)
    vocab = rt.model_config.vocab_size
    tables = [seqs.new(history + n) for n in partition]
    if history:
        s = seqs.step([random_tokens(rng, history, vocab) for _ in partition], [0] * len(partition), tables)
        rt.model(s.input_ids, s.position_ids, s.kv_caches, s.attn_metadata)
    return seqs.step([random_tokens(rng, n, vocab) for n in partition], [history] * len(partition), tables)


@pytest.mark.parametrize("history", [0, 96])
@pytest.mark.parametrize("partition", [[37], [16], [512], [1000], [100, 300, 112], [1, 1, 200], [5, 7, 9, 11]])
@torch.inference_mode()
def test_prefill_graph_equals_bucket_eager_exactly_and_live_eager_closely(pg_rt, partition, history):
    rt = pg_rt
    step = _step(rt, np.random.default_rng(sum(partition) + history), partition, history)
    n = step.num_tokens
    tokens = _bucket(n, rt.cfg.graph.prefill_graph_buckets()[0])
    seqs = _bucket(len(partition), rt.cfg.graph.prefill_graph_buckets()[1])
    decision = rt.runner.decide(step)
    assert decision.path is Path.PREFILL_GRAPH and (decision.prefill_key.tokens, decision.prefill_key.seqs) == (
        tokens, seqs), decision
    before = rt.runner.stats.snapshot()["steps"]["prefill_graph"]
    out = rt.runner(step).clone()
    assert rt.runner.stats.snapshot()["steps"]["prefill_graph"] == before + 1
    assert out.shape[0] == n
    bufs = rt.model.make_prefill_buffers(tokens, seqs, rt.cfg.max_blocks_per_seq, rt.device)
    rt.model.fill_prefill_buffers(bufs, step, tokens, seqs)
    ref = rt.model(**model_kwargs(rt.model.prefill_context(bufs, step, tokens, seqs)))[:n]
    assert torch.equal(out, ref), f"{partition}+{history}: graph != bucket-shaped eager"
    live = rt.model(step.input_ids, step.position_ids, step.kv_caches, step.attn_metadata).float()
    # bf16 through 28 layers with GEMMs of another row count: a few elements differ by more than 5e-2
    near = (out.float() - live).abs() <= 5e-2 + 5e-2 * live.abs()
    assert near.float().mean() > 0.999 and (out.float() - live).abs().max() < 0.5, (near.float().mean(),
                                                                                   (out.float() - live).abs().max())


@torch.inference_mode()
def test_steps_that_do_not_fit_take_the_piecewise_plans(pg_rt):
    rt = pg_rt
    rng = np.random.default_rng(7)
    assert rt.runner.decide(_step(rt, rng, [3] * (MAX_SEQS + 1), 0)).path is Path.PIECEWISE
    assert rt.runner.decide(_step(rt, rng, [MAX_TOKENS + 1], 0)).path is Path.EAGER  # above every bucket


@torch.inference_mode()
def test_reset_drops_prefill_graphs_and_capture_restores_them(pg_rt):
    rt = pg_rt
    n_graphs = rt.runner.num_prefill_graphs
    assert n_graphs == len(rt.cfg.graph.prefill_graph_buckets()[0]) * len(rt.cfg.graph.prefill_graph_buckets()[1])
    rt.reset()
    assert rt.runner.num_prefill_graphs == 0
    assert rt.runner.decide(_step(rt, np.random.default_rng(1), [40], 0)).path is Path.EAGER
    rt.capture_all()
    assert rt.runner.num_prefill_graphs == n_graphs
    snap = rt.runner.stats.snapshot()
    assert snap["capture"]["prefill_graphs"] == len(rt.cfg.graph.prefill_graph_buckets()[0])
    assert snap["memory"]["prefill_graph_pool_bytes"] > 0
    test_prefill_graph_equals_bucket_eager_exactly_and_live_eager_closely(rt, [100, 300, 112], 96)


@pytest.mark.parametrize("partition,history", [([37], 0), ([100, 300, 112], 96), ([1, 1, 200], 0)])
@torch.inference_mode()
def test_host_staged_prefill_graph_step_equals_the_device_step_exactly(pg_rt, partition, history):
    """The rank's prefill fast path: the same step with its metadata on the host (`HostPrefillMetadata`, one
    transfer from the pinned mirror) replays the same graph to the same hidden rows, bit for bit, and sets the
    LM head's rows to the last-token indices."""
    rt = pg_rt
    step = _step(rt, np.random.default_rng(11 + sum(partition)), partition, history)
    meta = step.attn_metadata
    out = rt.runner(step).clone()
    ids_h, host_meta = build_prefill_step_host(step.input_ids.cpu().numpy(), meta.q_seqlens.cpu().numpy(),
                                               (meta.kv_seqlens - meta.q_seqlens).cpu().numpy(),
                                               meta.block_tables.cpu().numpy(), meta.block_size)
    host_step = ForwardStep(ids_h, ids_h, step.kv_caches, host_meta)
    assert rt.runner.decide(host_step).path is Path.PREFILL_GRAPH
    staged = rt.runner(host_step).clone()
    assert torch.equal(staged, out)
    assert torch.equal(host_meta.last_token_index, meta.last_token_index)


def _generate(rt, prompts, steps):
    """Greedy tokens of `prompts` (one prefill step for all, then `steps` decode steps) through `execute`."""
    bs, width = rt.cfg.block_size, rt.cfg.max_blocks_per_seq
    per = -(-(max(len(p) for p in prompts) + steps + 1) // bs)
    tables = np.zeros((len(prompts), width), np.int32)
    for i in range(len(prompts)):
        tables[i, :per] = 1 + i * per + np.arange(per)
    n = len(prompts)
    zeros = dict(temperature=np.zeros(n, np.float32), top_k=np.zeros(n, np.int32), top_p=np.ones(n, np.float32),
                 seeds=np.full(n, -1, np.int64))
    first = rt.execute(StepBatch(token_ids=np.concatenate(prompts).astype(np.int64),
                                 q_seqlens=np.array([len(p) for p in prompts], np.int32),
                                 num_history=np.zeros(n, np.int32), block_tables=tables[:, :per], **zeros))
    out, last, hist = [first], first, np.array([len(p) for p in prompts], np.int32)
    for _ in range(steps):
        last = rt.execute(StepBatch(token_ids=np.asarray(last, np.int64), q_seqlens=np.ones(n, np.int32),
                                    num_history=hist, block_tables=tables[:, :per], **zeros))
        hist = hist + 1
        out.append(last)
    return np.stack(out, axis=1)


@torch.inference_mode()
def test_greedy_tokens_equal_without_prefill_graphs_fp32():
    rng = np.random.default_rng(3)
    prompts = [rng.integers(1, 150000, n) for n in (37, 120, 5)]
    got = {}
    for pg in (512, 0):
        rt = make_runtime("qwen3-0.6b", dtype="float32", blocks=64, max_len=1024, max_decode_batch=4,
                          pcg_max_tokens=512, prefill_graph_max_tokens=pg)
        got[pg] = _generate(rt, prompts, 24)
        steps = rt.runner.stats.snapshot()["steps"]
        assert (steps["prefill_graph"] > 0) == (pg > 0) and (steps["piecewise"] > 0) == (pg == 0), steps
        del rt
        gc.collect()
        torch.cuda.empty_cache()
    assert np.array_equal(got[512], got[0]), (got[512], got[0])
