"""Piecewise CUDA graph plans on a small real module with boundaries (one GPU).

The model is `graphrunner.testing.ToyDecoder`: attention + KV store (PADDED_TOKENS),
routing (EAGER_ONLY), experts (BRIDGE, reusable), combine into a module buffer
(PADDED_VIEW). Plan replay must equal the bucket-shaped eager forward EXACTLY.
"""
import gc
import weakref

import pytest
import torch
from torch import nn

from graphrunner import CUDAGraphRunner, GraphRunnerConfig
from graphrunner.boundary import OutputPolicy, eager_boundary
from graphrunner.bridges import PaddedBridge
from graphrunner.dispatch import Path
from graphrunner.errors import CapturedRequestValueError
from graphrunner.plan import EagerStep
from graphrunner.stats import EagerReason
from graphrunner.testing import ToyDecoder, bucket_shaped_eager, toy_dummy_factory, toy_kv_caches, toy_step

pytestmark = pytest.mark.gpu

DEV = "cuda"
BS, W, NBLK = 4, 32, 512
CFG = GraphRunnerConfig(max_decode_batch=8, pcg_max_tokens=128, pcg_token_stride=64)


def setup(cfg=CFG, model=None):
    torch.manual_seed(0)
    model = model if model is not None else ToyDecoder(max_tokens=256, device=DEV)
    kv = toy_kv_caches(model, NBLK, BS, DEV)
    for k, v in kv:  # arbitrary history content so attention over history is exercised
        k.normal_()
        v.normal_()
    created = []
    runner = CUDAGraphRunner(model, cfg, DEV, toy_dummy_factory(kv, BS, W, DEV, created), W)
    return model, kv, runner, created


def capture_all(runner):
    for b in runner.decode_capture_sizes():
        runner.capture_decode(b)
    for t in runner.prefill_capture_sizes():
        runner.capture_prefill(t)


def make_step(kv, lens, hist=0, first_block=1, **fields):
    seqs, b = [], first_block
    for i, n in enumerate(lens):
        nb = -(-(hist + n) // BS)
        seqs.append(([(7 * i + j) % 90 + 1 for j in range(n)], hist, list(range(b, b + nb))))
        b += nb
    return toy_step(seqs, kv, BS, W, DEV, **fields)


def snapshot(kv):
    return [(k.clone(), v.clone()) for k, v in kv]


def restore(kv, saved):
    for (k, v), (k0, v0) in zip(kv, saved):
        k.copy_(k0)
        v.copy_(v0)


def graph_vs_reference(runner, model, kv, step, reference):
    """Run `step` through the runner, then `reference(step)` from the same cache state."""
    saved = snapshot(kv)
    out = runner(step).clone()
    after_graph = snapshot(kv)
    restore(kv, saved)
    with torch.inference_mode():
        ref = reference(step).clone()
    torch.cuda.synchronize()
    for (k, v), (kg, vg) in zip(kv, after_graph):
        assert torch.equal(k, kg) and torch.equal(v, vg), "KV cache writes differ"
    return out, ref


@pytest.mark.parametrize(
    "lens,hist",
    [((40,), 0), ((10, 20, 10), 0), ((1, 1, 1, 37), 0), ((12, 20), 8), ((64,), 0), ((100,), 0), ((3,), 5)],
)
def test_plan_replay_equals_bucket_shaped_eager(lens, hist):
    model, kv, runner, _ = setup()
    capture_all(runner)
    assert runner.num_plans == 2 and runner.num_decode_graphs == 4
    step = make_step(kv, lens, hist)
    decision = runner.decide(step)
    assert decision.path is Path.PIECEWISE
    bucket = decision.descriptor.token_bucket
    out, ref = graph_vs_reference(runner, model, kv, step, lambda s: bucket_shaped_eager(model, s, bucket))
    assert out.shape == (sum(lens), 32)
    assert torch.equal(out, ref)
    # and close to the unpadded eager forward (padding changes GEMM shapes, not the math)
    restore_point = snapshot(kv)
    with torch.inference_mode():
        raw = model(step.input_ids, step.position_ids, kv, step.attn_metadata)
    restore(kv, restore_point)
    torch.testing.assert_close(out, raw, rtol=1e-4, atol=1e-4)
    snap = runner.stats.snapshot()
    assert snap["steps"]["piecewise"] == 1 and snap["tokens"]["padded"]["piecewise"] == bucket


def test_equal_token_counts_different_partitions_share_one_plan():
    model, kv, runner, _ = setup()
    capture_all(runner)
    descriptors = {runner.decide(make_step(kv, lens)).descriptor for lens in [(48,), (16, 32), (1, 2, 45), (24, 24)]}
    assert len(descriptors) == 1
    for lens in [(16, 32), (1, 2, 45)]:
        step = make_step(kv, lens, first_block=100)
        out, ref = graph_vs_reference(runner, model, kv, step, lambda s: bucket_shaped_eager(model, s, 64))
        assert torch.equal(out, ref)


def test_padded_bridge_zeroes_its_tail():
    model, kv, runner, _ = setup()
    capture_all(runner)
    step = make_step(kv, (10, 15))
    plan = runner.piecewise_manager.plan(runner.decide(step).descriptor)
    padded = [s.binding for s in plan.steps if isinstance(s, EagerStep) and isinstance(s.binding, PaddedBridge)]
    assert len(padded) == 4  # 2 layers x (attention, combine)
    with torch.inference_mode():  # bridges are inference tensors (built under the runner's inference mode)
        for b in padded:
            b.bridge.fill_(float("nan"))
    runner(step)
    torch.cuda.synchronize()
    for b in padded:
        assert torch.isfinite(b.bridge[:25]).all()
        assert torch.equal(b.bridge[25:], torch.zeros_like(b.bridge[25:]))


def test_published_plan_holds_no_startup_request_object():
    model, kv, runner, created = setup()
    capture_all(runner)
    assert len(created) == 6
    refs = [weakref.ref(s) for s in created] + [weakref.ref(s.attn_metadata) for s in created]
    created.clear()
    gc.collect()
    assert all(r() is None for r in refs), "a published graph/plan keeps a start-up request object alive"
    out, ref = graph_vs_reference(runner, model, kv, make_step(kv, (30,)),
                                  lambda s: bucket_shaped_eager(model, s, 64))
    assert torch.equal(out, ref)


def test_exception_inside_boundary_publishes_nothing_and_propagates_unchanged():
    model, kv, runner, _ = setup(GraphRunnerConfig(max_decode_batch=0, pcg_max_tokens=64, pcg_token_stride=64))
    err = RuntimeError("injected in the experts boundary")
    model.layers[1].experts.fail_with = err
    model.layers[1].experts.fail_after_calls = 1  # call 1: the bucket-shaped warm-up; call 2: the build
    with pytest.raises(RuntimeError) as ei:
        runner.capture_prefill(64)
    assert ei.value is err
    assert runner.num_plans == 0 and not torch.cuda.is_current_stream_capturing()
    pool = runner.piecewise_manager.bridge_pool
    assert all(s.available for s in pool._slots)
    step = make_step(kv, (20,))
    assert runner.decide(step).reason is EagerReason.NO_PLAN
    model.layers[1].experts.fail_with = None
    runner.capture_prefill(64)  # rebuild works
    out, ref = graph_vs_reference(runner, model, kv, step, lambda s: bucket_shaped_eager(model, s, 64))
    assert torch.equal(out, ref)


def test_exception_inside_captured_piece_propagates_unchanged():
    model, kv, runner, _ = setup(GraphRunnerConfig(max_decode_batch=0, pcg_max_tokens=64, pcg_token_stride=64))
    err = ValueError("injected between boundaries")
    model.inject_forward_failure(call=2, error=err)  # call 1 is the warm-up, call 2 the build
    with pytest.raises(ValueError) as ei:
        runner.capture_prefill(64)
    assert ei.value is err and runner.num_plans == 0
    assert not torch.cuda.is_current_stream_capturing()
    runner.capture_prefill(64)
    step = make_step(kv, (33,))
    out, ref = graph_vs_reference(runner, model, kv, step, lambda s: bucket_shaped_eager(model, s, 64))
    assert torch.equal(out, ref)


def test_reset_frees_graph_memory_and_rebuild_works():
    model, kv, runner, _ = setup()
    step = make_step(kv, (20,))
    runner(step)  # eager (no plan yet): initializes kernels / cuBLAS on the runner's stream

    def reserved():
        torch.cuda.synchronize()
        gc.collect()
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear is not None:
            clear()
        torch.cuda.empty_cache()
        return torch.cuda.memory_reserved()

    base = reserved()
    capture_all(runner)
    out = runner(step).clone()
    del out
    snap = runner.stats.snapshot()
    graph_bytes = snap["memory"]["piecewise_graph_pool_bytes"] + snap["memory"]["decode_graph_pool_bytes"]
    captured = reserved()
    assert captured > base and graph_bytes > 0, (base, captured, snap["memory"])
    hooks = []
    runner.add_reset_hook(lambda: hooks.append("deepep-destroy"))
    runner.reset()
    after = reserved()
    assert hooks == ["deepep-destroy"]
    assert after <= base + (2 << 20), f"reset kept {after - base} bytes (captured +{captured - base})"
    assert runner.num_plans == 0 and runner.num_decode_graphs == 0
    snap = runner.stats.snapshot()
    assert snap["captured_decode"] == 0 and snap["captured_prefill"] == 0 and snap["resets"] == 1
    assert snap["memory"]["piecewise_graph_pool_bytes"] == 0
    capture_all(runner)  # rebuild
    out, ref = graph_vs_reference(runner, model, kv, make_step(kv, (50,)),
                                  lambda s: bucket_shaped_eager(model, s, 64))
    assert torch.equal(out, ref)


def test_request_time_rejections_on_device():
    model, kv, runner, _ = setup()
    capture_all(runner)
    assert runner.decide(make_step(kv, (100, 29))).reason is EagerReason.TOO_MANY_TOKENS
    assert runner.decide(make_step(kv, (20,), chunked_prefill=True)).reason is EagerReason.CHUNKED_PREFILL
    assert runner.decide(make_step(kv, (20,), micro_batch=True)).reason is EagerReason.MICRO_BATCH
    assert runner.decide(make_step(kv, (20,), extras={"output_scale": torch.ones(1, device=DEV)})).reason is \
        EagerReason.DYNAMIC_EXTRAS
    # scalar extras are descriptor constants: no plan was built with them
    assert runner.decide(make_step(kv, (20,), extras={"output_scale": 2.0})).reason is EagerReason.NO_PLAN
    step = make_step(kv, (100, 29))
    saved = snapshot(kv)
    out = runner(step)
    restore(kv, saved)
    with torch.inference_mode():
        ref = model(step.input_ids, step.position_ids, kv, step.attn_metadata)
    assert torch.equal(out, ref)
    assert runner.stats.snapshot()["eager_reasons"] == {"too_many_tokens": 1}


def test_profiler_ranges():
    model, kv, runner, _ = setup()
    capture_all(runner)
    step = make_step(kv, (20,))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        runner(step)
        torch.cuda.synchronize()
    names = {e.name for e in prof.events()}
    assert {"forward_piecewise_cudagraph", "piecewise::graph:0", "piecewise::eager:1"} <= names


# ---------------------------------------------------------------- misuse is rejected at build


@eager_boundary(output=OutputPolicy.EAGER_ONLY)
def _leaky_route(x):
    return x.argmax(dim=-1)


class LeakyModel(nn.Module):
    """Captured work consumes an EAGER_ONLY result: its address is not stable, the build must refuse."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(8, 8, device=DEV)
        self.proj = nn.Linear(8, 8, device=DEV)

    def forward(self, input_ids, position_ids, kv_caches, attn_metadata, **constants):
        h = self.proj(self.emb(input_ids % 8))
        ids = _leaky_route(h)
        return h + ids[:, None].float()

    def get_outputs(self, output, num_tokens):
        return output[:num_tokens]

    def supports_cuda_graph(self, step):
        return False

    def supports_piecewise_cuda_graph(self):
        return True

    def enable_piecewise_cuda_graph(self):
        return True


def test_captured_use_of_eager_only_result_is_rejected():
    model = LeakyModel()
    kv = toy_kv_caches(ToyDecoder(device=DEV), 4, BS, DEV)
    cfg = GraphRunnerConfig(max_decode_batch=0, pcg_max_tokens=64, pcg_token_stride=64)
    runner = CUDAGraphRunner(model, cfg, DEV, toy_dummy_factory(kv, BS, W, DEV), W)
    with pytest.raises(CapturedRequestValueError):
        runner.capture_prefill(64)
    assert runner.num_plans == 0 and not torch.cuda.is_current_stream_capturing()


def test_invalidated_capture_keeps_original_error_and_device_stays_usable():
    """A forbidden call during capture (device sync) invalidates it; the sync's error propagates."""
    model, kv, runner, _ = setup(GraphRunnerConfig(max_decode_batch=0, pcg_max_tokens=64, pcg_token_stride=64))
    model.inject_forward_failure(call=2, sync=True)
    with pytest.raises(RuntimeError) as ei:
        runner.capture_prefill(64)
    assert "capture" in str(ei.value).lower() or "not permitted" in str(ei.value).lower(), str(ei.value)
    assert runner.num_plans == 0 and not torch.cuda.is_current_stream_capturing()
    runner.capture_prefill(64)
    step = make_step(kv, (40,))
    out, ref = graph_vs_reference(runner, model, kv, step, lambda s: bucket_shaped_eager(model, s, 64))
    assert torch.equal(out, ref)
