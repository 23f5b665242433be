"""The skinny GEMM kernel (split-K included) under the Triton CPU interpreter (TRITON_INTERPRET=1).

Skipped where triton is not installed. Triton picks interpreted or compiled functions (its own
`tl.zeros`, `tl.cdiv`, ... included) when it is imported, so the kernel runs in one child
process started with TRITON_INTERPRET=1; this process only compares. Inputs are fp16: the
interpreter's `tl.dot` multiplies bf16 as its raw uint16 storage (triton 3.9), which would test
the interpreter, not the kernel. The interpreter runs programs one after another, so this checks
the split-K arithmetic, masking, the last-arrival branch and the counter reset; the memory
ordering between concurrent programs needs a GPU (tests/gpu/test_triton_gemm.py).
"""

import itertools

import pytest

from tests.unit._interpret import run_interpreted

pytest.importorskip("triton", reason="needs triton (the Triton CPU interpreter runs its kernels)")

SPLITS = (1, 2, 4, 8)
# (M, N, K, BLOCK_K); K=200 is uneven; M 24 and 48 run the 32- and 64-row tiles
CASES = [(3, 64, 256, 32), (1, 50, 200, 32), (16, 64, 256, 64), (24, 48, 200, 32), (48, 64, 256, 64)]

_CHILD = r"""
import json, sys
import torch
import torch.nn.functional as F
from modeling.ops import triton_gemm as gemm

out = {}
for m, n, k, block_k in json.loads(sys.argv[1]):
    g = torch.Generator().manual_seed(m * 7919 + n * 31 + k)
    x, w = torch.randn(m, k, generator=g).half(), (torch.randn(n, k, generator=g) / k ** 0.5).half()
    ref = F.linear(x.float(), w.float())
    for split_k in json.loads(sys.argv[2]):
        cfg = gemm.GemmConfig(block_n=16, block_k=block_k, split_k=split_k, num_warps=4, num_stages=2)
        y = gemm.linear_with_config(x, w, cfg)
        y32 = gemm.linear_with_config(x, w, cfg, out_dtype=torch.float32)
        again = gemm.linear_with_config(x, w, cfg, out_dtype=torch.float32)
        out[f"{m},{n},{k},{block_k},{split_k}"] = {
            "dtypes": [str(y.dtype), str(y32.dtype)], "shape": list(y.shape),
            "err16": (y.float() - ref).abs().max().item(), "err32": (y32 - ref).abs().max().item(),
            "bitwise_repeat": torch.equal(y32, again),
            "counters_nonzero": int(gemm.split_k_counters(x.device).count_nonzero())}
    xg = torch.randn(m, 2 * k, generator=g).half()  # gate then up: the fused SiLU-gate prologue
    from modeling.ops.triton_fused import silu_and_mul  # the unfused operator, interpreted the same way
    xs = silu_and_mul(xg)
    for split_k in json.loads(sys.argv[2]):
        cfg = gemm.GemmConfig(block_n=16, block_k=block_k, split_k=split_k, num_warps=4, num_stages=2)
        fused = gemm.linear_with_config(xg, w, cfg, out_dtype=torch.float32, gated=True)
        plain = gemm.linear_with_config(xs, w, cfg, out_dtype=torch.float32)
        out[f"gated {m},{n},{k},{block_k},{split_k}"] = {"equal_to_unfused": torch.equal(fused, plain),
                                                         "shape": list(fused.shape)}
    from modeling.ops.triton_fused import add_rms_norm  # the fused residual add + RMSNorm epilogue
    res, nw = torch.randn(m, n, generator=g).half(), (1 + 0.1 * torch.randn(n, generator=g)).half()
    cnt = gemm.split_k_counters(x.device)
    for split_k in json.loads(sys.argv[2]):
        cfg = gemm.GemmConfig(block_n=16, block_k=block_k, split_k=split_k, num_warps=4, num_stages=2)
        for gated, xin in ((False, x), (True, xg)):
            normed, summed = gemm.linear_add_rms_norm_with_config(xin, w, cfg, res, nw, 1e-6, gated=gated)
            y = gemm.linear_with_config(xin, w, cfg, gated=gated)
            want_normed, want_summed = add_rms_norm(y, res, nw, 1e-6)
            out[f"norm {gated} {m},{n},{k},{block_k},{split_k}"] = {
                "sum_equal": torch.equal(summed, want_summed),
                "normed_err": (normed.float() - want_normed.float()).abs().max().item(),
                "counters_nonzero": int(cnt.count_nonzero())}
y = gemm.linear(torch.randn(2, 32), torch.randn(8, 32), out_dtype=torch.float64)  # CPU: F.linear fallback
out["fallback_dtype"] = str(y.dtype)
print("RESULT" + json.dumps(out))
"""


@pytest.fixture(scope="module")
def results() -> dict:
    return run_interpreted(_CHILD, CASES, SPLITS)


@pytest.mark.parametrize("split_k", SPLITS)
@pytest.mark.parametrize("m,n,k,block_k", CASES)
def test_interpreted_kernel_matches_torch(results, m, n, k, block_k, split_k):
    r = results[f"{m},{n},{k},{block_k},{split_k}"]
    assert r["dtypes"] == ["torch.float16", "torch.float32"] and r["shape"] == [m, n]
    assert r["err16"] < 2e-2 * 4  # fp16 output rounding of values up to ~4
    assert r["err32"] < 1e-4
    assert r["bitwise_repeat"]
    assert r["counters_nonzero"] == 0


@pytest.mark.parametrize("split_k", SPLITS)
@pytest.mark.parametrize("m,n,k,block_k", CASES)
def test_interpreted_gated_prologue_equals_silu_mul_then_gemm(results, m, n, k, block_k, split_k):
    r = results[f"gated {m},{n},{k},{block_k},{split_k}"]
    assert r["shape"] == [m, n] and r["equal_to_unfused"]


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("split_k", SPLITS)
@pytest.mark.parametrize("m,n,k,block_k", CASES)
def test_interpreted_add_rms_norm_epilogue_equals_the_unfused_norm(results, m, n, k, block_k, split_k, gated):
    r = results[f"norm {gated} {m},{n},{k},{block_k},{split_k}"]
    assert r["sum_equal"]  # y + residual rounds elementwise: the same bits
    assert r["normed_err"] <= 4e-3  # one fp16 ulp near 1-4: the fp32 sum of squares may be ordered differently
    assert r["counters_nonzero"] == 0  # the tile counters and the row counter are back at zero


def test_cpu_linear_falls_back_with_out_dtype(results):
    assert results["fallback_dtype"] == "torch.float64"


def test_config_table_and_heuristic():
    from modeling.ops import triton_gemm as gemm

    for (n, k, mc), entry in gemm._CONFIGS.items():
        if entry is None:  # cuBLAS measured faster for this shape
            assert gemm.config_for(n, k, mc) is None
            continue
        cfg = gemm.GemmConfig(*entry)
        assert mc in (1, 4, 16, 32, 64) and cfg.split_k in (1, 2, 4, 8, 16), (n, k, mc)
        assert cfg.smem_bytes(gemm.block_m(mc)) <= 227 * 1024, (n, k, mc)
    assert [gemm.m_class(m) for m in (1, 2, 4, 5, 16, 17, 32, 33, 64)] == [1, 4, 4, 16, 16, 32, 32, 64, 64]
    assert [gemm.block_m(m) for m in (1, 16, 17, 32, 33, 64)] == [16, 16, 32, 32, 64, 64]
    for (n, k), mc in itertools.product([(1024, 3072), (2048, 1024), (512, 4096), (100, 300), (151936, 4096)],
                                        (1, 4, 16, 32, 64)):
        cfg = gemm.default_config(n, k, mc, 132)
        tiles = -(-n // cfg.block_n)
        assert cfg.smem_bytes(gemm.block_m(mc)) <= 100 * 1024
        assert cfg.split_k == 1 or k % (cfg.split_k * cfg.block_k) == 0
        # split-K grows until >= 2 CTAs per SM, 8 splits, or K no longer divides evenly
        assert tiles * cfg.split_k >= 2 * 132 or cfg.split_k == 8 or k % (2 * cfg.split_k * cfg.block_k)
