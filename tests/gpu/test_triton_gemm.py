"""The skinny decode GEMM equals F.linear (bf16 tolerance), is capturable, and its split-K path is
correct, deterministic (bitwise) and leaves its arrival counters at zero."""
import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _no_chosen_fallbacks(monkeypatch):
    """Untabled shapes take the safe config here, whatever an earlier model warm-up in this process chose."""
    from modeling.ops import projection_choice

    monkeypatch.setattr(projection_choice, "_FALLBACKS", {})


def _xw(m: int, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed * 1000003 + m * n + k)
    x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=g) / k ** 0.5).bfloat16()
    return x, w


def _close(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    torch.testing.assert_close(y.float(), F.linear(x.float(), w.float()), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("m", [1, 2, 7, 16, 24, 33, 64])
@pytest.mark.parametrize("n,k", [(4096, 1024), (1024, 2048), (1024, 3072), (6144, 1024), (151936, 1024), (100, 300)])
def test_skinny_gemm_matches_linear(m, n, k):
    from modeling.ops.triton_gemm import linear

    x, w = _xw(m, n, k)
    _close(linear(x, w), x, w)


@pytest.mark.parametrize("split_k", [1, 2, 4, 8])
@pytest.mark.parametrize("m", [1, 5, 16, 24, 48])
@pytest.mark.parametrize("n,k", [(1024, 3072), (1024, 2048)])
def test_split_k_matches_linear_and_is_deterministic(n, k, m, split_k):
    from modeling.ops.triton_gemm import GemmConfig, linear_with_config, split_k_counters

    x, w = _xw(m, n, k)
    cfg = GemmConfig(block_n=16, block_k=128, split_k=split_k, num_warps=4, num_stages=2)
    y1 = linear_with_config(x, w, cfg)
    y2 = linear_with_config(x, w, cfg)
    _close(y1, x, w)
    assert torch.equal(y1, y2), "split-K result differs between two identical calls"
    assert int(split_k_counters(x.device).count_nonzero()) == 0


def test_split_k_uneven_k():
    """K not a multiple of SPLIT_K * BLOCK_K: masked tails, empty trailing splits."""
    from modeling.ops.triton_gemm import GemmConfig, linear_with_config

    x, w = _xw(3, 200, 1000)
    for split_k in (2, 4, 8):
        _close(linear_with_config(x, w, GemmConfig(16, 128, split_k, 4, 2)), x, w)


def test_skinny_gemm_graph_replay():
    from modeling.ops.triton_gemm import linear

    x = torch.randn(4, 1024, device="cuda").bfloat16()
    w = torch.randn(2048, 1024, device="cuda").bfloat16()
    linear(x, w)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = linear(x, w)
    x.copy_(torch.randn_like(x))
    g.replay()
    torch.testing.assert_close(y.float(), F.linear(x, w).float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("split_k", [1, 4, 8])
def test_split_k_graph_replays_with_changing_x(split_k):
    from modeling.ops.triton_gemm import GemmConfig, linear_with_config, split_k_counters

    x, w = _xw(5, 1024, 3072, seed=split_k)
    cfg = GemmConfig(16, 128, split_k, 4, 2)
    linear_with_config(x, w, cfg)  # warm-up before capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = linear_with_config(x, w, cfg)
        y32 = linear_with_config(x, w, cfg, out_dtype=torch.float32)
    for step in range(3):
        x.copy_(torch.randn(x.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(step)))
        g.replay()
        _close(y, x, w)
        _close(y32, x, w)
        first = y32.clone()
        g.replay()
        assert torch.equal(first, y32), "graph replays differ bitwise"
    torch.cuda.synchronize()
    assert int(split_k_counters(x.device).count_nonzero()) == 0


def test_out_dtype_float32():
    from modeling.ops.triton_gemm import linear

    x, w = _xw(3, 1024, 2048)
    y = linear(x, w, out_dtype=torch.float32)
    assert y.dtype == torch.float32 and y.shape == (3, 1024)
    torch.testing.assert_close(y, F.linear(x.float(), w.float()), atol=2e-3, rtol=2e-3)
    x_big = torch.randn(32, 2048, device="cuda").bfloat16()  # F.linear fallback honours out_dtype too
    assert linear(x_big, w, out_dtype=torch.float32).dtype == torch.float32


def test_counters_back_to_zero_after_every_table_shape():
    from modeling.ops.triton_gemm import _CONFIGS, linear, split_k_counters

    for n, k, mc in _CONFIGS:
        x, w = _xw(mc, n, k)
        linear(x, w)
        torch.cuda.synchronize()
        assert int(split_k_counters(x.device).count_nonzero()) == 0, (n, k, mc)


def test_fallbacks():
    from modeling.ops.triton_gemm import linear

    x, w = _xw(4, 256, 512)
    torch.testing.assert_close(linear(x.float(), w.float()), F.linear(x.float(), w.float()))
    wt = w.t().contiguous().t()  # non-unit last stride
    torch.testing.assert_close(linear(x, wt), F.linear(x, wt))
    torch.testing.assert_close(linear(x.cpu(), w.cpu()), F.linear(x.cpu(), w.cpu()))


@pytest.mark.parametrize("n,k", [(2048, 1024), (1024, 1024), (3072, 1024), (1024, 1536), (1024, 3072)])
@pytest.mark.parametrize("m", [3, 48])
def test_split_k_graph_stress_matches_linear(n, k, m):
    """Many replays of a graph of back-to-back split-K GEMMs (TP=2 shapes use the heuristic configs) with fresh
    inputs each time: a memory-ordering race in the last-arrival reduction would show as a wrong tile."""
    from modeling.ops.triton_gemm import _sm_count, default_config, linear_with_config, m_class

    g = torch.Generator(device="cuda").manual_seed(n + k)
    ws = [(torch.randn(n, k, device="cuda", generator=g) / k ** 0.5).bfloat16() for _ in range(8)]
    x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    # the safe generic config itself (`linear` may take cuBLAS where a start-up measurement found it faster)
    cfg = default_config(n, k, m_class(m), _sm_count(torch.cuda.current_device()))
    assert cfg.split_k > 1
    outs = [linear_with_config(x, w, cfg) for w in ws]  # warm-up (and counters) outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [linear_with_config(x, w, cfg) for w in ws]
    for i in range(100):
        x.copy_(torch.randn(x.shape, device="cuda", generator=g).bfloat16())
        graph.replay()
        if i % 10 == 0 or i > 90:
            for y, w in zip(outs, ws):
                torch.testing.assert_close(y.float(), F.linear(x, w).float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("m", [1, 5, 16, 40])
@pytest.mark.parametrize("n,k", [(1024, 3072), (1024, 1536), (4096, 1024)])
def test_silu_mul_linear_equals_the_unfused_pair_bitwise(m, n, k):
    """The SiLU-gate prologue rounds exactly like `silu_and_mul`, so the fused down projection is bit-identical
    (cuBLAS-table shapes take the unfused pair)."""
    from modeling.ops.triton_fused import silu_and_mul
    from modeling.ops.triton_gemm import linear, silu_mul_linear

    g = torch.Generator(device="cuda").manual_seed(m * n + k)
    x = (torch.randn(m, 2 * k, device="cuda", generator=g) * 2).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=g) / k ** 0.5).bfloat16()
    want = linear(silu_and_mul(x), w)
    assert torch.equal(silu_mul_linear(x, w), want)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = silu_mul_linear(x, w)
    x.copy_((torch.randn(x.shape, device="cuda", generator=g) * 2).bfloat16())
    graph.replay()
    assert torch.equal(y, linear(silu_and_mul(x), w))
    with pytest.raises(ValueError, match="must be"):
        silu_mul_linear(x[:, :-2], w)


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("m", [1, 3, 4, 9])
@pytest.mark.parametrize("n,k", [(1024, 2048), (1024, 3072), (1024, 1536)])
def test_linear_add_rms_norm_equals_gemm_then_add_rms_norm(n, k, m, gated):
    """The fused residual add + RMSNorm epilogue: the sum is bit-identical to the unfused pair, the normed output
    within one bf16 rounding (fp32 sum-of-squares order); inside a graph replayed with fresh inputs many times
    (a memory-ordering race in the whole-row arrival would show as a stale row); counters back at zero."""
    from modeling.ops.triton_fused import add_rms_norm, silu_and_mul
    from modeling.ops.triton_gemm import config_for, linear_add_rms_norm, linear_with_config, split_k_counters

    g = torch.Generator(device="cuda").manual_seed(m * n + k + gated)
    x = torch.randn(m, 2 * k if gated else k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=g) / k ** 0.5).bfloat16()
    res = torch.randn(m, n, device="cuda", generator=g).bfloat16()
    nw = (1 + 0.1 * torch.randn(n, device="cuda", generator=g)).bfloat16()

    def unfused():  # the skinny GEMM the epilogue rides on (`linear` itself takes the GEMV at 1-2 rows)
        y = linear_with_config(silu_and_mul(x) if gated else x, w, config_for(n, k, m, x.device))
        return add_rms_norm(y, res, nw, 1e-6)

    def check(normed, summed):
        want_n, want_s = unfused()
        assert torch.equal(summed, want_s)
        torch.testing.assert_close(normed.float(), want_n.float(), atol=1.6e-2, rtol=8e-3)

    check(*linear_add_rms_norm(x, w, res, nw, 1e-6, gated=gated))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        normed, summed = linear_add_rms_norm(x, w, res, nw, 1e-6, gated=gated)
    for i in range(40):
        x.copy_(torch.randn(x.shape, device="cuda", generator=g).bfloat16())
        res.copy_(torch.randn(res.shape, device="cuda", generator=g).bfloat16())
        graph.replay()
        if i % 8 == 0 or i == 39:
            check(normed, summed)
    torch.cuda.synchronize()
    assert int(split_k_counters(x.device).count_nonzero()) == 0
