"""Triton fused elementwise kernels (`modeling.ops.triton_fused`) against the torch reference
(`modeling.ops.fused_ref`): values, strided views, one launch per call, CUDA-graph capture + replay.

GPU only (marker `gpu`); collection is safe without CUDA or Triton.
"""
from __future__ import annotations

import itertools

import pytest
import torch

from modeling.ops import fused_ref as ref

try:
    from modeling.ops import triton_fused as tri
except Exception:  # no triton (or no usable driver) on this machine: every test here is skipped by its marker
    tri = None

pytestmark = pytest.mark.gpu

DEV = "cuda"
EPS = 1e-6
MAX_POS = 40960
TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=1e-2, rtol=1e-2),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}
DTYPES = [torch.bfloat16, torch.float32]
TOKENS = [1, 7, 256, 3000]
HIDDEN = [1024, 4096]
HEAD_DIMS = [64, 128]
HEADS = [(16, 8), (32, 4)]


def _close(out: torch.Tensor, expected: torch.Tensor) -> None:
    assert out.shape == expected.shape, (out.shape, expected.shape)
    assert out.dtype == expected.dtype, (out.dtype, expected.dtype)
    torch.testing.assert_close(out.float(), expected.float(), **TOL[expected.dtype])


def _weight(n: int, dtype: torch.dtype) -> torch.Tensor:
    return (1.0 + 0.1 * torch.randn(n, device=DEV)).to(dtype)


def _rope_tables(d: int) -> tuple[torch.Tensor, torch.Tensor]:
    from modeling.layers import RotaryEmbedding  # the model's own table construction

    rope = RotaryEmbedding(d, MAX_POS, 1_000_000.0, device=DEV)
    return rope.cos, rope.sin


def _qkv_views(t: int, hq: int, hkv: int, d: int, dtype: torch.dtype):
    """q `[t, hq, d]` and k `[t, hkv, d]` as column-slice views of one fused qkv projection output."""
    qkv = (2.0 * torch.randn(t, (hq + 2 * hkv) * d, device=DEV)).to(dtype)
    q, k, _ = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    return qkv, q.view(t, hq, d), k.view(t, hkv, d)


def _kernel_launches(fn) -> list[str]:
    """Names of the GPU kernels one eager call of `fn` launches."""
    from torch.profiler import ProfilerActivity, profile

    fn()  # compile outside the profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def _graph_matches_eager(make_inputs, fn) -> None:
    """Capture fn on static inputs, refill them with new values, replay: the graph's outputs equal eager's."""
    static = make_inputs()
    fn(*static)  # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = fn(*static)
    outs = outs if isinstance(outs, tuple) else (outs,)
    for _ in range(2):
        for dst, src in zip(static, make_inputs()):
            if isinstance(dst, torch.Tensor):
                dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        eager = fn(*static)
        eager = eager if isinstance(eager, tuple) else (eager,)
        for o, e in zip(outs, eager):
            torch.testing.assert_close(o, e, atol=0, rtol=0)


# ------------------------------------------------------------------------------------------------ rms_norm


@pytest.mark.parametrize("t,h,dtype", list(itertools.product(TOKENS, HIDDEN, DTYPES)))
def test_rms_norm(t: int, h: int, dtype: torch.dtype) -> None:
    torch.manual_seed(t * 7 + h)
    x = torch.randn(t, h, device=DEV).to(dtype)
    w = _weight(h, dtype)
    x0 = x.clone()
    out = tri.rms_norm(x, w, EPS)
    _close(out, ref.rms_norm(x, w, EPS))
    assert out.is_contiguous() and torch.equal(x, x0)


@pytest.mark.parametrize("t,d,heads,dtype", list(itertools.product(TOKENS, HEAD_DIMS, [16, 4], DTYPES)))
def test_rms_norm_heads(t: int, d: int, heads: int, dtype: torch.dtype) -> None:
    """3-D `[T, heads, D]` (per-head norm), contiguous and as a strided view of a wider tensor."""
    torch.manual_seed(t + d + heads)
    w = _weight(d, dtype)
    x = torch.randn(t, heads, d, device=DEV).to(dtype)
    _close(tri.rms_norm(x, w, EPS), ref.rms_norm(x, w, EPS))
    wide = torch.randn(t, (heads + 3) * d, device=DEV).to(dtype)
    view = wide[:, d:(heads + 1) * d].view(t, heads, d)
    out = tri.rms_norm(view, w, EPS)
    _close(out, ref.rms_norm(view, w, EPS))
    assert out.is_contiguous()


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_strided_rows_and_big_hidden(dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    wide = torch.randn(33, 3 * 4096, device=DEV).to(dtype)
    x = wide[:, 4096:8192]
    w = _weight(4096, dtype)
    _close(tri.rms_norm(x, w, EPS), ref.rms_norm(x, w, EPS))
    x = torch.randn(5, 8192, device=DEV).to(dtype)
    w = _weight(8192, dtype)
    _close(tri.rms_norm(x, w, EPS), ref.rms_norm(x, w, EPS))
    x = torch.randn(3, 5, 2, 128, device=DEV).to(dtype)  # >3-D leading dims are flattened
    w = _weight(128, dtype)
    _close(tri.rms_norm(x, w, EPS), ref.rms_norm(x, w, EPS))


# -------------------------------------------------------------------------------------------- add_rms_norm


@pytest.mark.parametrize("t,h,dtype", list(itertools.product(TOKENS, HIDDEN, DTYPES)))
def test_add_rms_norm(t: int, h: int, dtype: torch.dtype) -> None:
    torch.manual_seed(t * 5 + h)
    x = torch.randn(t, h, device=DEV).to(dtype)
    r = torch.randn(t, h, device=DEV).to(dtype)
    w = _weight(h, dtype)
    x0, r0 = x.clone(), r.clone()
    out, s = tri.add_rms_norm(x, r, w, EPS)
    eo, es = ref.add_rms_norm(x, r, w, EPS)
    _close(out, eo)
    torch.testing.assert_close(s, es, atol=0, rtol=0)  # one rounding of x + r: exact
    assert torch.equal(x, x0) and torch.equal(r, r0), "inputs must not be modified"
    assert s.data_ptr() not in (x.data_ptr(), r.data_ptr()) and out.data_ptr() != s.data_ptr()


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_strided(dtype: torch.dtype) -> None:
    torch.manual_seed(2)
    wide = torch.randn(17, 2 * 1024, device=DEV).to(dtype)
    x, r = wide[:, :1024], wide[:, 1024:]
    w = _weight(1024, dtype)
    out, s = tri.add_rms_norm(x, r, w, EPS)
    eo, es = ref.add_rms_norm(x, r, w, EPS)
    _close(out, eo)
    _close(s, es)


# -------------------------------------------------------------------------------------------- qk_norm_rope


def _check_qk(t: int, d: int, hq: int, hkv: int, dtype: torch.dtype, seed: int) -> None:
    torch.manual_seed(seed)
    cos, sin = _rope_tables(d)
    qkv, q, k = _qkv_views(t, hq, hkv, d, dtype)
    assert t == 1 or not (q.is_contiguous() or k.is_contiguous())
    qw, kw = _weight(d, dtype), _weight(d, dtype)
    pos = torch.randint(0, 40000, (t,), device=DEV, dtype=torch.int64)
    qkv0 = qkv.clone()
    oq, ok = tri.qk_norm_rope(q, k, qw, kw, cos, sin, pos, EPS)
    eq, ek = ref.qk_norm_rope(q, k, qw, kw, cos, sin, pos, EPS)
    _close(oq, eq)
    _close(ok, ek)
    assert oq.is_contiguous() and ok.is_contiguous()
    assert torch.equal(qkv, qkv0), "inputs must not be modified"
    # contiguous copies give the same answer as the strided views
    cq, ck = tri.qk_norm_rope(q.contiguous(), k.contiguous(), qw, kw, cos, sin, pos, EPS)
    torch.testing.assert_close(cq, oq, atol=0, rtol=0)
    torch.testing.assert_close(ck, ok, atol=0, rtol=0)


@pytest.mark.parametrize("t,d,heads,dtype", list(itertools.product(TOKENS, HEAD_DIMS, HEADS, DTYPES)))
def test_qk_norm_rope(t: int, d: int, heads: tuple[int, int], dtype: torch.dtype) -> None:
    _check_qk(t, d, heads[0], heads[1], dtype, seed=t + d + heads[0])


def test_qk_norm_rope_positions_edges() -> None:
    """Position 0 (identity rotation) and the last table row."""
    torch.manual_seed(3)
    d, hq, hkv, dtype = 128, 16, 8, torch.float32
    cos, sin = _rope_tables(d)
    _, q, k = _qkv_views(4, hq, hkv, d, dtype)
    qw, kw = _weight(d, dtype), _weight(d, dtype)
    pos = torch.tensor([0, MAX_POS - 1, 0, 1], device=DEV, dtype=torch.int64)
    oq, ok = tri.qk_norm_rope(q, k, qw, kw, cos, sin, pos, EPS)
    eq, ek = ref.qk_norm_rope(q, k, qw, kw, cos, sin, pos, EPS)
    _close(oq, eq)
    _close(ok, ek)
    _close(oq[0], ref.rms_norm(q[0], qw, EPS))


# -------------------------------------------------------------------------------------- qk_norm_rope_store

PAGE = 64  # Qwen3-0.6B serving shapes: Hq 16, Hkv 8, D 128, bf16
QWEN3_06B = dict(hq=16, hkv=8, d=128, dtype=torch.bfloat16)


def _store_case(t: int, n: int, hq: int, hkv: int, d: int, dtype: torch.dtype, seed: int,
                slot_dtype: torch.dtype = torch.int64, cache_dtype: torch.dtype | None = None):
    """Raw strided q/k/v views of one qkv output, weights, tables, positions, `n` distinct slots (every third
    one -1) and non-zero caches (rows that must stay untouched are visible)."""
    torch.manual_seed(seed)
    cos, sin = _rope_tables(d)
    width = (hq + 2 * hkv) * d
    qkv = (2.0 * torch.randn(t, width, device=DEV)).to(dtype)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    qw, kw = _weight(d, dtype), _weight(d, dtype)
    pos = torch.randint(0, 40000, (t,), device=DEV, dtype=torch.int64)
    pages = max(4, 2 * (n // PAGE + 1))
    slots = torch.randperm(pages * PAGE, device=DEV)[:n]
    slots[1::3] = -1
    slots = slots.to(slot_dtype)
    cdt = cache_dtype or dtype
    kc = torch.randn(pages, PAGE, hkv, d, device=DEV).to(cdt)
    vc = torch.randn(pages, PAGE, hkv, d, device=DEV).to(cdt)
    return qkv, q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, d), qw, kw, cos, sin, pos, slots, kc, vc


def _run_store(case) -> torch.Tensor:
    """qk_norm_rope_store on a `_store_case` tuple (writes its caches)."""
    _, q, k, v, qw, kw, cos, sin, pos, slots, kc, vc = case
    return tri.qk_norm_rope_store(q, k, v, qw, kw, cos, sin, pos, EPS, kc, vc, slots)


def _check_store(t: int, n: int, hq: int, hkv: int, d: int, dtype: torch.dtype, seed: int, **kw) -> None:
    from modeling.ops import triton_store

    qkv, q, k, v, qw, kw_, cos, sin, pos, slots, kc0, vc0 = _store_case(t, n, hq, hkv, d, dtype, seed, **kw)
    qkv0 = qkv.clone()
    kc, vc = kc0.clone(), vc0.clone()
    out = tri.qk_norm_rope_store(q, k, v, qw, kw_, cos, sin, pos, EPS, kc, vc, slots)
    # unfused Triton: bitwise the same q, caches and untouched rows
    uq, uk = tri.qk_norm_rope(q, k, qw, kw_, cos, sin, pos, EPS)
    ukc, uvc = kc0.clone(), vc0.clone()
    triton_store.store_kv(uk, v, ukc, uvc, slots)
    torch.cuda.synchronize()
    assert out.shape == (t, hq, d) and out.is_contiguous() and out.dtype == uq.dtype
    torch.testing.assert_close(out, uq, atol=0, rtol=0)
    torch.testing.assert_close(kc, ukc, atol=0, rtol=0)
    torch.testing.assert_close(vc, uvc, atol=0, rtol=0)
    assert torch.equal(qkv, qkv0), "inputs must not be modified"
    stored = slots[slots >= 0].long()
    keep = torch.ones(kc.shape[0] * PAGE, dtype=torch.bool, device=DEV)
    keep[stored] = False
    flat = lambda c: c.view(-1, hkv, d)  # noqa: E731
    assert torch.equal(flat(kc)[keep], flat(kc0)[keep]) and torch.equal(flat(vc)[keep], flat(vc0)[keep])
    # and close to the torch reference (qk_norm_rope then attention_ref.store_kv)
    rkc, rvc = kc0.clone(), vc0.clone()
    rq = ref.qk_norm_rope_store(q, k, v, qw, kw_, cos, sin, pos, EPS, rkc, rvc, slots.long())
    _close(out, rq)
    _close(kc, rkc)
    torch.testing.assert_close(vc, rvc, atol=0, rtol=0)


@pytest.mark.parametrize("t,n", [(1, 1), (7, 7), (7, 5), (64, 64), (64, 50)])
def test_qk_norm_rope_store_equals_unfused_qwen3_06b(t: int, n: int) -> None:
    """Fused == qk_norm_rope + store_kv bitwise (q, both caches); every third slot -1, or fewer slots than rows."""
    _check_store(t, n, **QWEN3_06B, seed=t * 13 + n)


def test_qk_norm_rope_store_single_row_skipped() -> None:
    """T = 1 with slot -1 or no slots: q is still computed, nothing is stored."""
    qkv, q, k, v, qw, kw, cos, sin, pos, _, kc0, vc0 = _store_case(1, 1, **QWEN3_06B, seed=10)
    kc, vc = kc0.clone(), vc0.clone()
    out = tri.qk_norm_rope_store(q, k, v, qw, kw, cos, sin, pos, EPS, kc, vc,
                                 torch.full((1,), -1, device=DEV, dtype=torch.int64))
    torch.testing.assert_close(out, tri.qk_norm_rope(q, k, qw, kw, cos, sin, pos, EPS)[0], atol=0, rtol=0)
    assert torch.equal(kc, kc0) and torch.equal(vc, vc0)
    out = tri.qk_norm_rope_store(q, k, v, qw, kw, cos, sin, pos, EPS, kc, vc,
                                 torch.empty(0, device=DEV, dtype=torch.int64))  # no slots at all
    torch.testing.assert_close(out, tri.qk_norm_rope(q, k, qw, kw, cos, sin, pos, EPS)[0], atol=0, rtol=0)
    assert torch.equal(kc, kc0) and torch.equal(vc, vc0)


@pytest.mark.parametrize("t,d,heads,dtype", list(itertools.product([3, 256], HEAD_DIMS, HEADS, DTYPES)))
def test_qk_norm_rope_store_shapes(t: int, d: int, heads: tuple[int, int], dtype: torch.dtype) -> None:
    _check_store(t, t - 1, heads[0], heads[1], d, dtype, seed=t + d + heads[0], slot_dtype=torch.int32)


def test_qk_norm_rope_store_casts_into_cache_dtype() -> None:
    """fp32 activations into a bf16 cache: k rounded as qk_norm_rope returns it, then cast, like store_kv."""
    _check_store(7, 6, 16, 8, 128, torch.float32, seed=11, cache_dtype=torch.bfloat16)


@pytest.mark.parametrize("t", [1, 7, 64])
def test_qk_norm_rope_store_cuda_graph(t: int) -> None:
    """Captured once on static buffers, replayed with new q/k/v, positions and slots: equals eager unfused."""
    from modeling.ops import triton_store

    static = list(_store_case(t, t, **QWEN3_06B, seed=t))
    qkv, q, k, v, qw, kw, cos, sin, pos, slots, kc, vc = static
    tri.qk_norm_rope_store(q, k, v, qw, kw, cos, sin, pos, EPS, kc, vc, slots)  # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tri.qk_norm_rope_store(q, k, v, qw, kw, cos, sin, pos, EPS, kc, vc, slots)
    for seed in (100 + t, 200 + t):
        fresh = _store_case(t, t, **QWEN3_06B, seed=seed)
        for name in (0, 8, 9, 10, 11):  # qkv, positions, slots, caches
            static[name].copy_(fresh[name])
        ukc, uvc = kc.clone(), vc.clone()
        graph.replay()
        uq, uk = tri.qk_norm_rope(q, k, qw, kw, cos, sin, pos, EPS)
        triton_store.store_kv(uk, v, ukc, uvc, slots)
        torch.cuda.synchronize()
        torch.testing.assert_close(out, uq, atol=0, rtol=0)
        torch.testing.assert_close(kc, ukc, atol=0, rtol=0)
        torch.testing.assert_close(vc, uvc, atol=0, rtol=0)


# -------------------------------------------------------------------------------------------- silu_and_mul


@pytest.mark.parametrize("t,i,dtype", list(itertools.product(TOKENS, [1024, 3072, 4096], DTYPES)))
def test_silu_and_mul(t: int, i: int, dtype: torch.dtype) -> None:
    torch.manual_seed(t * 3 + i)
    x = (3.0 * torch.randn(t, 2 * i, device=DEV)).to(dtype)
    x0 = x.clone()
    _close(tri.silu_and_mul(x), ref.silu_and_mul(x))
    assert torch.equal(x, x0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_strided_and_odd(dtype: torch.dtype) -> None:
    torch.manual_seed(4)
    x = torch.randn(9, 3 * 1536, device=DEV).to(dtype)[:, : 2 * 1536]
    _close(tri.silu_and_mul(x), ref.silu_and_mul(x))
    x = torch.randn(5, 2 * 1000, device=DEV).to(dtype)  # not a multiple of the block
    _close(tri.silu_and_mul(x), ref.silu_and_mul(x))


# ------------------------------------------------------------------------------------------ large token counts


def test_large_token_count() -> None:
    t, dtype = 16384, torch.bfloat16
    torch.manual_seed(5)
    x = torch.randn(t, 4096, device=DEV).to(dtype)
    r = torch.randn(t, 4096, device=DEV).to(dtype)
    w = _weight(4096, dtype)
    _close(tri.rms_norm(x, w, EPS), ref.rms_norm(x, w, EPS))
    out, s = tri.add_rms_norm(x, r, w, EPS)
    eo, es = ref.add_rms_norm(x, r, w, EPS)
    _close(out, eo)
    _close(s, es)
    g = torch.randn(t, 2 * 3072, device=DEV).to(dtype)
    _close(tri.silu_and_mul(g), ref.silu_and_mul(g))
    _check_qk(t, 128, 32, 4, dtype, seed=6)


# ---------------------------------------------------------------------------------- one launch per call


def _single_launch_cases():
    h, t, d, hq, hkv, dtype = 4096, 3, 128, 16, 8, torch.bfloat16
    x = torch.randn(t, h, device=DEV).to(dtype)
    r = torch.randn(t, h, device=DEV).to(dtype)
    w = _weight(h, dtype)
    cos, sin = _rope_tables(d)
    _, q, k = _qkv_views(t, hq, hkv, d, dtype)
    qw, kw = _weight(d, dtype), _weight(d, dtype)
    pos = torch.randint(0, 40000, (t,), device=DEV)
    g = torch.randn(t, 2 * 3072, device=DEV).to(dtype)
    st = _store_case(t, t, hq, hkv, d, dtype, seed=12)
    st64 = _store_case(64, 60, hq, hkv, d, dtype, seed=13)  # the per-token variant
    return {
        "rms_norm": lambda: tri.rms_norm(x, w, EPS),
        "rms_norm_heads": lambda: tri.rms_norm(q, qw, EPS),
        "add_rms_norm": lambda: tri.add_rms_norm(x, r, w, EPS),
        "qk_norm_rope": lambda: tri.qk_norm_rope(q, k, qw, kw, cos, sin, pos, EPS),
        "qk_norm_rope_store": lambda: _run_store(st),
        "qk_norm_rope_store_tokens": lambda: _run_store(st64),
        "silu_and_mul": lambda: tri.silu_and_mul(g),
    }


@pytest.mark.parametrize("name", ["rms_norm", "rms_norm_heads", "add_rms_norm", "qk_norm_rope", "qk_norm_rope_store",
                                  "qk_norm_rope_store_tokens", "silu_and_mul"])
def test_one_kernel_launch(name: str) -> None:
    launches = _kernel_launches(_single_launch_cases()[name])
    assert len(launches) == 1, f"{name} launched {launches}"


# --------------------------------------------------------------------------------------- CUDA graph replay


@pytest.mark.parametrize("t", [1, 7])
def test_rms_norm_cuda_graph(t: int) -> None:
    w = _weight(4096, torch.bfloat16)
    w_head = _weight(128, torch.bfloat16)
    _graph_matches_eager(lambda: (torch.randn(t, 4096, device=DEV).to(torch.bfloat16),),
                         lambda x: tri.rms_norm(x, w, EPS))
    _graph_matches_eager(lambda: (torch.randn(t, 8, 128, device=DEV).to(torch.bfloat16),),
                         lambda x: tri.rms_norm(x, w_head, EPS))


@pytest.mark.parametrize("t", [1, 7])
def test_add_rms_norm_cuda_graph(t: int) -> None:
    w = _weight(2048, torch.bfloat16)

    def inputs():
        return torch.randn(t, 2048, device=DEV).to(torch.bfloat16), torch.randn(t, 2048, device=DEV).to(torch.bfloat16)

    _graph_matches_eager(inputs, lambda x, r: tri.add_rms_norm(x, r, w, EPS))


@pytest.mark.parametrize("t", [1, 7])
def test_qk_norm_rope_cuda_graph(t: int) -> None:
    d, hq, hkv, dtype = 128, 32, 4, torch.bfloat16
    cos, sin = _rope_tables(d)
    qw, kw = _weight(d, dtype), _weight(d, dtype)
    width = (hq + 2 * hkv) * d

    def inputs():
        return ((2.0 * torch.randn(t, width, device=DEV)).to(dtype), torch.randint(0, 40000, (t,), device=DEV))

    def fn(qkv, pos):  # strided q/k views of the static fused buffer, as the model passes them
        q, k, _ = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
        return tri.qk_norm_rope(q.view(t, hq, d), k.view(t, hkv, d), qw, kw, cos, sin, pos, EPS)

    _graph_matches_eager(inputs, fn)


@pytest.mark.parametrize("t", [1, 7])
def test_silu_and_mul_cuda_graph(t: int) -> None:
    _graph_matches_eager(lambda: ((3.0 * torch.randn(t, 2 * 3072, device=DEV)).to(torch.bfloat16),),
                         tri.silu_and_mul)
