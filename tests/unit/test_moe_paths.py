"""The MoE block's expert-path choice (CPU, no Triton): a pure function of rows, backend and capture state.

Under EP (all-gather: a decode bucket of b tokens becomes b * ep dispatched rows) a capture must never take the
host-synced grouped path, at any bucket up to 256; with the routed kernel every size takes it, captured or not;
a packed (DeepEP low-latency) dispatch goes to the packed kernel. The block-level tests run `SparseMoeBlock` on
CPU with a fake EP dispatcher and a simulated capture (`modeling.moe.capture_active` patched), with the
host-synced path made to fail.
"""
import dataclasses
import functools

import pytest
import torch

from graphrunner.config import GraphRunnerConfig
from modeling import moe
from modeling.config import get_preset
from modeling.ops import get_kernel_ops, moe_ref
from modeling.ops.options import KernelOptions
from parallel.context import ParallelContext
from parallel.dispatch import StaticTokensMixin

DECODE_BUCKETS = GraphRunnerConfig(max_decode_batch=256).decode_buckets()
EP_SIZES = (1, 2, 4, 8)


def test_decode_buckets_reach_256():
    assert DECODE_BUCKETS[-1] == 256 and len(DECODE_BUCKETS) > 5


@pytest.mark.parametrize("routed", [False, True])
@pytest.mark.parametrize("ep", EP_SIZES)
def test_simulated_capture_picks_a_device_side_path_at_every_bucket(ep, routed):
    for bucket in DECODE_BUCKETS:
        path = moe.expert_path(bucket * ep, routed=routed, capturing=True, static_max_tokens=256)
        assert path not in moe.HOST_SYNC_PATHS, (ep, bucket, path)
        assert path == ("routed" if routed else "static")


def test_routed_kernel_serves_every_size_and_torch_keeps_its_eager_split():
    for rows in (1, 256, 257, 512, 2048, 16384):
        for capturing in (False, True):
            assert moe.expert_path(rows, routed=True, capturing=capturing, static_max_tokens=256) == "routed"
    assert moe.expert_path(256, routed=False, capturing=False, static_max_tokens=256) == "static"
    assert moe.expert_path(257, routed=False, capturing=False, static_max_tokens=256) == "grouped"
    assert set(moe.EXPERT_PATHS) == {"routed", "static", "grouped"} and moe.HOST_SYNC_PATHS == {"grouped"}


class _FakeAllGather(StaticTokensMixin):
    """EP all-gather stand-in: every rank's tokens (this rank's, then shifted copies standing in for the others),
    routing kept; combine takes this rank's rows back."""

    def __init__(self, ep: int, packed_cap: int = 0, e_local: int = 0):
        self.ep, self.packed_cap, self.e_local = ep, packed_cap, e_local
        self.rows_seen: list[int] = []

    def dispatch(self, hidden, ids, weights):
        t = hidden.shape[0]
        h = torch.cat([hidden + 0.01 * r for r in range(self.ep)])
        i, w = ids.repeat(self.ep, 1), weights.repeat(self.ep, 1)
        self.rows_seen.append(h.shape[0])
        return h, i, w, t

    def packed_counts(self, handle):
        if not self.packed_cap:
            return None
        return torch.full((self.e_local,), min(self.packed_cap, 3), dtype=torch.int32)

    def combine(self, out, t):
        return out[:t]


def _block(ep: int, ops=None, dispatcher=None) -> moe.SparseMoeBlock:
    cfg = get_preset("qwen3-moe-tiny")
    ctx = ParallelContext(ep_rank=0, ep_size=ep, ep_dispatcher=dispatcher or _FakeAllGather(ep))
    block = moe.SparseMoeBlock(cfg, ctx, ops=ops)
    g = torch.Generator().manual_seed(ep)
    for p in (block.gate.weight, block.w13, block.w2):
        p.data.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return block


def _no_host_sync(*args, **kwargs):
    raise AssertionError("the host-synced grouped path ran")


@pytest.mark.parametrize("ep", [2, 4])
def test_ep_block_under_simulated_capture_never_takes_the_grouped_path(monkeypatch, ep):
    block = _block(ep)
    monkeypatch.setattr(moe, "_experts_grouped", _no_host_sync)
    monkeypatch.setattr(moe, "capture_active", lambda t: True)
    with torch.inference_mode():
        for bucket in DECODE_BUCKETS:
            x = torch.randn(bucket, block.hidden)
            y = block(x)
            assert y.shape == (bucket, block.hidden) and torch.isfinite(y).all()
    assert block.dispatcher.rows_seen == [b * ep for b in DECODE_BUCKETS]
    assert max(block.dispatcher.rows_seen) > block.static_max_tokens  # the old rule would have picked grouped


def test_without_the_capture_large_ep_batches_take_the_grouped_path(monkeypatch):
    """The same block eagerly: 512 gathered rows take the grouped path (the simulated capture above matters)."""
    block = _block(2)
    calls = []
    monkeypatch.setattr(moe, "_experts_grouped", lambda *a: calls.append(a[0].shape[0]) or moe_ref.experts_grouped(*a))
    with torch.inference_mode():
        block(torch.randn(256, block.hidden))
        block(torch.randn(128, block.hidden))
    assert calls == [512]


def test_static_and_grouped_references_agree_on_ep_rows():
    block = _block(2)
    x = torch.randn(300, block.hidden)
    weights, ids = moe.route(block.gate(x), block.top_k, block.renormalize)
    ids[::7, 1] = -1  # padding rows of a dispatch carry id -1
    args = (x, ids, weights, block.w13, block.w2, block.first_expert)
    torch.testing.assert_close(moe_ref.experts_grouped(*args), moe_ref.experts_static(*args), atol=1e-5, rtol=1e-5)


def test_a_backend_with_the_routed_kernel_uses_it_for_every_size_and_capture_state(monkeypatch):
    calls = []

    def routed(x, ids, weights, w13, w2, first_expert):
        calls.append((x.shape[0], ids.shape, first_expert))
        return moe_ref.experts_static(x, ids, weights, w13, w2, first_expert)

    ops = dataclasses.replace(get_kernel_ops("cpu"), moe_routed=routed)
    block = _block(2, ops=ops)
    monkeypatch.setattr(moe, "_experts_grouped", _no_host_sync)
    monkeypatch.setattr(moe, "_experts_static", _no_host_sync)
    with torch.inference_mode():
        for capturing in (True, False):
            monkeypatch.setattr(moe, "capture_active", lambda t, c=capturing: c)
            for bucket in (1, 3, 256, 1024):
                block(torch.randn(bucket, block.hidden))
    assert [c[0] for c in calls] == [2, 6, 512, 2048] * 2
    assert all(c[1][1] == block.top_k and c[2] == block.first_expert for c in calls)


def test_a_packed_dispatch_goes_to_the_packed_kernel_with_the_expert_view():
    seen = []

    def packed(x, counts, w13, w2):
        seen.append((tuple(x.shape), counts.tolist()))
        return moe_ref.packed_experts(x, counts, w13, w2)

    def routed(*a):
        raise AssertionError("a packed dispatch must not be regrouped")

    cfg = get_preset("qwen3-moe-tiny")
    e_local = cfg.num_experts // 2
    disp = _FakeAllGather(1, packed_cap=4, e_local=e_local)
    ops = dataclasses.replace(get_kernel_ops("cpu"), moe_routed=routed, moe_packed=packed)
    block = _block(2, ops=ops, dispatcher=disp)
    x = torch.randn(e_local * 4, block.hidden)  # the packed [E_local * cap, H] rows as the dispatcher returns them
    ids = torch.full((x.shape[0], 1), -1, dtype=torch.int64)
    y = block.local_experts(x, ids, torch.ones(x.shape[0], 1), handle=None)
    assert seen == [((e_local, 4, block.hidden), [3] * e_local)] and y.shape == x.shape
    assert torch.equal(y.view(e_local, 4, -1)[:, 3:], torch.zeros(e_local, 1, block.hidden))


def test_the_block_projects_its_router_through_the_backends_router_projection():
    """`KernelOps.moe_router_linear` (the GEMV at few rows on the Triton backend) computes the block's router
    logits; without one (the torch backend) the block takes `F.linear`, as `nn.Linear` would."""
    seen = []

    def router_linear(x, weight):
        seen.append((x.shape[0], weight is block.gate.weight))
        return torch.nn.functional.linear(x, weight)

    block = _block(1, ops=dataclasses.replace(get_kernel_ops("cpu"), moe_router_linear=router_linear))
    plain = _block(1, ops=get_kernel_ops("cpu"))
    assert plain.router_linear is torch.nn.functional.linear
    x = torch.randn(3, block.hidden)
    with torch.inference_mode():
        assert torch.equal(block(x), plain(x))
    assert seen == [(3, True)]


def test_cpu_backend_has_no_routed_kernel():
    ops = get_kernel_ops("cpu")
    assert ops.moe_routed is None and ops.moe_packed is None
    assert _block(2, ops=ops).routed_kernel is None


def test_piecewise_boundary_unless_the_backend_captures_the_routed_kernel_in_pieces():
    """Under piecewise graphs the block is an eager boundary unless the backend's options ask for the experts
    inside the pieces (`KernelOptions.moe_in_pieces`) and they can go there: the routed kernel serves them and no
    EP dispatcher exchanges counts on the host. The torch backend (its grouped path reads counts) always keeps the
    boundary."""
    cfg = get_preset("qwen3-moe-tiny")
    in_pieces = dataclasses.replace(get_kernel_ops("cpu"), moe_routed=lambda *a: None)  # the default options
    routed = dataclasses.replace(in_pieces, options=KernelOptions(moe_in_pieces=False))
    cases = {
        "routed kernel in pieces (the default), no dispatcher": (
            moe.SparseMoeBlock(cfg, ParallelContext(), ops=in_pieces), False),
        "routed kernel, in pieces turned off": (moe.SparseMoeBlock(cfg, ParallelContext(), ops=routed), True),
        "routed kernel in pieces under EP": (_block(2, ops=in_pieces), True),
        "torch backend asked for pieces": (moe.SparseMoeBlock(
            cfg, ParallelContext(), ops=get_kernel_ops("cpu", options=KernelOptions(moe_in_pieces=True))), True),
        "no backend": (moe.SparseMoeBlock(cfg, ParallelContext()), True),
    }
    for name, (block, boundary) in cases.items():
        assert block.needs_eager_boundary() is boundary, name
        assert block._experts == block.experts, name  # before: the plain method everywhere
        block.enable_piecewise_cuda_graph()
        installed = isinstance(block._experts, functools.partial) and block._experts.func is moe._moe_boundary
        assert installed is boundary, name
        assert installed or block._experts == block.experts, name
