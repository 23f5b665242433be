"""Programmatic dependent launch (`modeling.ops.pdl`): early by default on sm_90+, modes 0 and 1 on request, and a long chain
of dependent PDL kernels replayed from a CUDA graph gives bitwise the results of the same chain launched without
PDL (a kernel reading its predecessor's output before `gdc_wait` would race and differ)."""
import pytest
import torch

pytest.importorskip("triton", reason="needs triton (GPU kernels)")

from modeling.ops import pdl  # noqa: E402
from modeling.ops.triton_fused import add_rms_norm, rms_norm, silu_and_mul
from modeling.ops.triton_gemm import linear, linear_add_rms_norm, norm_linear

pytestmark = pytest.mark.gpu


def test_pdl_switch(monkeypatch):
    dev = torch.device("cuda", 0)
    supported = torch.cuda.get_device_capability(0)[0] >= 9 and pdl._triton_has_pdl()
    monkeypatch.delenv(pdl.PDL_ENV, raising=False)
    assert pdl.pdl_launch(dev) == ({"PDL": 2, "launch_pdl": True} if supported else {"PDL": 0})
    monkeypatch.setenv(pdl.PDL_ENV, "0")
    assert pdl.pdl_launch(dev) == {"PDL": 0}
    for raw, mode in (("1", 1), ("early", 2)):
        monkeypatch.setenv(pdl.PDL_ENV, raw)
        assert pdl.pdl_mode(dev) == (mode if supported else 0)
        assert pdl.pdl_launch(dev) == ({"PDL": mode, "launch_pdl": True} if supported else {"PDL": 0})
    monkeypatch.setenv(pdl.PDL_ENV, "yes")
    with pytest.raises(ValueError, match="GRAPHLINE_PDL"):
        pdl.pdl_enabled(dev)
    monkeypatch.setenv(pdl.PDL_ENV, "1")
    assert not pdl.pdl_enabled(torch.device("cpu"))


def _chain(x, ws, norm_w, steps):
    """`steps` layers of dependent decode-path kernels: GEMM + add/RMSNorm epilogue, SiLU-gate, GEMMs, norms, and
    the GEMV with its add/RMSNorm prologue and SiLU-gate epilogue (`linear` itself is the GEMV at 1-2 rows)."""
    h = x
    res = torch.zeros_like(x)
    for i in range(steps):
        normed, res = linear_add_rms_norm(h, ws["o"], res, norm_w, 1e-6)  # fused epilogue
        up = linear(normed, ws["gate_up"])
        act = silu_and_mul(up)
        y = linear(act, ws["down"])
        h, res = add_rms_norm(y, res, norm_w, 1e-6)
        h = rms_norm(h, norm_w, 1e-6)
        act, res = norm_linear(h, res, norm_w, 1e-6, ws["gate_up"], gated=True)
        h = linear(act, ws["down"])
    return h, res


@pytest.mark.parametrize("mode", ["1", "early"])
@pytest.mark.parametrize("m", [1, 2, 4])
def test_pdl_chain_in_a_graph_equals_the_chain_without_pdl(monkeypatch, m, mode):
    monkeypatch.setenv(pdl.PDL_ENV, mode)
    if not pdl.pdl_enabled(torch.device("cuda", 0)):
        pytest.skip("PDL not available on this GPU / Triton")
    g = torch.Generator(device="cuda").manual_seed(7)
    hid, inter = 1024, 3072
    bf = torch.bfloat16
    ws = {"o": (torch.randn(hid, hid, generator=g, device="cuda") / 32).to(bf),
          "gate_up": (torch.randn(2 * inter, hid, generator=g, device="cuda") / 32).to(bf),
          "down": (torch.randn(hid, inter, generator=g, device="cuda") / 55).to(bf)}
    norm_w = (torch.rand(hid, generator=g, device="cuda") + 0.5).to(bf)
    x = torch.randn(m, hid, generator=g, device="cuda").to(bf)

    monkeypatch.setenv(pdl.PDL_ENV, "0")
    want = _chain(x, ws, norm_w, 24)
    torch.cuda.synchronize()

    monkeypatch.setenv(pdl.PDL_ENV, mode)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        _chain(x, ws, norm_w, 24)  # warm-up: compiles the PDL variants outside the capture
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        got = _chain(x, ws, norm_w, 24)
    for _ in range(20):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
