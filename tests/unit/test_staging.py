"""`graphrunner.staging.HostStaging` on CPU (no pinning, no event): the packed layout of the model's declared
`decode_staging` is the one the model built by hand before (three int64 fields of `[B]`, then the int32 fields
packed in pairs), its typed views alias the one staging tensor, padding writes each field's pad, `copy_prefix(p)`
copies exactly the bytes bucket p reads, a staged host decode step equals the field-by-field fill of the same
step's tensors and, byte for byte, what the hand-built staging (kept below as `_Legacy`) produced; the runner
reaches it only through `FullGraphRunner` (arm / stage_armed) and the narrow `CUDAGraphRunner` decode calls."""
from pathlib import Path

import numpy as np
import pytest
import torch

from graphrunner.full_graph import DecodeGraph, DecodeGraphKey, FullGraphRunner
from graphrunner.runner import CUDAGraphRunner
from graphrunner.staging import HostStaging, StagingField, StagingSpec, staging_for
from graphrunner.step import ForwardStep, GraphMeta
from modeling.attn_metadata import build_decode_step_host, build_step_from_arrays
from modeling.config import get_preset
from modeling.cudagraph import DECODE_STAGING
from modeling.qwen3 import Qwen3ForCausalLM
from tests.unit._decode_rows import random_decode_rows

BS = 4
CPU = torch.device("cpu")
FIELDS = ("input_ids", "position_ids", "slot_mapping", "kv_seqlens", "block_tables")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model():
    return Qwen3ForCausalLM(get_preset("qwen3-tiny"))


def _meta(b, w):
    return GraphMeta(max_batch_size=b, max_tokens=b, max_blocks_per_seq=w, device=CPU)


def _batch(rng, n, width):
    return random_decode_rows(rng, n, width, BS)


class _Legacy:
    """The staging as `modeling/cudagraph.py` built it by hand before `graphrunner.staging` (commit 9790f06):
    the reference for byte-for-byte equality."""

    def __init__(self, b, w):
        n64 = 3 * b + -(-(b + b * w) // 2)
        self.b, self.w = b, w
        self.staging = torch.zeros(n64, dtype=torch.int64)
        self.host = torch.zeros(n64, dtype=torch.int64)
        h64, h32 = self.host.numpy(), self.host.numpy()[3 * b:].view(np.int32)
        d32 = self.staging[3 * b:].view(torch.int32)
        self.dev = {"input_ids": self.staging[0:b], "position_ids": self.staging[b:2 * b],
                    "slot_mapping": self.staging[2 * b:3 * b], "kv_seqlens": d32[0:b],
                    "block_tables": d32[b:b + b * w].view(b, w)}
        self.h = {"input_ids": h64[0:b], "position_ids": h64[b:2 * b], "slot_mapping": h64[2 * b:3 * b],
                  "kv_seqlens": h32[0:b], "block_tables": h32[b:b + b * w].reshape(b, w), "rows": np.arange(b)}
        self.dev["slot_mapping"].fill_(-1)
        self.dev["kv_seqlens"].fill_(1)

    def pad(self, lo, hi):
        h = self.h
        if hi > lo:
            h["input_ids"][lo:hi] = 0
            h["position_ids"][lo:hi] = 0
            h["slot_mapping"][lo:hi] = -1
            h["kv_seqlens"][lo:hi] = 1
            h["block_tables"][lo:hi] = 0

    def stage(self, ids, hist, tables, bs, p):
        h = self.h
        n = int(hist.shape[0])
        if ids is not None:
            h["input_ids"][:n] = ids
        pos, slots = h["position_ids"][:n], h["slot_mapping"][:n]
        if n == 1:
            x = int(hist[0])
            pos[0] = x
            slots[0] = int(tables[0, x // bs]) * bs + x % bs
            h["kv_seqlens"][0] = x + 1
        else:
            pos[:] = hist
            np.add(hist, 1, out=h["kv_seqlens"][:n])
            blocks = pos // bs
            np.multiply(tables[h["rows"][:n], blocks], bs, out=slots, casting="unsafe")
            slots += pos - blocks * bs
        width = tables.shape[1]
        h["block_tables"][:n, :width] = tables
        h["block_tables"][:n, width:] = 0
        self.pad(n, p)

    def copy(self, p):
        nbytes = 3 * self.b * 8 + (self.b + p * self.w) * 4
        self.staging.view(torch.uint8)[:nbytes].copy_(self.host.view(torch.uint8)[:nbytes])


# ---- layout

@pytest.mark.parametrize("b,w", [(1, 1), (1, 2), (3, 1), (4, 3), (8, 8), (16, 5), (7, 33)])
def test_layout_is_the_hand_built_one(b, w):
    st, old = HostStaging(DECODE_STAGING, b, w, CPU), _Legacy(b, w)
    assert st.tensor.dtype == torch.int64 and st.tensor.numel() == 3 * b + -(-(b + b * w) // 2)
    assert st.mirror.shape == st.tensor.shape and st.mirror.dtype == torch.int64 and not st.mirror.is_pinned()
    assert st.copied is None and st.nbytes == st.tensor.numel() * 8
    assert [(f.name, f.offset, f.shape, f.nbytes) for f in st.layout] == [
        ("input_ids", 0, (b,), 8 * b), ("position_ids", 8 * b, (b,), 8 * b), ("slot_mapping", 16 * b, (b,), 8 * b),
        ("kv_seqlens", 24 * b, (b,), 4 * b), ("block_tables", 28 * b, (b, w), 4 * b * w)]
    for p in range(1, b + 1):
        assert st.prefix_bytes(p) == 3 * b * 8 + (b + p * w) * 4
    base, hbase = st.tensor.data_ptr(), st.mirror.numpy().ctypes.data
    obase, ohbase = old.staging.data_ptr(), old.host.numpy().ctypes.data
    for name in FIELDS:
        d, od = getattr(st.device_fields, name), old.dev[name]
        assert (d.dtype, d.shape, d.stride()) == (od.dtype, od.shape, od.stride()), name
        assert d.data_ptr() - base == od.data_ptr() - obase, name
        assert d.untyped_storage().data_ptr() == st.tensor.untyped_storage().data_ptr(), name  # one tensor
        h, oh = getattr(st.host_fields, name), old.h[name]
        assert (h.dtype, h.shape, h.strides) == (oh.dtype, oh.shape, oh.strides), name
        assert h.ctypes.data - hbase == oh.ctypes.data - ohbase and np.shares_memory(h, st.mirror.numpy()), name
    assert torch.equal(st.tensor, old.staging) and torch.equal(st.mirror, old.host)  # device padded, mirror zeros
    assert st.row_index.tolist() == list(range(b)) and st.row_index.dtype == np.int64


def test_typed_views_alias_the_staging_tensor():
    st = HostStaging(DECODE_STAGING, 4, 3, CPU)
    st.device_fields.block_tables[2, 1] = 7
    assert st.tensor.view(torch.int32)[6 * 4 + 4 + 2 * 3 + 1].item() == 7
    st.device_fields.slot_mapping[3] = 11
    assert st.tensor[2 * 4 + 3].item() == 11
    st.host_fields.kv_seqlens[1] = 5
    assert st.mirror.view(torch.int32)[6 * 4 + 1].item() == 5
    st.host_fields.position_ids[0] = 9
    assert st.mirror[4].item() == 9
    assert st.device_fields._fields == FIELDS and st.host_fields._fields == FIELDS


def test_pad_rows_writes_each_fields_pad_and_nothing_else():
    st = HostStaging(DECODE_STAGING, 6, 4, CPU)
    st.mirror.view(torch.uint8).fill_(7)  # no field holds its pad anywhere
    st.pad_rows(2, 5)
    h = st.host_fields
    for name, pad in (("input_ids", 0), ("position_ids", 0), ("slot_mapping", -1), ("kv_seqlens", 1)):
        v = getattr(h, name)
        assert (v[2:5] == pad).all() and (v[:2] != pad).all() and (v[5:] != pad).all(), name
    assert (h.block_tables[2:5] == 0).all() and (h.block_tables[:2] != 0).all() and (h.block_tables[5:] != 0).all()
    before = st.mirror.clone()
    st.pad_rows(3, 3)
    st.pad_rows(4, 1)
    assert torch.equal(st.mirror, before)


@pytest.mark.parametrize("b,w", [(4, 3), (5, 2), (8, 1)])
def test_copy_prefix_copies_exactly_the_bytes_bucket_p_reads(b, w):
    rng = np.random.default_rng(b * 10 + w)
    st = HostStaging(DECODE_STAGING, b, w, CPU)
    for p in range(1, b + 1):
        st.mirror.copy_(torch.from_numpy(rng.integers(-2**62, 2**62, st.mirror.numel())))
        st.tensor.fill_(-7)
        before = st.tensor.view(torch.uint8).clone()
        st.copy_prefix(p)
        n = 3 * b * 8 + (b + p * w) * 4
        got, want = st.tensor.view(torch.uint8), st.mirror.view(torch.uint8)
        assert torch.equal(got[:n], want[:n]) and torch.equal(got[n:], before[n:])
        d = st.device_fields  # every row bucket p reads is the mirror's
        assert torch.equal(d.block_tables[:p], torch.from_numpy(st.host_fields.block_tables[:p]))
        assert torch.equal(d.kv_seqlens, torch.from_numpy(st.host_fields.kv_seqlens))
        if p < b:
            assert not torch.equal(d.block_tables[p:], torch.from_numpy(st.host_fields.block_tables[p:]))
    views = st._copy_views[2]
    st.copy_prefix(2)
    assert st._copy_views[2] is views  # made once per bucket
    for p in (0, b + 1):
        with pytest.raises(ValueError, match="outside"):
            st.copy_prefix(p)


# ---- a host decode step through the staging

@pytest.mark.parametrize("n,p,width", [(1, 1, 3), (1, 4, 5), (3, 4, 2), (5, 8, 8), (8, 8, 1)])
def test_staged_host_step_equals_the_tensor_fill_and_the_hand_built_bytes(model, n, p, width):
    rng = np.random.default_rng(n * 100 + p * 10 + width)
    meta = _meta(8, 8)
    staging = staging_for(model, meta)
    host_bufs = model.make_buffers(meta, staging)
    dev_bufs = model.make_buffers(meta, staging_for(model, meta))
    old = _Legacy(8, 8)
    for step_no in range(4):  # successive steps: stale rows of a wider / larger earlier step must not survive
        ids, hist, tables = _batch(rng, n, width)
        if step_no == 2:  # an armed replay: padding rows transferred behind the gate, then the live step staged
            staging.wait()
            staging.pad_rows(0, p)
            staging.copy_prefix(p)
            old.pad(0, p)
            old.copy(p)
            assert torch.equal(staging.tensor, old.staging)
            staging.stage_decode(ids, hist, tables, BS, p)
            staging.copy_prefix(p)
        else:  # the ordinary host fill: wait, stage, one transfer
            ids_h, pos_h, hmeta = build_decode_step_host(ids, hist, tables, BS)
            model.fill_buffers(host_bufs, ForwardStep(ids_h, pos_h, [], hmeta), p)
        old.stage(ids, hist, tables, BS, p)
        old.copy(p)
        assert torch.equal(staging.mirror, old.host) and torch.equal(staging.tensor, old.staging)
        ids_t, pos_t, tmeta = build_step_from_arrays(ids, np.ones(n, np.int32), hist, tables, BS, "cpu")
        model.fill_buffers(dev_bufs, ForwardStep(ids_t, pos_t, [], tmeta), p)
        for f in FIELDS:
            assert torch.equal(host_bufs[f][:p], dev_bufs[f][:p]), f
        width = int(rng.integers(1, 9))


def test_make_buffers_views_the_runner_staging(model):
    meta = _meta(4, 3)
    st = staging_for(model, meta)
    bufs = model.make_buffers(meta, st)
    assert bufs["staging"] is st and staging_for(model, meta).spec is DECODE_STAGING
    for f in FIELDS:
        assert bufs[f] is getattr(st.device_fields, f)
    assert bufs["q_seqlens"].tolist() == [1] * 4 and bufs["q_start_loc"].tolist() == [0, 1, 2, 3]
    for bad in (None, HostStaging(DECODE_STAGING, 4, 2, CPU), HostStaging(DECODE_STAGING, 2, 3, CPU),
                HostStaging(StagingSpec(DECODE_STAGING.fields), 4, 3, CPU)):
        with pytest.raises(ValueError, match="decode_staging"):
            model.make_buffers(meta, bad)


# ---- the spec's validation

@pytest.mark.parametrize("kwargs,match", [
    (dict(name="_rows", dtype=torch.int64), "identifier"),
    (dict(name="1a", dtype=torch.int64), "identifier"),
    (dict(name="x", dtype=torch.float32), "dtype"),
    (dict(name="x", dtype=torch.int16), "dtype"),
    (dict(name="x", dtype=torch.int32, pad=2**31), "does not fit"),
    (dict(name="x", dtype=torch.int64, pad=1.5), "not an int"),
    (dict(name="x", dtype=torch.int64, pad=True), "not an int"),
])
def test_field_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        StagingField(**kwargs)


def test_spec_validation():
    a, b = StagingField("a", torch.int64), StagingField("b", torch.int32, pad=-1, blocks=True)
    with pytest.raises(ValueError, match="at least one field"):
        StagingSpec(())
    with pytest.raises(ValueError, match="at least one field"):
        StagingSpec((a, "b"))
    with pytest.raises(ValueError, match="repeat"):
        StagingSpec((a, StagingField("a", torch.int32)))
    with pytest.raises(ValueError, match="wider fields come first"):
        StagingSpec((b, a))
    with pytest.raises(ValueError, match="callable"):
        StagingSpec((a, b), stage_decode=3)
    spec = StagingSpec([a, b])
    assert spec.fields == (a, b)  # a list becomes a tuple: the spec stays frozen and hashable
    with pytest.raises(ValueError, match="at least one row"):
        HostStaging(spec, 0, 3, CPU)
    st = HostStaging(spec, 3, 2, CPU)
    assert st.tensor.numel() == 3 + -(-(3 * 2) // 2) and (st.device_fields.b == -1).all()
    with pytest.raises(ValueError, match="no stage_decode"):
        st.stage_decode(None, np.zeros(1, np.int32), np.zeros((1, 1), np.int32), BS, 1)


def test_staging_for_a_model_without_a_declaration_is_none():
    from graphrunner.testing import ToyDecoder

    assert staging_for(ToyDecoder(), _meta(4, 2)) is None


# ---- the runner side: FullGraphRunner.arm / stage_armed and the narrow CUDAGraphRunner calls

class _Graph:
    def __init__(self, log, staging):
        self.log, self.staging = log, staging

    def replay(self):
        self.log.append(("replay", self.staging.tensor.clone()))


def test_arm_pads_gates_copies_and_replays_in_order_then_stage_armed_writes_the_mirror(model):
    meta = _meta(8, 4)
    full = FullGraphRunner(model, meta, stream=None)
    bufs = full._ensure_buffers()
    st = full.staging
    assert bufs["staging"] is st and full.buffer_bytes >= st.nbytes
    rng = np.random.default_rng(3)
    ids, hist, tables = _batch(rng, 5, 4)
    ids_h, pos_h, hmeta = build_decode_step_host(ids, hist, tables, BS)
    model.fill_buffers(bufs, ForwardStep(ids_h, pos_h, [], hmeta), 8)  # a previous step's rows
    log = []
    key = DecodeGraphKey(8)
    full._graphs[key] = DecodeGraph(key, _Graph(log, st), torch.empty(0), 0, 0.0)
    full.arm(key, lambda: log.append(("gate", st.tensor.clone(), st.mirror.clone())))
    assert [e[0] for e in log] == ["gate", "replay"]
    prev = _Legacy(8, 4)
    prev.stage(ids, hist, tables, BS, 8)
    prev.copy(8)
    assert torch.equal(log[0][1], prev.staging)  # the gate comes before the transfer ...
    pad = _Legacy(8, 4)
    pad.host.copy_(prev.host)
    pad.pad(0, 8)
    assert torch.equal(log[0][2], pad.host)  # ... after the padding rows
    assert torch.equal(log[1][1].view(torch.uint8)[:st.prefix_bytes(8)], pad.host.view(torch.uint8)[:st.prefix_bytes(8)])
    ids, hist, tables = _batch(rng, 3, 2)
    full.stage_armed(key, ids, hist, tables, BS)
    pad.stage(ids, hist, tables, BS, 8)
    assert torch.equal(st.mirror, pad.host)
    full.reset()
    assert full.staging is None and full._buffers is None


def test_arm_needs_a_declared_staging():
    from graphrunner.testing import ToyDecoder

    full = FullGraphRunner(ToyDecoder(), _meta(4, 2), stream=None)
    full._ensure_buffers()
    key = DecodeGraphKey(4)
    full._graphs[key] = DecodeGraph(key, _Graph([], None), torch.empty(0), 0, 0.0)
    gated = []
    with pytest.raises(Exception, match="decode_staging"):
        full.arm(key, lambda: gated.append(1))
    assert not gated  # nothing was enqueued behind a gate nobody opens


def test_the_runner_serves_decode_graphs_by_key_through_narrow_calls():
    calls = []

    class _Full:
        def replay(self, *a):
            calls.append(("replay", a))
            return "out"

        def arm(self, *a):
            calls.append(("arm", a))

        def stage_armed(self, *a):
            calls.append(("stage_armed", a))

    runner = CUDAGraphRunner.__new__(CUDAGraphRunner)
    runner._full = _Full()
    key, gate = DecodeGraphKey(4), object()
    assert runner.replay_decode(key, "step") == "out"
    runner.arm_decode(key, gate)
    runner.stage_armed_decode(key, "ids", "hist", "tables", 16)
    assert calls == [("replay", (key, "step")), ("arm", (key, gate)),
                     ("stage_armed", (key, "ids", "hist", "tables", 16))]


def test_no_product_code_outside_graphrunner_reaches_into_the_decode_graphs():
    bad = []
    for pkg in ("actors", "engine", "launch", "modeling", "parallel"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            for i, line in enumerate(path.read_text().splitlines(), 1):
                if "full_graphs" in line or "_full." in line:
                    bad.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not bad, "\n".join(bad)
