"""Programmatic dependent launch (`modeling.ops.pdl`): early by default on sm_90+, modes 0 and 1 on request
(`KernelOptions.pdl`, bound into `KernelOps` by `get_kernel_ops`), and a long chain of dependent PDL kernels replayed
from a CUDA graph gives bitwise the results of the same chain launched without PDL (a kernel reading its
predecessor's output before `gdc_wait` would race and differ)."""
import pytest
import torch

pytest.importorskip("triton", reason="needs triton (GPU kernels)")

from modeling.ops import pdl  # noqa: E402
from modeling.ops.triton_fused import add_rms_norm, rms_norm, silu_and_mul
from modeling.ops.triton_gemm import linear, linear_add_rms_norm, norm_linear

pytestmark = pytest.mark.gpu


def test_pdl_switch():
    dev = torch.device("cuda", 0)
    supported = torch.cuda.get_device_capability(0)[0] >= 9 and pdl._triton_has_pdl()
    assert pdl.pdl_launch(dev) == ({"PDL": 2, "launch_pdl": True} if supported else {"PDL": 0})
    assert pdl.pdl_launch(dev, "0") == {"PDL": 0}
    for raw, mode in (("1", 1), ("early", 2)):
        assert pdl.pdl_mode(dev, raw) == (mode if supported else 0)
        assert pdl.pdl_launch(dev, raw) == ({"PDL": mode, "launch_pdl": True} if supported else {"PDL": 0})
    with pytest.raises(ValueError, match="GRAPHLINE_PDL"):
        pdl.pdl_enabled(dev, "yes")
    assert not pdl.pdl_enabled(torch.device("cpu"), "1")


def test_kernel_ops_bind_the_options_for_this_device():
    from modeling.ops import get_kernel_ops
    from modeling.ops.options import KernelOptions

    dev = torch.device("cuda", 0)
    for opts in (KernelOptions(), KernelOptions(pdl="0", gemv=False, decode_single_launch=False),
                 KernelOptions(pdl="1")):
        ops = get_kernel_ops(dev, "triton", opts)
        mode = pdl.pdl_mode(dev, opts.pdl)
        assert ops.options == opts and ops.prologue_norm_max_tokens == (2 if opts.gemv else 0)
        assert ops.linear.keywords == {"pdl": mode, "gemv": opts.gemv_max_rows()}
        assert ops.decode_attention.keywords == {"pdl": mode, "single_launch": opts.decode_single_launch}
        assert ops.rms_norm.keywords == {"pdl": mode}


def _chain(x, ws, norm_w, steps, pdl_mode=0):
    """`steps` layers of dependent decode-path kernels: GEMM + add/RMSNorm epilogue, SiLU-gate, GEMMs, norms, and
    the GEMV with its add/RMSNorm prologue and SiLU-gate epilogue (`linear` itself is the GEMV at 1-2 rows)."""
    h = x
    res = torch.zeros_like(x)
    for i in range(steps):
        normed, res = linear_add_rms_norm(h, ws["o"], res, norm_w, 1e-6, pdl=pdl_mode)  # fused epilogue
        up = linear(normed, ws["gate_up"], pdl=pdl_mode)
        act = silu_and_mul(up, pdl=pdl_mode)
        y = linear(act, ws["down"], pdl=pdl_mode)
        h, res = add_rms_norm(y, res, norm_w, 1e-6, pdl=pdl_mode)
        h = rms_norm(h, norm_w, 1e-6, pdl=pdl_mode)
        act, res = norm_linear(h, res, norm_w, 1e-6, ws["gate_up"], gated=True, pdl=pdl_mode)
        h = linear(act, ws["down"], pdl=pdl_mode)
    return h, res


@pytest.mark.parametrize("mode", ["1", "early"])
@pytest.mark.parametrize("m", [1, 2, 4])
def test_pdl_chain_in_a_graph_equals_the_chain_without_pdl(m, mode):
    code = pdl.pdl_mode(torch.device("cuda", 0), mode)
    if not code:
        pytest.skip("PDL not available on this GPU / Triton")
    g = torch.Generator(device="cuda").manual_seed(7)
    hid, inter = 1024, 3072
    bf = torch.bfloat16
    ws = {"o": (torch.randn(hid, hid, generator=g, device="cuda") / 32).to(bf),
          "gate_up": (torch.randn(2 * inter, hid, generator=g, device="cuda") / 32).to(bf),
          "down": (torch.randn(hid, inter, generator=g, device="cuda") / 55).to(bf)}
    norm_w = (torch.rand(hid, generator=g, device="cuda") + 0.5).to(bf)
    x = torch.randn(m, hid, generator=g, device="cuda").to(bf)

    want = _chain(x, ws, norm_w, 24)
    torch.cuda.synchronize()

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        _chain(x, ws, norm_w, 24, code)  # warm-up: compiles the PDL variants outside the capture
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        got = _chain(x, ws, norm_w, 24, code)
    for _ in range(20):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
