"""`qk_norm_rope_store` (q/k norm + rotary fused with the KV store) on CPU.

1. The Triton kernel under the Triton CPU interpreter (TRITON_INTERPRET=1; skipped where triton is
   not installed): bitwise equal to the unfused Triton `qk_norm_rope` + `store_kv` (interpreted the
   same way), close to the torch reference, cache rows that must not be written untouched. Both
   kernel variants (per head: T < 64; per token: T >= 64), fp32 and bf16, int64 and int32 slots,
   slot -1, fewer slots than rows, no slots, a cast into a cache of another dtype. Triton picks
   interpreted functions when it is imported, so the kernels run in one child process started with
   TRITON_INTERPRET=1; this process only compares. The interpreter (triton 3.9) converts fp32 to
   bf16 by truncation, not round-to-nearest-even, so bf16 results are compared with torch at a
   looser tolerance (the fused-vs-unfused comparison stays bitwise: both truncate alike).
2. The torch backend and the attention operator: `KernelOps` wiring, `paged_attention` with a
   `QKPrologue` (raw q/k) equals the old path (normalised q/k, store only), and a piecewise plan
   built on CPU (no-op pieces) binds the prologue item by item: positions as a non-owning view of
   the plan's position_ids input, weights/tables as views of the model's storage, eps a constant.
"""

import pytest
import torch

from modeling.attention import QKPrologue, paged_attention
from modeling.attn_metadata import SequenceSlice, build_step
from modeling.ops import attention_ref, fused_ref, get_kernel_ops
from tests.unit._interpret import run_interpreted

# (name, dtype, cache dtype, T rows, slot count, slot dtype); page 4, Hq 4, Hkv 2, D 32 (GQA group 2)
CASES = [
    ("fp32_head", "float32", "float32", 5, 4, "int64"),
    ("fp32_token", "float32", "float32", 64, 60, "int32"),
    ("bf16_head", "bfloat16", "bfloat16", 7, 7, "int64"),
    ("bf16_token", "bfloat16", "bfloat16", 64, 61, "int64"),
    ("fp32_into_bf16_cache", "float32", "bfloat16", 6, 5, "int64"),
    ("no_slots", "float32", "float32", 3, 0, "int64"),
]

_CHILD = r"""
import json, sys
import torch
from modeling.ops import fused_ref, triton_fused as tri
from modeling.ops.triton_store import store_kv

HQ, HKV, D, PAGE, PAGES, EPS = 4, 2, 32, 4, 40, 1e-6
out = {}
for name, dtype, cache_dtype, t, n, slot_dtype in json.loads(sys.argv[1]):
    dtype, cache_dtype, slot_dtype = getattr(torch, dtype), getattr(torch, cache_dtype), getattr(torch, slot_dtype)
    g = torch.Generator().manual_seed(t * 31 + n)
    qkv = (2.0 * torch.randn(t, (HQ + 2 * HKV) * D, generator=g)).to(dtype)  # q/k/v: strided column views
    q, k, v = qkv.split([HQ * D, HKV * D, HKV * D], dim=-1)
    q, k, v = q.view(t, HQ, D), k.view(t, HKV, D), v.view(t, HKV, D)
    qw, kw = [(1.0 + 0.1 * torch.randn(D, generator=g)).to(dtype) for _ in range(2)]
    inv = 1.0 / (1e6 ** (torch.arange(0, D, 2).float() / D))
    ang = torch.outer(torch.arange(512).float(), inv)
    cos, sin = torch.cat((ang, ang), -1).cos(), torch.cat((ang, ang), -1).sin()
    pos = torch.randint(0, 512, (t,), generator=g)
    slots = torch.randperm(PAGES * PAGE, generator=g)[:n]
    slots[1::5] = -1  # some rows are not stored
    slots = slots.to(slot_dtype)
    kc0 = torch.randn(PAGES, PAGE, HKV, D, generator=g).to(cache_dtype)  # non-zero: untouched rows are visible
    vc0 = torch.randn(PAGES, PAGE, HKV, D, generator=g).to(cache_dtype)
    qkv0 = qkv.clone()

    kc, vc = kc0.clone(), vc0.clone()
    qo = tri.qk_norm_rope_store(q, k, v, qw, kw, cos, sin, pos, EPS, kc, vc, slots)
    uk, uv = kc0.clone(), vc0.clone()
    uq, unk = tri.qk_norm_rope(q, k, qw, kw, cos, sin, pos, EPS)
    store_kv(unk, v, uk, uv, slots)
    rk, rv = kc0.clone(), vc0.clone()
    rq = fused_ref.qk_norm_rope_store(q, k, v, qw, kw, cos, sin, pos, EPS, rk, rv, slots)

    stored = sorted(int(s) for s in slots.tolist() if s >= 0)
    keep = torch.ones(PAGES * PAGE, dtype=torch.bool)
    keep[stored] = False
    flat = lambda c: c.view(PAGES * PAGE, HKV, D)
    rows = [(i, int(s)) for i, s in enumerate(slots.tolist()) if s >= 0]
    out[name] = {
        "q_shape": list(qo.shape), "q_dtype": str(qo.dtype), "q_contiguous": qo.is_contiguous(),
        "q_equal": torch.equal(qo, uq), "k_cache_equal": torch.equal(kc, uk), "v_cache_equal": torch.equal(vc, uv),
        "untouched": torch.equal(flat(kc)[keep], flat(kc0)[keep]) and torch.equal(flat(vc)[keep], flat(vc0)[keep]),
        "stored_rows": len(stored),
        # row i of the normalised k and of v at its slot (same dtype only: torch's cast to bf16 rounds, the
        # interpreter's truncates; with a cast the unfused store_kv above is the yardstick)
        "rows_written": None if cache_dtype != dtype else all(
            torch.equal(flat(kc)[s], unk[i]) and torch.equal(flat(vc)[s], v[i]) for i, s in rows),
        "inputs_unchanged": torch.equal(qkv, qkv0),
        "q_finite": bool(torch.isfinite(qo.float()).all()),
        "ref_q": [rq.float().tolist(), qo.float().tolist()],
        "ref_k": [flat(rk).float()[stored].tolist(), flat(kc).float()[stored].tolist()],
        "ref_v": [flat(rv).float()[stored].tolist(), flat(vc).float()[stored].tolist()],
    }
print("RESULT" + json.dumps(out))
"""


@pytest.fixture(scope="module")
def results() -> dict:
    pytest.importorskip("triton", reason="needs triton (the Triton CPU interpreter runs its kernels)")
    return run_interpreted(_CHILD, CASES)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_interpreted_fused_equals_unfused_bitwise(results, case):
    name, dtype, _, t, n, _ = case
    r = results[name]
    assert r["q_shape"] == [t, 4, 32] and r["q_dtype"] == f"torch.{dtype}" and r["q_contiguous"]
    assert r["q_equal"], "q differs from qk_norm_rope's"
    assert r["k_cache_equal"] and r["v_cache_equal"], "the caches differ from qk_norm_rope + store_kv's"
    assert r["untouched"], "a cache row that must not be written changed"
    assert r["stored_rows"] == sum(1 for i in range(n) if i % 5 != 1)  # slot -1 and rows >= n skipped
    assert r["rows_written"] in (None, True)
    assert r["inputs_unchanged"] and r["q_finite"]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_interpreted_fused_close_to_torch_reference(results, case):
    name, dtype, cache_dtype, *_ = case
    r = results[name]
    # fp32: a few ulp (rsqrt, FMA); bf16: the interpreter truncates each of the ~5 roundings (<= 1 ulp = 2^-7 each)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == "float32" else dict(atol=3e-2, rtol=4e-2)
    cache_tol = tol if cache_dtype == "float32" else dict(atol=3e-2, rtol=4e-2)
    torch.testing.assert_close(torch.tensor(r["ref_q"][1]), torch.tensor(r["ref_q"][0]), **tol)
    torch.testing.assert_close(torch.tensor(r["ref_k"][1]), torch.tensor(r["ref_k"][0]), **cache_tol)
    if dtype == cache_dtype:  # a plain copy
        assert r["ref_v"][1] == r["ref_v"][0]
    else:
        torch.testing.assert_close(torch.tensor(r["ref_v"][1]), torch.tensor(r["ref_v"][0]), **cache_tol)


# ------------------------------------------------------------------------------- torch backend, operator


def test_kernel_ops_wiring():
    ops = get_kernel_ops("cpu")
    assert ops.qk_norm_rope_store is fused_ref.qk_norm_rope_store


def _raw_qkv(t, hq, hkv, d, seed):
    g = torch.Generator().manual_seed(seed)
    qkv = 2.0 * torch.randn(t, (hq + 2 * hkv) * d, generator=g)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    return q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, d), g


def test_reference_equals_qk_norm_rope_then_store_kv():
    hq, hkv, d, t = 4, 2, 16, 6
    q, k, v, g = _raw_qkv(t, hq, hkv, d, 0)
    qw, kw = 1.0 + 0.1 * torch.randn(d, generator=g), 1.0 + 0.1 * torch.randn(d, generator=g)
    cos, sin = torch.randn(64, d, generator=g), torch.randn(64, d, generator=g)
    pos = torch.randint(0, 64, (t,), generator=g)
    slots = torch.tensor([5, -1, 0, 11])  # fewer slots than rows, one skipped
    kc0, vc0 = torch.randn(4, 4, hkv, d, generator=g), torch.randn(4, 4, hkv, d, generator=g)
    kc, vc, ek, ev = kc0.clone(), vc0.clone(), kc0.clone(), vc0.clone()
    out = fused_ref.qk_norm_rope_store(q, k, v, qw, kw, cos, sin, pos, 1e-6, kc, vc, slots)
    eq, nk = fused_ref.qk_norm_rope(q, k, qw, kw, cos, sin, pos, 1e-6)
    attention_ref.store_kv(nk, v, ek, ev, slots)
    assert torch.equal(out, eq) and torch.equal(kc, ek) and torch.equal(vc, ev)
    untouched = [i for i in range(16) if i not in (5, 0, 11)]
    assert torch.equal(kc.view(16, hkv, d)[untouched], kc0.view(16, hkv, d)[untouched])


@pytest.mark.parametrize("decode", [False, True])
def test_paged_attention_prologue_equals_old_path(decode):
    """Raw q/k + QKPrologue == normalised q/k without it (outputs and caches), bucket padding rows included."""
    ops = get_kernel_ops("cpu")
    hq, hkv, d, bs = 4, 2, 16, 4
    if decode:
        slices = [SequenceSlice([3], 5, [1, 2]), SequenceSlice([4], 2, [3])]
    else:
        slices = [SequenceSlice([1, 2, 3], 2, [1, 2]), SequenceSlice([4, 5], 0, [3])]
    _, pos, meta = build_step(slices, bs, "cpu")
    n = meta.num_tokens
    t = n + 3  # bucket padding past the real tokens (positions 0, as a plan's zeroed tail)
    pos = torch.cat([pos, torch.zeros(3, dtype=torch.int64)])
    q, k, v, g = _raw_qkv(t, hq, hkv, d, 1)
    qw, kw = 1.0 + 0.1 * torch.randn(d, generator=g), 1.0 + 0.1 * torch.randn(d, generator=g)
    cos, sin = torch.randn(64, d, generator=g), torch.randn(64, d, generator=g)
    c0 = (torch.randn(5, bs, hkv, d, generator=g), torch.randn(5, bs, hkv, d, generator=g))
    old_caches, new_caches = [tuple(c.clone() for c in c0)], [tuple(c.clone() for c in c0)]
    nq, nk = ops.qk_norm_rope(q, k, qw, kw, cos, sin, pos, 1e-6)
    old = paged_attention(nq, nk, v, old_caches, 0, meta, d ** -0.5, ops)
    new = paged_attention(q, k, v, new_caches, 0, meta, d ** -0.5, ops, QKPrologue(qw, kw, cos, sin, pos, 1e-6))
    assert new.shape == (n, hq, d)
    assert torch.equal(new, old)
    assert torch.equal(new_caches[0][0], old_caches[0][0]) and torch.equal(new_caches[0][1], old_caches[0][1])


def test_piecewise_plan_binds_prologue_item_by_item():
    from graphrunner.bridges import ReusableBridgePool
    from graphrunner.piecewise_builder import _CaptureBuilder
    from graphrunner.plan import EagerStep, _Const, _SeqTemplate, _TensorRef
    from graphrunner.standard import REQUEST_LIFETIME_FRAME_NAMES
    from graphrunner.testing import NoopPiece
    from modeling.attention import _paged_attention_boundary
    from modeling.config import get_preset
    from modeling.kv_cache import KVCacheSpec, PagedKVCache
    from modeling.loader import init_random
    from modeling.qwen3 import Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(get_preset("qwen3-tiny"))
    init_random(model, seed=3)
    cache = PagedKVCache(KVCacheSpec.for_model(model.config, 16, block_size=4), "cpu")
    real_ids, real_pos, meta = build_step([SequenceSlice([5, 9, 13, 2, 77], 0, [1, 2])], 4, "cpu")
    bucket = 8  # plan-owned bucket-length graph inputs, zero tail (as graphrunner.standard makes them)
    ids, pos = torch.zeros(bucket, dtype=torch.int64), torch.zeros(bucket, dtype=torch.int64)
    ids[:5], pos[:5] = real_ids, real_pos
    with torch.inference_mode():
        expected = model(ids, pos, cache.layers, meta)  # bucket-shaped eager
    cache = PagedKVCache(KVCacheSpec.for_model(model.config, 16, block_size=4), "cpu")
    assert model.enable_piecewise_cuda_graph() and model.attn_impl._fn is _paged_attention_boundary
    builder = _CaptureBuilder(device=torch.device("cpu"), stream=None, pool=None,
                              frame={"kv_caches": cache.layers, "attn_metadata": meta, "state_ids": None},
                              request_owned=REQUEST_LIFETIME_FRAME_NAMES, token_capacity=bucket,
                              bridge_pool=ReusableBridgePool(), inputs={"input_ids": ids, "position_ids": pos},
                              guard=True, graph_factory=NoopPiece)
    with torch.inference_mode():
        plan, out = builder.build(lambda: model(ids, pos, cache.layers, meta))
    torch.testing.assert_close(out, expected, atol=0, rtol=0)  # the build materialized the same forward
    attn_steps = [s for s in plan.steps if isinstance(s, EagerStep)]
    assert len(attn_steps) == model.config.num_layers
    layer = model.layers[0].self_attn
    for step in attn_steps:
        prologue = step.args[8]
        assert isinstance(prologue, _SeqTemplate) and prologue.kind is QKPrologue
        qw, kw, cos, sin, positions, eps = prologue.items
        for ref, want in ((qw, None), (kw, None), (cos, layer.rope.cos), (sin, layer.rope.sin), (positions, pos)):
            assert isinstance(ref, _TensorRef)
            if want is not None:  # a non-owning view of the same storage, not the start-up object
                assert ref.tensor is not want and ref.tensor.data_ptr() == want.data_ptr()
        assert isinstance(eps, _Const) and eps.value == model.config.rms_norm_eps
    first = attn_steps[0].args[8].items
    assert first[0].tensor.data_ptr() == layer.q_norm.weight.data_ptr()
    assert first[1].tensor.data_ptr() == layer.k_norm.weight.data_ptr()
    resolved = attn_steps[0].args[8].resolve({}, [])
    assert isinstance(resolved, QKPrologue) and resolved.positions.data_ptr() == pos.data_ptr()
