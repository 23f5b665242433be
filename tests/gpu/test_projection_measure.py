"""The warm-up choice of the decode projection fallbacks on a GPU (`modeling/ops/triton_gemm_measure.py`): every
untabled (N, K) x row class gets the faster of cuBLAS and the safe config, `linear` then follows it (and still equals
F.linear, also inside a graph), the choice is written to the disk cache and a fresh process state takes it from
there without measuring, nothing is chosen twice or inside a capture, and `KernelOptions.measure_projections=False`
turns it off."""
import json

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu

SHAPES = [(3072, 1024), (1024, 1536), (6144, 2048), (200000, 1024)]  # untabled; the last is wider than the GEMV


@pytest.fixture(autouse=True)
def _own_fallbacks(monkeypatch):
    from modeling.ops import projection_choice as pc

    monkeypatch.setattr(pc, "_FALLBACKS", {})  # neither sees nor leaves another test's choices


def _wanted(shapes, gemv=2):
    from modeling.ops.projection_choice import MEASURED_CLASSES

    return {(n, k, mc) for n, k in shapes for mc in MEASURED_CLASSES if mc > gemv or n > 32768}


def test_measurement_records_every_untabled_shape_caches_it_and_linear_follows_it(tmp_path, monkeypatch):
    from modeling.ops import projection_choice as pc
    from modeling.ops import triton_gemm_measure as tgm
    from modeling.ops.triton_gemm import config_for, linear

    dev = torch.device("cuda", torch.cuda.current_device())
    path = tmp_path / "choice.json"
    done = tgm.measure_projection_fallbacks(SHAPES + [(4096, 1024)], dev, cache_path=path)  # (4096, 1024): tabled
    want = _wanted(SHAPES)
    assert set(done) == want
    assert all(c.source == "measured" and c.kernel in ("cublas", "skinny") for c in done.values())
    assert tgm.measure_projection_fallbacks(SHAPES, dev, cache_path=path) == {}  # chosen once per device
    assert set(pc.fallbacks()) == {(dev.index, *key) for key in want}
    entries = json.loads(path.read_text())["entries"]
    assert len(entries) == len(want) and all(e["cublas_us"] > 0 and e["safe_us"] > 0 for e in entries.values())
    for (n, k, mc), choice in done.items():
        cfg = config_for(n, k, mc, dev)
        assert (cfg is None) == (choice.kernel == "cublas")
        x = torch.randn(mc, k, device="cuda").bfloat16()
        w = (torch.randn(n, k, device="cuda") / k ** 0.5).bfloat16()
        torch.testing.assert_close(linear(x, w).float(), F.linear(x, w).float(), atol=2e-2, rtol=2e-2)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = linear(x, w)
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.testing.assert_close(y.float(), F.linear(x, w).float(), atol=2e-2, rtol=2e-2)

    pc.clear_fallbacks()  # a new process: the cache answers, nothing is timed
    monkeypatch.setattr(tgm, "time_candidates", lambda *a, **k: pytest.fail("measured a cached shape"))
    again = tgm.measure_projection_fallbacks(SHAPES, dev, cache_path=path)
    assert {key: c.kernel for key, c in again.items()} == {key: c.kernel for key, c in done.items()}
    assert all(c.source == "cached" for c in again.values())


def test_the_row_class_of_one_is_measured_where_the_gemv_is_off(tmp_path):
    from modeling.ops.triton_gemm_measure import measure_projection_fallbacks

    dev = torch.device("cuda", torch.cuda.current_device())
    done = measure_projection_fallbacks(SHAPES[:1], dev, gemv=0, cache_path=tmp_path / "c.json")
    assert set(done) == _wanted(SHAPES[:1], gemv=0)


def test_measurement_refuses_a_capture_and_the_option_turns_it_off(tmp_path):
    from modeling.ops import get_kernel_ops
    from modeling.ops import projection_choice as pc
    from modeling.ops.options import KernelOptions
    from modeling.ops.pdl import pdl_mode
    from modeling.ops.triton_gemm_measure import ProjectionMeasureError, measure_projection_fallbacks

    dev = torch.device("cuda", torch.cuda.current_device())
    off = get_kernel_ops(dev, "triton", KernelOptions(measure_projections=False))
    assert off.measure_projections(SHAPES, dev, torch.bfloat16) == {} and pc.fallbacks() == {}
    on = get_kernel_ops(dev, "triton", KernelOptions(gemv=False))
    assert on.measure_projections.func is measure_projection_fallbacks
    assert on.measure_projections.keywords == {"gemv": 0, "pdl": pdl_mode(dev, "early")}
    assert measure_projection_fallbacks(SHAPES, dev, dtype=torch.float32, cache_path=tmp_path / "c.json") == {}
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(ProjectionMeasureError):
        with torch.cuda.graph(graph):
            measure_projection_fallbacks(SHAPES, dev, cache_path=tmp_path / "c.json")
    assert pc.fallbacks() == {}


def test_fused_forms_are_measured_with_their_epilogue_and_the_fused_operator_follows(tmp_path):
    """A projection the model runs with its residual add + RMSNorm fused (and down with the SiLU-gate before it) is
    timed in that form up to FUSED_NORM_MAX_M rows and as the bare (gated) GEMM past it; each form has its own cache
    entry, and `linear_add_rms_norm` then equals the unfused operators whichever kernel was chosen."""
    from modeling.ops import triton_gemm_measure as tgm
    from modeling.ops.triton_fused import add_rms_norm, silu_and_mul
    from modeling.ops.triton_gemm import linear_add_rms_norm

    dev = torch.device("cuda", torch.cuda.current_device())
    path = tmp_path / "choice.json"
    forms = {(3072, 1024): "add_norm", (1536, 2560): "gated_add_norm"}
    done = tgm.measure_projection_fallbacks(list(forms), dev, gemv=0, cache_path=path, forms=forms)
    assert set(done) == _wanted(forms, gemv=0)
    entries = json.loads(path.read_text())["entries"]
    want_forms = {(n, k, mc): tgm.measured_form(forms[(n, k)], n, mc) for n, k, mc in done}
    assert want_forms[(3072, 1024, 4)] == "add_norm" and want_forms[(3072, 1024, 16)] == "plain"
    assert want_forms[(1536, 2560, 1)] == "gated_add_norm" and want_forms[(1536, 2560, 16)] == "gated"
    assert sorted(e["form"] for e in entries.values()) == sorted(want_forms.values())
    assert all(e["cublas_us"] > 0 and e["safe_us"] > 0 for e in entries.values())
    for (n, k), form in forms.items():
        gated = form.startswith("gated")
        for m in (1, 3, 8):
            x = torch.randn(m, 2 * k if gated else k, device="cuda").bfloat16()
            w = (torch.randn(n, k, device="cuda") / k ** 0.5).bfloat16()
            res = torch.randn(m, n, device="cuda").bfloat16()
            nw = (torch.rand(n, device="cuda") + 0.5).bfloat16()
            normed, summed = linear_add_rms_norm(x, w, res, nw, 1e-6, gated=gated)
            ref_n, ref_s = add_rms_norm(F.linear(silu_and_mul(x) if gated else x, w), res, nw, 1e-6)
            torch.testing.assert_close(summed.float(), ref_s.float(), atol=3e-2, rtol=2e-2)
            torch.testing.assert_close(normed.float(), ref_n.float(), atol=6e-2, rtol=3e-2)
