"""Full decode CUDA graphs on a small real module (one GPU)."""
import pytest
import torch

from graphrunner import CUDAGraphRunner, GraphRunnerConfig
from graphrunner.dispatch import Path
from graphrunner.full_graph import DecodeGraphKey
from graphrunner.stats import EagerReason
from graphrunner.testing import (
    ToyDecoder,
    bucket_shaped_eager,
    decode_bucket_eager,
    toy_dummy_factory,
    toy_kv_caches,
    toy_step,
)

pytestmark = pytest.mark.gpu

DEV = "cuda"
BS, W, NBLK = 4, 32, 512
CFG = GraphRunnerConfig(max_decode_batch=8, pcg_max_tokens=64, pcg_token_stride=64)


def setup(cfg=CFG):
    torch.manual_seed(0)
    model = ToyDecoder(max_tokens=256, device=DEV)
    kv = toy_kv_caches(model, NBLK, BS, DEV)
    for k, v in kv:
        k.normal_()
        v.normal_()
    runner = CUDAGraphRunner(model, cfg, DEV, toy_dummy_factory(kv, BS, W, DEV), W)
    return model, kv, runner


def decode_step(kv, batch, hist=9, **fields):
    seqs = []
    for i in range(batch):
        nb = -(-(hist + i + 1) // BS)
        assert nb <= 8
        seqs.append(([(5 * i) % 90 + 1], hist + i, list(range(1 + 8 * i, 1 + 8 * i + nb))))
    return toy_step(seqs, kv, BS, W, DEV, **fields)


def run_pair(runner, kv, step, reference):
    saved = [(k.clone(), v.clone()) for k, v in kv]
    out = runner(step).clone()
    graph_kv = [(k.clone(), v.clone()) for k, v in kv]
    for (k, v), (k0, v0) in zip(kv, saved):
        k.copy_(k0)
        v.copy_(v0)
    with torch.inference_mode():
        ref = reference(step).clone()
    torch.cuda.synchronize()
    for (k, v), (kg, vg) in zip(kv, graph_kv):
        assert torch.equal(k, kg) and torch.equal(v, vg)
    return out, ref


@pytest.mark.parametrize("batch,bucket", [(1, 1), (3, 4), (5, 8), (8, 8)])
def test_decode_graph_equals_bucket_shaped_eager(batch, bucket):
    model, kv, runner = setup()
    for b in runner.decode_capture_sizes():
        runner.capture_decode(b)
    assert runner.num_decode_graphs == 4
    step = decode_step(kv, batch)
    d = runner.decide(step)
    assert d.path is Path.FULL_GRAPH and d.decode_key == DecodeGraphKey(bucket, 1, ())
    out, ref = run_pair(runner, kv, step, lambda s: decode_bucket_eager(model, s, bucket, runner.graph_meta))
    assert out.shape == (batch, 32) and torch.equal(out, ref)
    with torch.inference_mode():
        saved = [(k.clone(), v.clone()) for k, v in kv]
        raw = model(step.input_ids, step.position_ids, kv, step.attn_metadata)
        for (k, v), (k0, v0) in zip(kv, saved):
            k.copy_(k0)
            v.copy_(v0)
    torch.testing.assert_close(out, raw, rtol=1e-4, atol=1e-4)
    snap = runner.stats.snapshot()
    assert snap["steps"]["full_graph"] == 1 and snap["tokens"]["padded"]["full_graph"] == bucket
    assert snap["captured_decode"] == 4 and snap["memory"]["decode_graph_pool_bytes"] >= 0


def test_repeated_replays_track_changing_inputs():
    model, kv, runner = setup()
    runner.capture_decode(4)
    for hist in (3, 10, 17):
        step = decode_step(kv, 3, hist=hist)
        out, ref = run_pair(runner, kv, step, lambda s: decode_bucket_eager(model, s, 4, runner.graph_meta))
        assert torch.equal(out, ref)


def test_first_capture_returns_the_warmup_output():
    model, kv, runner = setup()
    factory = toy_dummy_factory(kv, BS, W, DEV)
    step = factory(4, 4, True)
    with torch.inference_mode(), torch.cuda.stream(runner.stream):
        key, out = runner.full_graphs.capture(step, 4)
        ref = decode_bucket_eager(model, step, 4, runner.graph_meta)
    torch.cuda.synchronize()
    assert key == DecodeGraphKey(4, 1, ())
    assert torch.equal(out, ref)
    graph_out = runner.full_graphs._graphs[key].output
    assert out.untyped_storage().data_ptr() != graph_out.untyped_storage().data_ptr()


def test_hints_and_global_prefill():
    model, kv, runner = setup()
    for b in runner.decode_capture_sizes():
        runner.capture_decode(b)
    for t in runner.prefill_capture_sizes():
        runner.capture_prefill(t)
    step = decode_step(kv, 3, batch_bucket_hint=6)
    assert runner.decide(step).decode_key.batch == 8
    out, ref = run_pair(runner, kv, step, lambda s: decode_bucket_eager(model, s, 8, runner.graph_meta))
    assert torch.equal(out, ref)
    # global prefill: a locally decoding rank replays the token plan (attention picks decode from metadata)
    step = decode_step(kv, 3, global_decode=False)
    assert runner.decide(step).path is Path.PIECEWISE
    out, ref = run_pair(runner, kv, step, lambda s: bucket_shaped_eager(model, s, 64))
    assert torch.equal(out, ref)
    # above the largest decode bucket: token plan
    step = decode_step(kv, 9, hist=2)
    assert runner.decide(step).path is Path.PIECEWISE


def test_decode_capture_failure_keeps_original_error():
    model, kv, runner = setup(GraphRunnerConfig(max_decode_batch=4, pcg_max_tokens=0))
    err = KeyError("injected during capture")
    model.inject_forward_failure(call=2, error=err)  # call 1 is the warm-up
    with pytest.raises(KeyError) as ei:
        runner.capture_decode(4)
    assert ei.value is err and runner.num_decode_graphs == 0
    assert not torch.cuda.is_current_stream_capturing()
    assert runner.decide(decode_step(kv, 3)).reason is EagerReason.NOT_CAPTURED
    runner.capture_decode(4)
    step = decode_step(kv, 3)
    out, ref = run_pair(runner, kv, step, lambda s: decode_bucket_eager(model, s, 4, runner.graph_meta))
    assert torch.equal(out, ref)


def test_runner_on_callers_non_default_stream_and_reset():
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        model, kv, runner = setup(GraphRunnerConfig(max_decode_batch=4, pcg_max_tokens=0))
        assert runner.stream == side
        runner.capture_decode(4)
        step = decode_step(kv, 3)
        assert runner.decide(step).path is Path.FULL_GRAPH
        out, ref = run_pair(runner, kv, step, lambda s: decode_bucket_eager(model, s, 4, runner.graph_meta))
        assert torch.equal(out, ref)
        runner.reset()
        assert runner.decide(step).reason is EagerReason.NOT_CAPTURED
        runner.capture_decode(4)
        out, ref = run_pair(runner, kv, step, lambda s: decode_bucket_eager(model, s, 4, runner.graph_meta))
        assert torch.equal(out, ref)
    torch.cuda.synchronize()


def test_default_stream_caller_gets_a_private_forward_stream():
    model, kv, runner = setup()
    assert runner.stream != torch.cuda.default_stream()
