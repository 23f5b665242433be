"""The decode GEMV (`modeling/ops/triton_gemv.py`) on the GPU: equals F.linear and the unfused norm / SiLU-gate
operators (bf16 tolerance; the new residual stream bitwise), replays bitwise from a CUDA graph, drives the model's
norm-first layout to the reference path's greedy tokens at batches 1-4, and its variants are compiled by the
early warm-up so a rank's capture compiles none."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu

SHAPES = [(4096, 1024), (1024, 2048), (1024, 3072), (3072, 1024), (100, 300), (512, 9000)]  # (N, K), last: 3 chunks


def _inputs(m: int, n: int, k: int, gated: bool = False):
    g = torch.Generator(device="cuda").manual_seed(m * 1000003 + n * 31 + k)
    x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    r = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    nw = (1 + 0.1 * torch.randn(k, device="cuda", generator=g)).bfloat16()
    w = (torch.randn(2 * n if gated else n, k, device="cuda", generator=g) / k ** 0.5).bfloat16()
    return x, r, nw, w


@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("n,k", SHAPES)
def test_gemv_matches_linear(m, n, k):
    from modeling.ops.triton_gemm import linear
    from modeling.ops.triton_gemv import applies

    x, _, _, w = _inputs(m, n, k)
    assert applies(x, w, 4) and applies(x, w) == (m <= 2)
    torch.testing.assert_close(linear(x, w, gemv=4).float(), F.linear(x.float(), w.float()), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("m", [1, 2, 4])
@pytest.mark.parametrize("n,k", SHAPES)
def test_norm_linear_matches_the_unfused_operators(m, n, k, gated):
    from modeling.ops.triton_fused import add_rms_norm, rms_norm, silu_and_mul
    from modeling.ops.triton_gemm import norm_linear

    x, r, nw, w = _inputs(m, n, k, gated)
    normed, summed = add_rms_norm(x, r, nw, 1e-6)
    want = F.linear(normed.float(), w.float())
    want = silu_and_mul(want.bfloat16()).float() if gated else want
    y, s = norm_linear(x, r, nw, 1e-6, w, gated=gated, gemv=4)
    assert torch.equal(s, summed)
    torch.testing.assert_close(y.float(), want, atol=3e-2, rtol=3e-2)
    y, s = norm_linear(x, None, nw, 1e-6, w, gated=gated, gemv=4)
    want = F.linear(rms_norm(x, nw, 1e-6).float(), w.float())
    want = silu_and_mul(want.bfloat16()).float() if gated else want
    assert s is x
    torch.testing.assert_close(y.float(), want, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("n,k", [(128, 2048), (100, 300), (512, 9000)])  # the 30B-A3B router; uneven; 3 chunks
def test_norm_linear_normed_keeps_the_normed_rows(m, n, k):
    """`norm_linear_normed` (the MoE router with the post-attention add + norm in its prologue): the normed rows
    it keeps are the add_rms_norm kernel's to within one bf16 rounding, the stream bitwise, the logits within bf16
    tolerance; a replayed capture equals the eager call bitwise."""
    from modeling.ops.triton_fused import add_rms_norm
    from modeling.ops.triton_gemm import norm_linear_normed

    x, r, nw, w = _inputs(m, n, k)
    normed, summed = add_rms_norm(x, r, nw, 1e-6)
    y, kept, s = norm_linear_normed(x, r, nw, 1e-6, w, gemv=2)
    assert torch.equal(s, summed)
    torch.testing.assert_close(kept.float(), normed.float(), atol=2e-2, rtol=8e-3)
    torch.testing.assert_close(y.float(), F.linear(normed.float(), w.float()), atol=3e-2, rtol=3e-2)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gy, gkept, gs = norm_linear_normed(x, r, nw, 1e-6, w, gemv=2)
    x.copy_(torch.randn(x.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(9)))
    graph.replay()
    ey, ekept, es = norm_linear_normed(x, r, nw, 1e-6, w, gemv=2)
    assert torch.equal(gy, ey) and torch.equal(gkept, ekept) and torch.equal(gs, es)


def test_gemv_graph_replays_bitwise_with_changing_inputs():
    from modeling.ops.triton_gemm import linear, norm_linear

    x, r, nw, w = _inputs(1, 3072, 1024, gated=True)
    w_down = _inputs(1, 1024, 3072)[3]
    norm_linear(x, r, nw, 1e-6, w, gated=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        act, s = norm_linear(x, r, nw, 1e-6, w, gated=True)
        y = linear(act, w_down)
    for seed in range(3):
        x.copy_(torch.randn(x.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed)))
        graph.replay()
        e_act, e_s = norm_linear(x, r, nw, 1e-6, w, gated=True)
        assert torch.equal(act, e_act) and torch.equal(s, e_s) and torch.equal(y, linear(e_act, w_down))


@torch.inference_mode()
@pytest.mark.parametrize("batch", [1, 2, 3, 4])
def test_norm_first_layout_greedy_tokens_match_the_reference_path(batch):
    """qwen3-0.6b greedy decode of `batch` sequences (the GEMV layout, which serves this width up to 4 tokens per
    step) with Triton kernels equals the torch reference operators' tokens for 32 steps."""
    from actors.rank import RuntimeConfig
    from modeling.generate import generate
    from modeling.loader import init_random
    from modeling.ops import get_kernel_ops
    from modeling.ops.options import KernelOptions
    from modeling.qwen3 import Qwen3ForCausalLM
    from tests.gpu.helpers import random_tokens

    cfg = RuntimeConfig(model="qwen3-0.6b", device="cuda").model_config(torch.device("cuda"))
    outs = []
    for backend in ("triton", "torch"):
        ops = get_kernel_ops("cuda", backend, KernelOptions().for_model(cfg.hidden_size))
        assert ops.prologue_norm_max_tokens == (4 if backend == "triton" else 0)
        with torch.device("cuda"):
            m = Qwen3ForCausalLM(cfg, device="cuda", ops=ops)
        init_random(m, 0)
        rng = np.random.default_rng(5)
        prompts = [random_tokens(rng, n, cfg.vocab_size) for n in (23, 71, 40, 9)[:batch]]
        outs.append(generate(m, prompts, max_new_tokens=32, block_size=64).tokens)
        del m
    assert outs[0] == outs[1]


def test_early_warm_up_compiles_every_gemv_variant_the_capture_uses():
    from actors.kernel_warm_up import KernelWarmUp
    from actors.rank import RankRuntime, RuntimeConfig
    from graphrunner.config import GraphRunnerConfig
    from modeling.ops.triton_gemv import _gemv_kernel
    from parallel.context import ParallelContext

    def variants() -> int:
        return sum(len(entry[0]) for entry in _gemv_kernel.device_caches.values())

    cfg = RuntimeConfig(model="qwen3-0.6b", device="cuda", num_kv_blocks=300, max_model_len=2048,
                        graph=GraphRunnerConfig(max_decode_batch=8, pcg_max_tokens=0), armed_decode_wait_ms=0)
    _gemv_kernel.device_caches.clear()  # earlier tests compiled some variants: count this warm-up's own
    early = KernelWarmUp(cfg, 1, torch.device("cuda", 0))
    assert early.join() > 0 and early.error is None
    warmed = variants()
    assert warmed == 15, warmed  # M_PAD 1, 2 and 4 x (qkv rms-only, qkv add+rms, o_proj, gate_up gated, down)
    rt = RankRuntime(cfg, ParallelContext(), torch.device("cuda", 0))
    rt.load_model()
    rt.allocate_kv_cache()
    rt.build_runner()
    rt.capture_all()
    assert variants() == warmed, "the capture compiled GEMV variants the early warm-up missed"


def test_every_tuned_config_matches_the_unfused_operators():
    """Every `_CONFIGS` entry (the tuned presets' projections) at its own shape, row count, prologue and epilogue
    equals the unfused operators it replaces (bf16 tolerance; the new residual stream bitwise)."""
    from modeling.ops.triton_fused import add_rms_norm, rms_norm, silu_and_mul
    from modeling.ops.triton_gemv import _CONFIGS, GemvConfig, gemv_with_config

    for (n, k, m, norm, gated), entry in _CONFIGS.items():
        x, r, nw, w = _inputs(m, n, k, gated)
        kw = dict(residual=r if norm == 2 else None, norm_weight=nw if norm else None, eps=1e-6, gated=gated)
        y, s = gemv_with_config(x, w, GemvConfig(*entry), **kw)
        h = add_rms_norm(x, r, nw, 1e-6)[0] if norm == 2 else rms_norm(x, nw, 1e-6) if norm == 1 else x
        want = F.linear(h.float(), w.float())
        want = silu_and_mul(want.bfloat16()).float() if gated else want
        torch.testing.assert_close(y.float(), want, atol=3e-2, rtol=3e-2, msg=lambda e, key=(n, k, m): f"{key}: {e}")
        if norm == 2:
            assert torch.equal(s, add_rms_norm(x, r, nw, 1e-6)[1]), (n, k, m)
