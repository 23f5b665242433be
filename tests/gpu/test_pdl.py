"""Programmatic dependent launch (`modeling.ops.pdl`): early by default on sm_90+, modes 0 and 1 on request
(`KernelOptions.pdl`, bound into `KernelOps` by `get_kernel_ops`), and a long chain of dependent PDL kernels replayed
from a CUDA graph gives bitwise the results of the same chain launched without PDL (a kernel reading its
predecessor's output before `gdc_wait` would race and differ), the decode attention's loads before its wait
and the MoE block's router, top-k and routed-expert kernels included."""
import pytest
import torch

pytest.importorskip("triton", reason="needs triton (GPU kernels)")

from modeling.ops import pdl  # noqa: E402
from modeling.ops.triton_decode import decode_attention
from modeling.ops.triton_fused import add_rms_norm, rms_norm, silu_and_mul
from modeling.ops.triton_gemm import linear, linear_add_rms_norm, norm_linear
from modeling.ops.triton_rope import qk_norm_rope_store

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
    for opts in (KernelOptions(), KernelOptions(pdl="0", gemv=False, decode_single_launch=False, decode_prefetch=False),
                 KernelOptions(pdl="1")):
        ops = get_kernel_ops(dev, "triton", opts)
        mode = pdl.pdl_mode(dev, opts.pdl)
        assert ops.options == opts and ops.prologue_norm_max_tokens == (2 if opts.gemv else 0)
        assert ops.linear.keywords == {"pdl": mode, "gemv": opts.gemv_max_rows()}
        assert ops.decode_attention.keywords == {"pdl": mode, "single_launch": opts.decode_single_launch,
                                                 "prefetch": opts.decode_prefetch}
        assert ops.rms_norm.keywords == {"pdl": mode}
        assert ops.moe_packed.keywords == {"pdl": mode}
        assert ops.moe_routed.keywords == {"pairs_max": opts.moe_pairs_max, "pdl": mode}


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


def _store_then_attend(layers, q_raw, k_raw, v_raw, weights, cos, sin, pos, slots, tables, lens, pdl_mode, prefetch):
    """Per layer, as a decode step runs them: the fused q/k norm + rotary + KV store of the step's token, then the
    split-KV decode attention over its own cache (which the store just wrote at kv_len - 1); returns every
    layer's attention output."""
    outs = []
    for kc, vc in layers:
        q = qk_norm_rope_store(q_raw, k_raw, v_raw, weights, weights, cos, sin, pos, 1e-6, kc, vc, slots,
                               pdl=pdl_mode)
        outs.append(decode_attention(q, kc, vc, tables, lens, 0.088, prefetch=prefetch, pdl=pdl_mode))
    return torch.stack(outs)


@pytest.mark.parametrize("mode", ["1", "early"])
def test_decode_attention_loading_before_its_wait_sees_the_new_token(mode):
    """The attention loads its lengths, tables and first KV tiles before its PDL wait. In a graph after the kernel
    that stores the step's token, it must still read that token's K and V (not the stale rows, refilled with noise
    before every replay) and give the bits of the chain without PDL and without the early loads."""
    code = pdl.pdl_mode(torch.device("cuda", 0), mode)
    if not code:
        pytest.skip("PDL not available on this GPU / Triton")
    g = torch.Generator(device="cuda").manual_seed(11)
    bf, hq, hkv, d, page, width, batch = torch.bfloat16, 16, 8, 128, 64, 80, 3  # up to 5120 tokens
    layers = [(torch.randn(batch * width + 1, page, hkv, d, generator=g, device="cuda").to(bf),
               torch.randn(batch * width + 1, page, hkv, d, generator=g, device="cuda").to(bf)) for _ in range(4)]
    tables = (torch.randperm(batch * width, generator=g, device="cuda") + 1).to(torch.int32).view(batch, width)
    q_raw = torch.randn(batch, hq, d, generator=g, device="cuda").to(bf)
    k_raw = torch.randn(batch, hkv, d, generator=g, device="cuda").to(bf)
    v_raw = torch.randn(batch, hkv, d, generator=g, device="cuda").to(bf)
    weights = (torch.rand(d, generator=g, device="cuda") + 0.5).to(bf)
    cos = torch.rand(width * page, d, generator=g, device="cuda")
    sin = torch.rand(width * page, d, generator=g, device="cuda")
    lens = torch.empty(batch, dtype=torch.int32, device="cuda")
    pos = torch.empty(batch, dtype=torch.int64, device="cuda")
    slots = torch.empty_like(pos)

    def set_lengths(kv_lens):  # the new token at kv_len - 1; its cache rows refilled with noise first
        lens.copy_(torch.tensor(kv_lens, dtype=torch.int32))
        p = lens.long() - 1
        pos.copy_(p)
        slots.copy_(tables.long().gather(1, (p // page)[:, None])[:, 0] * page + p % page)
        for kc, vc in layers:
            kc.view(-1, hkv, d)[slots] = torch.randn(batch, hkv, d, generator=g, device="cuda").to(bf)
            vc.view(-1, hkv, d)[slots] = torch.randn(batch, hkv, d, generator=g, device="cuda").to(bf)

    args = (layers, q_raw, k_raw, v_raw, weights, cos, sin, pos, slots, tables, lens)
    set_lengths([width * page, 1, 700])
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        _store_then_attend(*args, code, True)  # compiles the PDL variants outside the capture
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        got = _store_then_attend(*args, code, True)
    # tiles ending right before the new token, the new token first in its tile, one page, 33 tiles, 2 tokens
    for kv_lens in ([128 + 1, 64, 2050], [65, 4097, 2], [width * page, 63, 1000], [130, 129, 2561]):
        set_lengths(kv_lens)
        torch.cuda.synchronize()
        graph.replay()
        torch.cuda.synchronize()
        set_lengths(kv_lens)  # fresh noise in the new token's rows for the plain chain too (its store overwrites it)
        want = _store_then_attend(*args, 0, False)
        torch.cuda.synchronize()
        assert torch.equal(got, want), kv_lens


def _moe_chain(x, gate_w, w13, w2, norm_w, layers, pdl_mode):
    """`layers` MoE blocks as a decode step runs them: the router on the GEMV (or cuBLAS past its rows), the
    one-launch top-k, the routed experts (grouping, grouped GEMMs, combine), then the residual add + RMSNorm."""
    from modeling.ops.triton_gemm import router_linear
    from modeling.ops.triton_moe import routed_experts
    from modeling.ops.triton_router import route_topk

    h, res = x, torch.zeros_like(x)
    for _ in range(layers):
        weights, ids = route_topk(router_linear(h, gate_w, pdl=pdl_mode), 4, True, pdl=pdl_mode)
        y = routed_experts(h, ids, weights, w13, w2, pdl=pdl_mode)
        h, res = add_rms_norm(y, res, norm_w, 1e-6, pdl=pdl_mode)
    return h, res


@pytest.mark.parametrize("mode", ["1", "early"])
@pytest.mark.parametrize("m", [1, 2, 8, 64])
def test_moe_chain_in_a_graph_equals_the_chain_without_pdl(m, mode):
    """The routed-expert kernels under PDL (`KernelOptions.moe_pdl`) wait before every load: replayed from a graph
    with new inputs, a 12-layer chain of router GEMV, top-k, grouping (two launches at 64 tokens x top-4), grouped
    GEMMs and combine gives the bits of the same chain without PDL."""
    code = pdl.pdl_mode(torch.device("cuda", 0), mode)
    if not code:
        pytest.skip("PDL not available on this GPU / Triton")
    g = torch.Generator(device="cuda").manual_seed(13)
    hid, inter, experts, bf = 512, 256, 32, torch.bfloat16
    gate_w = (torch.randn(experts, hid, generator=g, device="cuda") / 8).to(bf)
    w13 = (torch.randn(experts, 2 * inter, hid, generator=g, device="cuda") / 22).to(bf)
    w2 = (torch.randn(experts, hid, inter, generator=g, device="cuda") / 16).to(bf)
    norm_w = (torch.rand(hid, generator=g, device="cuda") + 0.5).to(bf)
    x = torch.randn(m, hid, generator=g, device="cuda").to(bf)

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        _moe_chain(x, gate_w, w13, w2, norm_w, 12, code)  # compiles the PDL variants outside the capture
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        got = _moe_chain(x, gate_w, w13, w2, norm_w, 12, code)
    for _ in range(4):
        x.copy_(torch.randn(m, hid, generator=g, device="cuda").to(bf))
        graph.replay()
        torch.cuda.synchronize()
        want = _moe_chain(x, gate_w, w13, w2, norm_w, 12, 0)
        torch.cuda.synchronize()
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
