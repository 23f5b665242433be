"""The decode GEMV (`modeling/ops/triton_gemv.py`) under the Triton CPU interpreter (TRITON_INTERPRET=1).

One child process runs the kernel interpreted; this process compares. fp16 inputs: the interpreter rounds fp32 to
bf16 by truncation, fp16 correctly, and these tests compare bits against the unfused operators (run interpreted
the same way). Cases cover one weight chunk (the whole row, loaded before x) and several chunks (the two-pass
norm), uneven N and K, 1-4 rows, every prologue (none, rms_norm, add + rms_norm) and the SiLU-gate epilogue.
"""

import pytest

from tests.unit._interpret import run_interpreted

pytest.importorskip("triton", reason="needs triton (the Triton CPU interpreter runs its kernels)")

CASES = [(64, 256, 8, 256), (50, 200, 4, 256), (64, 256, 8, 128), (50, 200, 16, 64), (32, 384, 4, 256)]  # N, K, BN, BK
ROWS = (1, 2, 3, 4)

_CHILD = r"""
import json, sys
import torch
import torch.nn.functional as F
from modeling.ops import triton_gemv as gv
from modeling.ops import triton_gemm
from modeling.ops.triton_fused import add_rms_norm, rms_norm, silu_and_mul

out = {}
for n, k, bn, bk in json.loads(sys.argv[1]):
    for m in json.loads(sys.argv[2]):
        g = torch.Generator().manual_seed(m * 7919 + n * 31 + k)
        x, r = torch.randn(m, k, generator=g).half(), torch.randn(m, k, generator=g).half()
        nw = (1 + 0.1 * torch.randn(k, generator=g)).half()
        w = (torch.randn(2 * n, k, generator=g) / k ** 0.5).half()
        cfg = gv.GemvConfig(bn, bk, 4)
        key = f"{n},{k},{bn},{bk},{m}"
        y, s = gv.gemv_with_config(x, w[:n], cfg)
        out["plain " + key] = {"err": (y.float() - F.linear(x.float(), w[:n].float())).abs().max().item(),
                               "shape": list(y.shape), "sum": s is None}
        normed, summed = add_rms_norm(x, r, nw, 1e-6)
        for gated in (False, True):
            wt = w if gated else w[:n]
            y, s = gv.gemv_with_config(x, wt, cfg, residual=r, norm_weight=nw, eps=1e-6, gated=gated)
            want = F.linear(normed.float(), wt.float())
            if gated:
                want = silu_and_mul(want.half()).float()
            out[f"add {gated} " + key] = {"err": (y.float() - want).abs().max().item(), "shape": list(y.shape),
                                          "sum_equal": torch.equal(s, summed), "x_untouched": True}
        y, s = gv.gemv_with_config(x, w[:n], cfg, norm_weight=nw, eps=1e-6)
        want = F.linear(rms_norm(x, nw, 1e-6).float(), w[:n].float())
        out["rms " + key] = {"err": (y.float() - want).abs().max().item(), "sum": s is None}
        if bk >= k:  # whole rows: the row-at-a-time form of the same program (GemvConfig.row_loop)
            rl = gv.GemvConfig(bn, bk, 4, 1, True)
            errs, sums = [], []
            for norm_w, res in ((None, None), (nw, None), (nw, r)):
                for gated in (False, True):
                    wt = w if gated else w[:n]
                    y0, s0 = gv.gemv_with_config(x, wt, cfg, residual=res, norm_weight=norm_w, eps=1e-6, gated=gated)
                    y1, s1 = gv.gemv_with_config(x, wt, rl, residual=res, norm_weight=norm_w, eps=1e-6, gated=gated)
                    errs.append((y1.float() - y0.float()).abs().max().item())
                    sums.append(s0 is None and s1 is None or torch.equal(s0, s1))
            out["rowloop " + key] = {"err": max(errs), "sums_equal": all(sums)}
        # the normed rows kept (KEEP_NORMED) by every form, with and without the residual add; the projection and
        # the stream unchanged by keeping them
        forms = [cfg] + ([gv.GemvConfig(bn, bk, 4, 1, True)] if bk >= k else [])
        kept = []
        for c in forms:
            for res, (want_normed, _) in ((r, add_rms_norm(x, r, nw, 1e-6)), (None, (rms_norm(x, nw, 1e-6), None))):
                keep = torch.full((m, k), float("nan"), dtype=torch.half)
                y0, s0 = gv.gemv_with_config(x, w[:n], c, residual=res, norm_weight=nw, eps=1e-6)
                y1, s1 = gv.gemv_with_config(x, w[:n], c, residual=res, norm_weight=nw, eps=1e-6, normed_out=keep)
                kept.append({"normed_err": (keep.float() - want_normed.float()).abs().max().item(),
                             "y_equal": torch.equal(y0, y1),
                             "sum_equal": s0 is None and s1 is None or torch.equal(s0, s1)})
        out["keep " + key] = kept
# the operators the model calls: linear dispatches 1-2 rows here by default (up to `gemv` rows when told: the
# KernelOptions.gemv_rows binding), norm_linear fuses, more rows fall back
g = torch.Generator().manual_seed(1)
w = (torch.randn(96, 128, generator=g) / 128 ** 0.5).half()
nw = (1 + 0.1 * torch.randn(128, generator=g)).half()
for m in (1, 2, 3, 4):
    x, r = torch.randn(m, 128, generator=g).half(), torch.randn(m, 128, generator=g).half()
    y = triton_gemm.linear(x, w)
    a, s = triton_gemm.norm_linear(x, r, nw, 1e-6, w, gated=True)
    b, s0 = triton_gemm.norm_linear(x, None, nw, 1e-6, w)
    normed, summed = add_rms_norm(x, r, nw, 1e-6)
    y4 = triton_gemm.linear(x, w, gemv=4)
    a4, s4 = triton_gemm.norm_linear(x, r, nw, 1e-6, w, gated=True, gemv=4)
    a_gv, s_gv = gv.norm_gemv(x, r, nw, 1e-6, w, True)
    out[f"ops {m}"] = {
        "gemv": gv.applies(x, w), "gemv4": gv.applies(x, w, 4), "gemv1": gv.applies(x, w, 1),
        "gemv0": gv.applies(x, w, 0), "rows4_is_gemv": torch.equal(a4, a_gv) and torch.equal(s4, s_gv),
        "rows4_linear_err": (y4.float() - F.linear(x.float(), w.float())).abs().max().item(),
        "linear_err": (y.float() - F.linear(x.float(), w.float())).abs().max().item(),
        "gated_err": (a.float() - silu_and_mul(F.linear(normed, w)).float()).abs().max().item(),
        "gated_shape": list(a.shape), "sum_equal": torch.equal(s, summed), "stream_is_x": s0 is x,
        "rms_err": (b.float() - F.linear(rms_norm(x, nw, 1e-6), w).float()).abs().max().item()}
# gemv=0 (KernelOptions.gemv off): the same operators without the GEMV (F.linear and the norm kernels on the CPU)
x, r = torch.randn(1, 128, generator=g).half(), torch.randn(1, 128, generator=g).half()
y = triton_gemm.linear(x, w, gemv=0)
a, s = triton_gemm.norm_linear(x, r, nw, 1e-6, w, gemv=0)
normed, summed = add_rms_norm(x, r, nw, 1e-6)
out["gemv off"] = {"linear_err": (y.float() - F.linear(x.float(), w.float())).abs().max().item(),
                   "norm_err": (a.float() - F.linear(normed, w).float()).abs().max().item(),
                   "stream_equal": torch.equal(s, summed)}
# norm_linear_normed: the GEMV with the normed rows kept up to `gemv` rows, the norm kernel and F.linear beyond
for m, rows in ((1, 2), (2, 2), (3, 2), (3, 4)):
    x, r = torch.randn(m, 128, generator=g).half(), torch.randn(m, 128, generator=g).half()
    normed, summed = add_rms_norm(x, r, nw, 1e-6)
    y, kept, s = triton_gemm.norm_linear_normed(x, r, nw, 1e-6, w, gemv=rows)
    y0, kept0, s0 = triton_gemm.norm_linear_normed(x, None, nw, 1e-6, w, gemv=rows)
    out[f"normed {m} {rows}"] = {
        "y_err": (y.float() - F.linear(normed, w).float()).abs().max().item(),
        "normed_err": (kept.float() - normed.float()).abs().max().item(), "sum_equal": torch.equal(s, summed),
        "rms_normed_err": (kept0.float() - rms_norm(x, nw, 1e-6).float()).abs().max().item(), "stream_is_x": s0 is x,
        "y_shape": list(y.shape)}
try:
    gv.gemv_with_config(x, w, gv.GemvConfig(8, 128, 4), normed_out=torch.empty(3, 128).half())
    out["keep_without_norm"] = "no error"
except ValueError as e:
    out["keep_without_norm"] = str(e)
x, r = torch.randn(1, 128, generator=g).half(), torch.randn(1, 128, generator=g).half()
try:
    triton_gemm.norm_linear(x, r, nw, 1e-6, w[:95], gated=True)
    out["odd_gated"] = "no error"
except ValueError as e:
    out["odd_gated"] = str(e)
print("RESULT" + json.dumps(out))
"""


@pytest.fixture(scope="module")
def results() -> dict:
    return run_interpreted(_CHILD, CASES, ROWS)


@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("n,k,bn,bk", CASES)
def test_interpreted_gemv_matches_torch(results, n, k, bn, bk, m):
    key = f"{n},{k},{bn},{bk},{m}"
    plain = results["plain " + key]
    assert plain["shape"] == [m, n] and plain["sum"]
    assert plain["err"] < 2e-3  # fp16 output rounding of values up to ~2
    assert results["rms " + key]["err"] < 4e-3 and results["rms " + key]["sum"]


@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("n,k,bn,bk", [c for c in CASES if c[3] >= c[1]])
def test_interpreted_row_loop_form_equals_the_broadcast_form(results, n, k, bn, bk, m):
    r = results[f"rowloop {n},{k},{bn},{bk},{m}"]
    assert r["sums_equal"]  # the new residual stream, bitwise
    assert r["err"] < 2e-3  # the same products, summed in another order: within fp16 output rounding


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("n,k,bn,bk", CASES)
def test_interpreted_norm_prologue_and_gate_epilogue_match_the_unfused_operators(results, n, k, bn, bk, m, gated):
    r = results[f"add {gated} {n},{k},{bn},{bk},{m}"]
    assert r["shape"] == [m, n]
    assert r["sum_equal"]  # x + residual rounds elementwise: the same bits, stored once by program 0
    assert r["err"] < 4e-3  # the fp32 sums are ordered differently from the unfused kernels


@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_interpreted_model_operators_dispatch_and_fall_back(results, m):
    r = results[f"ops {m}"]
    assert r["gemv"] == (m <= 2)  # the default: up to 2 rows
    assert r["gemv1"] == (m == 1) and r["gemv4"] and not r["gemv0"]
    assert r["rows4_is_gemv"] and r["rows4_linear_err"] < 2e-3  # gemv=4: every row count here takes the GEMV
    assert r["linear_err"] < 2e-3 and r["gated_err"] < 4e-3 and r["rms_err"] < 4e-3
    assert r["gated_shape"] == [m, 48] and r["sum_equal"] and r["stream_is_x"]


def test_odd_gated_weight_is_rejected(results):
    assert "even number of rows" in results["odd_gated"]


def test_config_table_and_heuristic():
    from modeling.ops import triton_gemv as gv

    for (n, k, mp, norm, gated), entry in gv._CONFIGS.items():
        cfg = gv.GemvConfig(*entry)
        assert mp in (1, 2, 4) and norm in (0, 1, 2) and cfg.block_k & (cfg.block_k - 1) == 0
        assert gv.config_for(n, k, mp, norm, gated) == cfg
        assert n * (2 if gated else 1) <= gv.GEMV_MAX_N  # an entry the GEMV can serve
        assert not cfg.row_loop or cfg.block_k >= k  # the row-at-a-time form exists for whole-row programs only
    for k in (100, 1024, 3072, 8192, 16384):
        cfg = gv.default_config(512, k, False)
        assert cfg.block_k >= k or (k > 8192 and cfg.block_k == 4096)
        assert 1 <= cfg.block_n <= 16 and cfg.block_n & (cfg.block_n - 1) == 0
        assert gv.default_config(512, k, True).block_n <= cfg.block_n


def test_gemv_switch_parses_strictly():
    from actors.environment import options_from_environ
    from modeling.ops.options import GEMV_ENV, KernelOptions

    assert options_from_environ({}).kernels.gemv
    assert not options_from_environ({GEMV_ENV: "0"}).kernels.gemv
    assert options_from_environ({GEMV_ENV: " 1 "}).kernels.gemv
    with pytest.raises(ValueError, match="GRAPHLINE_GEMV='yes'.*use 1.*or 0"):
        options_from_environ({GEMV_ENV: "yes"})
    with pytest.raises(ValueError, match="gemv"):
        KernelOptions(gemv=1)


def test_gemv_rows_option_parses_strictly_and_binds_zero_when_off():
    from actors.environment import options_from_environ
    from modeling.ops.options import GEMV_ENV, GEMV_ROWS_ENV, KernelOptions

    auto = options_from_environ({}).kernels
    assert auto.gemv_rows is None and auto.gemv_max_rows() == 2  # not yet resolved for a model
    # by the model's width: 4 rows up to hidden 1024 (Qwen3-0.6B), 2 up to 2048, none (cuBLAS) wider
    assert [auto.for_model(h).gemv_max_rows() for h in (1024, 2048, 4096)] == [4, 2, 0]
    assert options_from_environ({GEMV_ROWS_ENV: "4"}).kernels.gemv_max_rows() == 4
    told = options_from_environ({GEMV_ROWS_ENV: "3"}).kernels
    assert told.for_model(1024).gemv_max_rows() == 3 and told.for_model(2048).gemv_max_rows() == 3
    assert options_from_environ({GEMV_ROWS_ENV: "4", GEMV_ENV: "0"}).kernels.for_model(1024).gemv_max_rows() == 0
    for bad in ("0", "5", "two"):
        with pytest.raises(ValueError, match="GRAPHLINE_GEMV_ROWS"):
            options_from_environ({GEMV_ROWS_ENV: bad})
    with pytest.raises(ValueError, match="GRAPHLINE_GEMV_ROWS"):
        KernelOptions(gemv_rows=True)


def test_gemv_off_takes_the_other_kernels(results):
    r = results["gemv off"]
    assert r["linear_err"] < 2e-3 and r["norm_err"] < 4e-3 and r["stream_equal"]


@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("n,k,bn,bk", CASES)
def test_interpreted_gemv_keeps_the_normed_rows(results, n, k, bn, bk, m):
    """KEEP_NORMED (`norm_gemv`'s `normed_out`, the MoE router's prologue): program 0 stores the normed rows,
    equal to the norm kernels' to within one fp16 rounding (the sum of squares is ordered differently); the
    projection and the stream keep their bits."""
    for r in results[f"keep {n},{k},{bn},{bk},{m}"]:
        assert r["normed_err"] < 4e-3 and r["y_equal"] and r["sum_equal"], r


@pytest.mark.parametrize("m,rows", [(1, 2), (2, 2), (3, 2), (3, 4)])
def test_interpreted_norm_linear_normed_dispatches_and_falls_back(results, m, rows):
    r = results[f"normed {m} {rows}"]
    assert r["y_shape"] == [m, 96] and r["sum_equal"] and r["stream_is_x"]
    assert r["y_err"] < 4e-3 and r["normed_err"] < 4e-3 and r["rms_normed_err"] < 4e-3
    assert "normed_out" in results["keep_without_norm"]
