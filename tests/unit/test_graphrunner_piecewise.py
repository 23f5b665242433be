"""The piecewise tracer's host-side logic on CPU: boundaries, bridges, templates, plan structure.

Real graph capture needs CUDA (tests/gpu/test_graphrunner_pcg.py). Here the builder gets a
no-op piece factory, so the model's captured parts simply run eagerly while the builder
splits, binds and publishes exactly as it does on the device.
"""
import gc
import weakref

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from graphrunner.boundary import BoundarySpec, OutputPolicy, active_builder, boundary_spec, eager_boundary
from graphrunner.bridges import FixedBridge, PaddedBridge, ReusableBridgePool, make_weak_view, validate_leaf
from graphrunner.errors import (
    BoundaryDeclarationError,
    BridgeMismatchError,
    CapturedRequestValueError,
    ConcurrentBuildError,
    NestedRequestObjectError,
    UnsupportedBoundaryArgument,
    UnsupportedBoundaryOutput,
)
from graphrunner.forward_args import model_kwargs
from graphrunner.piecewise_builder import ArgumentBinder, _CaptureBuilder
from graphrunner.plan import EagerStep, GraphStep, PiecewisePlan, _EagerSlotRef, _FrameValueRef, iter_templates
from graphrunner.standard import REQUEST_LIFETIME_FRAME_NAMES, frame_inputs
from graphrunner.testing import NoopPiece, ToyDecoder, toy_attention, toy_dummy_factory, toy_kv_caches

CPU = torch.device("cpu")


def builder(frame, capacity=16, pool=None, guard=True, inputs=None):
    return _CaptureBuilder(device=CPU, stream=None, pool=None, frame=frame, request_owned=REQUEST_LIFETIME_FRAME_NAMES,
                           token_capacity=capacity, bridge_pool=pool or ReusableBridgePool(), inputs=inputs or {},
                           guard=guard, graph_factory=NoopPiece)


# ---------------------------------------------------------------- eager_boundary


@eager_boundary
def double(x):
    return x * 2


@eager_boundary(output=OutputPolicy.PADDED_TOKENS, token_axis=0)
def first_rows(x, n):
    return x[:n] + 1


@eager_boundary
def outer(x):
    return double(x) + 1  # nested boundary: part of `outer`


class Mod(torch.nn.Module):
    @eager_boundary(reuse_bridge_after_next_step=True)
    def scaled(self, x):
        return x * 3


def test_boundary_is_transparent_outside_construction():
    x = torch.arange(4.0)
    assert active_builder() is None
    assert torch.equal(double(x), x * 2)
    assert torch.equal(first_rows(x, 2), x[:2] + 1)
    assert torch.equal(outer(x), x * 2 + 1)
    assert torch.equal(Mod().scaled(x), x * 3)
    spec = boundary_spec(first_rows)
    assert isinstance(spec, BoundarySpec) and spec.output is OutputPolicy.PADDED_TOKENS and spec.padded
    assert boundary_spec(double).output is OutputPolicy.BRIDGE
    assert boundary_spec(Mod.scaled).reuse_bridge_after_next_step
    assert double.__name__ == "double"


def test_boundary_declaration_errors():
    with pytest.raises(BoundaryDeclarationError):
        eager_boundary(output="bridge")
    with pytest.raises(BoundaryDeclarationError):
        eager_boundary(output=OutputPolicy.EAGER_ONLY, reuse_bridge_after_next_step=True)
    with pytest.raises(BoundaryDeclarationError):
        eager_boundary(token_axis=True)
    with pytest.raises(BoundaryDeclarationError):
        eager_boundary(double)


# ---------------------------------------------------------------- bridges


def spec(output=OutputPolicy.BRIDGE, axis=0):
    return BoundarySpec("t", lambda: None, output, axis)


def test_padded_bridge_copies_prefix_and_zeroes_tail():
    b = PaddedBridge(torch.full((6, 3), float("nan")), 0)
    b.bind(torch.ones(4, 3), spec(OutputPolicy.PADDED_TOKENS))
    assert torch.equal(b.bridge[:4], torch.ones(4, 3)) and torch.equal(b.bridge[4:], torch.zeros(2, 3))
    b2 = PaddedBridge(torch.full((2, 5), 7.0), 1)
    b2.bind(torch.ones(2, 3), spec(OutputPolicy.PADDED_VIEW, 1))
    assert torch.equal(b2.bridge, torch.tensor([[1.0, 1, 1, 0, 0]] * 2))
    for bad in (torch.ones(7, 3), torch.ones(4, 2), torch.ones(4, 3, dtype=torch.float64), torch.ones(4), (1,)):
        with pytest.raises(BridgeMismatchError):
            b.bind(bad, spec(OutputPolicy.PADDED_TOKENS))


def test_fixed_bridge_requires_exact_shape():
    f = FixedBridge(torch.zeros(2, 3))
    f.bind(torch.ones(2, 3), spec())
    assert torch.equal(f.bridge, torch.ones(2, 3))
    with pytest.raises(BridgeMismatchError):
        f.bind(torch.ones(3, 3), spec())


def test_validate_leaf_rejections():
    big = torch.zeros(8, 4)
    x = torch.zeros(3, 4)
    ptrs = {x.untyped_storage().data_ptr()}
    validate_leaf(torch.zeros(3, 4).t(), spec(), CPU, set(), None)  # dense permuted result is fine
    with pytest.raises(UnsupportedBoundaryOutput, match="aliasing"):
        validate_leaf(x[:2], spec(OutputPolicy.PADDED_VIEW), CPU, ptrs, 8)
    with pytest.raises(UnsupportedBoundaryOutput, match="PADDED_VIEW"):
        validate_leaf(big[:3], spec(OutputPolicy.PADDED_TOKENS), CPU, set(), 8)
    validate_leaf(big[:3], spec(OutputPolicy.PADDED_VIEW), CPU, set(), 8)  # view-tolerant
    with pytest.raises(UnsupportedBoundaryOutput, match="rows"):
        validate_leaf(torch.zeros(9, 4), spec(OutputPolicy.PADDED_TOKENS), CPU, set(), 8)
    with pytest.raises(UnsupportedBoundaryOutput, match="overlapping"):
        validate_leaf(torch.zeros(1, 4).expand(3, 4), spec(OutputPolicy.PADDED_VIEW), CPU, set(), 8)
    with pytest.raises(UnsupportedBoundaryOutput, match="non-strided"):
        validate_leaf(torch.zeros(3, 4).to_sparse(), spec(), CPU, set(), None)
    with pytest.raises(UnsupportedBoundaryOutput, match="lives on|bridges live"):
        validate_leaf(torch.zeros(3, 4), spec(), torch.device("meta"), set(), None)


def test_reusable_bridge_pool_narrows_and_keeps_storage():
    pool = ReusableBridgePool()
    a = pool.allocate_padded_tensor((16, 4), torch.float32, CPU, 0)
    storage = a.untyped_storage().data_ptr()
    b = pool.allocate_padded_tensor((8, 4), torch.float32, CPU, 0)  # a is leased: new slot
    assert pool.num_slots == 2
    pool.release(a)
    c = pool.allocate_padded_tensor((12, 4), torch.float32, CPU, 0)  # reuses a's slot, narrowed
    assert c.shape == (12, 4) and c.untyped_storage().data_ptr() == storage and pool.num_slots == 2
    pool.release(b)
    d = pool.allocate_tensor((8, 4), torch.float32, CPU)  # fixed slots do not share padded ones
    assert pool.num_slots == 3 and d.shape == (8, 4)
    pool.release(d)
    assert pool.allocate_tensor((8, 4), torch.float32, CPU).untyped_storage().data_ptr() == d.untyped_storage().data_ptr()
    with pytest.raises(KeyError):
        pool.release(torch.zeros(1))
    assert pool.nbytes == (16 * 4 + 8 * 4 + 8 * 4) * 4
    pool.clear()
    assert pool.nbytes == 0


def test_weak_view_does_not_own_storage():
    t = torch.arange(12.0).view(3, 4)
    v = make_weak_view(t[1:])
    assert v.data_ptr() == t[1:].data_ptr() and v.shape == (2, 4) and torch.equal(v, t[1:])
    ref = StorageWeakRef(t.untyped_storage())
    del t
    gc.collect()
    assert ref.expired()  # the view never kept the storage alive (do not touch v now)


# ---------------------------------------------------------------- argument templates


class Meta:
    def __init__(self):
        self.slot_mapping = torch.arange(4)
        self.is_decoding = False


class Holder:
    def __init__(self, meta):
        self.meta = meta


def test_argument_binder_shallow_identity_binding():
    meta, caches, state = Meta(), [torch.zeros(2)], torch.zeros(3, dtype=torch.int64)
    binder = ArgumentBinder({"kv_caches": caches, "attn_metadata": meta, "state_ids": state}, REQUEST_LIFETIME_FRAME_NAMES, CPU)
    assert isinstance(binder.template(meta), _FrameValueRef) and binder.template(meta).name == "attn_metadata"
    assert binder.template(caches).name == "kv_caches" and binder.template(state).name == "state_ids"
    assert binder.template(3).value == 3 and binder.template(None).value is None
    mod = torch.nn.Linear(2, 2)
    assert binder.template(mod).value is mod
    for nested in ([meta], {"m": meta}, (1, caches), Holder(meta)):
        with pytest.raises(NestedRequestObjectError):
            binder.template(nested)
    for request_tensor in (meta.slot_mapping, meta.slot_mapping[1:], state.view(3, 1)[:, 0]):
        with pytest.raises(NestedRequestObjectError):
            binder.template(request_tensor)
    graph_tensor = torch.ones(4)
    t = binder.template(graph_tensor)
    assert t.tensor is not graph_tensor and t.tensor.data_ptr() == graph_tensor.data_ptr()
    slot_value = (torch.ones(2), torch.zeros(2))
    binder.add_slot(0, slot_value)
    assert isinstance(binder.template(slot_value), _EagerSlotRef)
    leaf = binder.template(slot_value[1])
    assert (leaf.slot, leaf.path) == (0, (1,))
    with pytest.raises(UnsupportedBoundaryArgument, match="eager-only"):
        binder.template(slot_value[0][:1])


def test_argument_binder_rejects_host_tensors_on_device():
    binder = ArgumentBinder({}, (), torch.device("cuda", 0))
    with pytest.raises(UnsupportedBoundaryArgument, match="cpu tensor"):
        binder.template(torch.ones(2))


# ---------------------------------------------------------------- plan construction (no-op pieces)


@pytest.fixture
def toy():
    model = ToyDecoder(max_tokens=64)
    kv = toy_kv_caches(model, 32, 4, "cpu")
    created = []
    return model, kv, toy_dummy_factory(kv, 4, 8, "cpu", created), created


def build_toy(model, step, capacity, pool=None, guard=True):
    b = builder(frame_inputs(step), capacity, pool, guard,
                inputs={"input_ids": step.input_ids, "position_ids": step.position_ids})
    with torch.inference_mode():
        return b.build(lambda: model(**model_kwargs(step)))


def test_plan_structure_bridges_and_templates(toy):
    model, kv, factory, created = toy
    pool = ReusableBridgePool()
    step = factory(32, 1, False)
    plan, out = build_toy(model, step, 32, pool)
    kinds = "".join("G" if isinstance(s, GraphStep) else "E" for s in plan.steps)
    assert kinds == "G" + "EG" * 8  # 2 layers x (attention, route, experts, combine)
    assert [s.index for s in plan.steps] == list(range(len(plan.steps)))
    eager = [s for s in plan.steps if isinstance(s, EagerStep)]
    policies = [s.spec.output for s in eager[:4]]
    assert policies == [OutputPolicy.PADDED_TOKENS, OutputPolicy.EAGER_ONLY, OutputPolicy.BRIDGE, OutputPolicy.PADDED_VIEW]
    attn = eager[0]
    names = [t.name for t in iter_templates(attn) if isinstance(t, _FrameValueRef)]
    assert names == ["kv_caches", "attn_metadata"]
    assert attn.binding.capacity == 32 and attn.binding.bridge.shape == (32, 4, 8)
    assert attn.fn is toy_attention  # replay calls the undecorated function
    experts = eager[2]
    assert any(isinstance(t, _EagerSlotRef) for t in iter_templates(experts))
    # the experts' reusable bridge was released after its next step and reused by layer 2
    assert pool.num_slots == 1 and all(s.available for s in pool._slots)
    assert eager[2].binding.bridge.untyped_storage().data_ptr() == eager[6].binding.bridge.untyped_storage().data_ptr()
    assert plan.num_slots == 2 and out.shape == (32, 32)
    assert plan.output.data_ptr() == out.data_ptr()


def test_published_plan_holds_no_startup_request_object(toy):
    model, kv, factory, created = toy
    step = factory(16, 2, False)
    refs = [weakref.ref(step), weakref.ref(step.attn_metadata)]
    plan, out = build_toy(model, step, 16)
    del step, out
    created.clear()
    gc.collect()
    assert all(r() is None for r in refs)
    assert plan.num_eager_steps == 8


def test_exception_inside_boundary_propagates_unchanged_and_returns_leases(toy):
    model, kv, factory, created = toy
    err = RuntimeError("injected")
    model.layers[1].experts.fail_with = err
    pool = ReusableBridgePool()
    try:
        with pytest.raises(RuntimeError) as ei:
            build_toy(model, factory(16, 1, False), 16, pool)
    finally:
        model.layers[1].experts.fail_with = None
    assert ei.value is err
    assert active_builder() is None
    assert all(s.available for s in pool._slots)
    plan, _ = build_toy(model, factory(16, 1, False), 16, pool)  # a later build works
    assert plan.num_eager_steps == 8


class LeakyEagerOnly(torch.nn.Module):
    """Misuse: captured work consumes an EAGER_ONLY result."""

    def forward(self, input_ids, position_ids, kv_caches, attn_metadata):
        x = input_ids.float()
        routing = route_only(x)
        return x + routing  # captured use of an eager-only value


@eager_boundary(output=OutputPolicy.EAGER_ONLY)
def route_only(x):
    return x * 2


class ReadsMetadata(torch.nn.Module):
    def forward(self, input_ids, position_ids, kv_caches, attn_metadata):
        return input_ids.float() + attn_metadata.slot_mapping.float()  # captured use of request metadata


class MixedTree(torch.nn.Module):
    def forward(self, input_ids, position_ids, kv_caches, attn_metadata):
        return mixed(input_ids.float())[0]


@eager_boundary
def mixed(x):
    return x, 3


class ReturnsInput(torch.nn.Module):
    def forward(self, input_ids, position_ids, kv_caches, attn_metadata):
        return same(input_ids.float() + 1)


@eager_boundary
def same(x):
    return x.mul_(2)


class PassesNested(torch.nn.Module):
    def forward(self, input_ids, position_ids, kv_caches, attn_metadata):
        return takes_list(input_ids.float(), [attn_metadata])


@eager_boundary
def takes_list(x, metas):
    return x + 1


class NestedBoundaries(torch.nn.Module):
    def forward(self, input_ids, position_ids, kv_caches, attn_metadata):
        return outer(input_ids.float()) + 1


@pytest.mark.parametrize(
    "module,error",
    [(LeakyEagerOnly, CapturedRequestValueError), (ReadsMetadata, CapturedRequestValueError),
     (MixedTree, UnsupportedBoundaryOutput), (ReturnsInput, UnsupportedBoundaryOutput),
     (PassesNested, NestedRequestObjectError)],
)
def test_build_rejections(toy, module, error):
    _, kv, factory, _ = toy
    step = factory(8, 1, False)
    with pytest.raises(error):
        build_toy(module(), step, 8)
    assert active_builder() is None


def test_nested_boundaries_belong_to_the_outermost(toy):
    _, kv, factory, _ = toy
    plan, out = build_toy(NestedBoundaries(), factory(8, 1, False), 8)
    eager = [s for s in plan.steps if isinstance(s, EagerStep)]
    assert len(eager) == 1 and eager[0].spec.name.endswith("outer")
    assert torch.equal(out, torch.zeros(8) * 2 + 2)


def test_guard_can_be_disabled(toy):
    _, kv, factory, _ = toy
    plan, _ = build_toy(ReadsMetadata(), factory(8, 1, False), 8, guard=False)
    assert plan.num_eager_steps == 0


def test_concurrent_build_rejected(toy):
    model, kv, factory, _ = toy
    step = factory(8, 1, False)
    inner = builder(frame_inputs(step), 8)

    def forward():
        return inner.build(lambda: model(**model_kwargs(step)))

    with pytest.raises(ConcurrentBuildError):
        builder(frame_inputs(step), 8).build(forward)


# ---------------------------------------------------------------- replay of eager steps (host)


def test_plan_replay_resolves_frame_slots_and_bridges():
    @eager_boundary(output=OutputPolicy.EAGER_ONLY)
    def plan_route(meta):
        return meta.slot_mapping * 10

    @eager_boundary(output=OutputPolicy.PADDED_TOKENS)
    def plan_attend(x, routing, meta):
        n = meta.slot_mapping.shape[0]
        return x[:n] + routing.float()

    x = torch.zeros(6)
    route_spec, attend_spec = boundary_spec(plan_route), boundary_spec(plan_attend)
    bridge = torch.full((6,), float("nan"))
    from graphrunner.bridges import EagerOnlySlot
    from graphrunner.plan import _TensorRef

    steps = [
        EagerStep(0, route_spec, [_FrameValueRef("attn_metadata")], {}, EagerOnlySlot(0)),
        EagerStep(1, attend_spec, [_TensorRef(x), _EagerSlotRef(0), _FrameValueRef("attn_metadata")], {},
                  PaddedBridge(bridge, 0)),
    ]
    plan = PiecewisePlan(steps, bridge, {}, [bridge], num_slots=1, pool=None)
    meta = Meta()
    out = plan.replay({"attn_metadata": meta})
    assert torch.equal(out, torch.tensor([0.0, 10, 20, 30, 0, 0]))
    meta.slot_mapping = torch.arange(2)
    assert torch.equal(plan.replay({"attn_metadata": meta}), torch.tensor([0.0, 10, 0, 0, 0, 0]))
