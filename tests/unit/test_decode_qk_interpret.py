"""Decode attention with the fused q/k prologue (`triton_decode_qk`) under the Triton CPU interpreter.

The fused launch (`decode_attention(..., qk=DecodeQK(...))`: RMSNorm + rotary of the raw q and k and the new
token's KV store inside the split kernel) against the two launches it replaces (`qk_norm_rope_store` then
`decode_attention` of the normalised q), both interpreted, and against the torch reference. Raw q/k/v are
column views of one fused qkv tensor, as the model passes them. Split counts 1, several and 16 (the
single-launch combine), a padded row (kv_len 0, slot -1), a live row whose slot is -1 (not stored), GQA
groups 2 and 4, fp32 and fp16 (the interpreter's `tl.dot` multiplies bf16 as raw uint16). Also
`triton_attention.decode_attention_qk`'s choice: fused where `fusable` and `fused_launch` hold, the two
launches otherwise (two-kernel combine, mixed dtypes), with the same results. Memory ordering between
concurrent programs needs a GPU (tests/gpu/test_decode_qk_gpu.py).
"""
import pytest

from tests.unit._interpret import run_interpreted

pytest.importorskip("triton", reason="needs triton (the Triton CPU interpreter runs its kernels)")

# name -> (Hq, Hkv, D, page, table width, kv lengths incl. the new token, stored?, [(BLOCK_N, splits)])
CASES = {
    "b1_long": (4, 2, 64, 16, 12, [150], [True], [(16, 1), (16, 4), (32, 8)]),
    "b3_pad_and_unstored": (8, 2, 32, 8, 20, [97, 5, 0], [True, False, False], [(16, 1), (16, 3), (8, 16)]),
    "b2_page_boundary": (4, 1, 64, 16, 4, [33, 16], [True, True], [(16, 2), (32, 1)]),
}

_CHILD = r"""
import dataclasses, json, sys
import torch
from modeling.ops import attention_ref as ref, fused_ref
from modeling.ops import triton_attention as ta, triton_decode as td
from modeling.ops.triton_decode_qk import DecodeQK, fusable
from modeling.ops.triton_rope import qk_norm_rope_store

EPS = 1e-6

def problem(hq, hkv, d, page, width, lens, stored, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    need = [max(1, -(-n // page)) for n in lens]
    blocks = sum(need) + 3
    kc = torch.randn(blocks, page, hkv, d, generator=g).to(dtype)  # history rows and garbage elsewhere
    vc = torch.randn(blocks, page, hkv, d, generator=g).to(dtype)
    ids = (torch.randperm(blocks - 1, generator=g) + 1).tolist()
    tables = torch.zeros(len(lens), width, dtype=torch.int32)
    for i, n in enumerate(need):
        tables[i, :n] = torch.tensor([ids.pop() for _ in range(n)], dtype=torch.int32)
    pos = torch.tensor([max(n - 1, 0) for n in lens], dtype=torch.int64)
    slots = torch.tensor([int(tables[i, p // page]) * page + p % page if s else -1
                          for i, (p, s) in enumerate(zip(pos.tolist(), stored))], dtype=torch.int64)
    qkv = (2.0 * torch.randn(len(lens), (hq + 2 * hkv) * d, generator=g)).to(dtype)
    q, k, v = (t.view(len(lens), -1, d) for t in qkv.split([hq * d, hkv * d, hkv * d], dim=-1))
    qw, kw = [(1.0 + 0.1 * torch.randn(d, generator=g)).to(dtype) for _ in range(2)]
    inv = 1.0 / (1e6 ** (torch.arange(0, d, 2).float() / d))
    ang = torch.outer(torch.arange(512).float(), inv)
    cos, sin = torch.cat((ang, ang), -1).cos(), torch.cat((ang, ang), -1).sin()
    return dict(q=q, k=k, v=v, qw=qw, kw=kw, cos=cos, sin=sin, pos=pos, slots=slots, kc=kc, vc=vc, tables=tables,
                lens=torch.tensor(lens, dtype=torch.int32))

def unfused(p, cfg, single_launch=True):
    kc, vc = p["kc"].clone(), p["vc"].clone()
    qn = qk_norm_rope_store(p["q"], p["k"], p["v"], p["qw"], p["kw"], p["cos"], p["sin"], p["pos"], EPS, kc, vc,
                            p["slots"])
    o = td.decode_attention(qn, kc, vc, p["tables"], p["lens"], p["q"].shape[-1] ** -0.5, config=cfg,
                            single_launch=single_launch)
    return o, kc, vc

def fused(p, cfg):
    kc, vc = p["kc"].clone(), p["vc"].clone()
    qk = DecodeQK(p["k"], p["v"], p["qw"], p["kw"], p["cos"], p["sin"], p["pos"], p["slots"], EPS)
    assert fusable(p["q"], qk, kc)
    o = td.decode_attention(p["q"], kc, vc, p["tables"], p["lens"], p["q"].shape[-1] ** -0.5, config=cfg, qk=qk)
    return o, kc, vc

def reference(p):
    kc, vc = p["kc"].clone().float(), p["vc"].clone().float()
    f = lambda t: t.float()
    qn = fused_ref.qk_norm_rope_store(f(p["q"]), f(p["k"]), f(p["v"]), f(p["qw"]), f(p["kw"]), p["cos"], p["sin"],
                                      p["pos"], EPS, kc, vc, p["slots"])
    return ref.decode_attention(qn, kc, vc, p["tables"], p["lens"], p["q"].shape[-1] ** -0.5)

def diff(a, b):
    return (a.float() - b.float()).abs().max().item()

out = {}
for name, (hq, hkv, d, page, width, lens, stored, configs) in json.loads(sys.argv[1]).items():
    for dt in ("float32", "float16"):
        p = problem(hq, hkv, d, page, width, lens, stored, getattr(torch, dt), seed=len(out))
        expected = reference(p)
        for bn, splits in configs:
            cfg = td.DecodeConfig(block_n=bn, num_splits=splits, num_warps=4, num_stages=2)
            uo, uk, uv = unfused(p, cfg)
            fo, fk, fv = fused(p, cfg)
            changed = (fk != p["kc"]).any(-1).any(-1).flatten() | (fv != p["vc"]).any(-1).any(-1).flatten()
            rows = changed.view(-1, page).nonzero().tolist()
            out[f"{name},{dt},{bn},{splits}"] = {
                "shape": list(fo.shape), "dtype": str(fo.dtype), "err_unfused": diff(fo, uo),
                "err_ref": diff(fo, expected), "err_ref_unfused": diff(uo, expected),
                "k_cache_err": diff(fk, uk), "v_cache_equal": torch.equal(fv, uv),
                "unfused_changed": (uk != p["kc"]).any().item() or (uv != p["vc"]).any().item(),
                "changed_slots": sorted(b * page + r for b, r in rows),
                "expected_slots": sorted(s for s in p["slots"].tolist() if s >= 0),
                "pad_rows_zero": all(int(fo[i].count_nonzero()) == 0 for i, n in enumerate(lens) if n == 0)}

# triton_attention.decode_attention_qk: which path it takes, and that both give the same
p = problem(8, 2, 32, 8, 20, [97, 5, 0], [True, True, False], torch.float32, seed=7)
cfg8 = td.DecodeConfig(block_n=8, num_splits=8, num_warps=4, num_stages=2)
calls = []
real = td.decode_attention
def spy(*a, **kw):
    calls.append(kw.get("qk") is not None)
    return real(*a, **kw)
ta.decode_attention = spy
ta.decode_config = lambda *a, **kw: cfg8
choice = {}
for label, single in (("single_launch", True), ("two_kernel", False)):
    kc, vc = p["kc"].clone(), p["vc"].clone()
    calls.clear()
    o = ta.decode_attention_qk(p["q"], p["k"], p["v"], p["qw"], p["kw"], p["cos"], p["sin"], p["pos"], EPS, kc, vc,
                               p["slots"], p["tables"], p["lens"], 32 ** -0.5, 3, single_launch=single)
    choice[label] = {"fused": list(calls), "out": o, "kc": kc, "vc": vc}
mixed = dict(p, kw=p["kw"].to(torch.float16))  # a k weight of another dtype: not fusable
kc, vc = p["kc"].clone(), p["vc"].clone()
calls.clear()
ta.decode_attention_qk(mixed["q"], mixed["k"], mixed["v"], mixed["qw"], mixed["kw"], p["cos"], p["sin"], p["pos"],
                       EPS, kc, vc, p["slots"], p["tables"], p["lens"], 32 ** -0.5, 3)
a, b = choice["single_launch"], choice["two_kernel"]
out["choice"] = {"single_launch": a["fused"], "two_kernel": b["fused"], "mixed": list(calls),
                 "out_err": diff(a["out"], b["out"]), "k_err": diff(a["kc"], b["kc"]),
                 "v_equal": torch.equal(a["vc"], b["vc"])}
try:
    qk = DecodeQK(p["k"], p["v"], p["qw"], p["kw"], p["cos"], p["sin"], p["pos"], p["slots"], EPS)
    real(p["q"], p["kc"].clone(), p["vc"].clone(), p["tables"], p["lens"], 0.1, config=cfg8, single_launch=False,
         qk=qk)
    out["two_kernel_error"] = None
except ValueError as e:
    out["two_kernel_error"] = str(e)
print("RESULT" + __import__("json").dumps(out))
"""


@pytest.fixture(scope="module")
def results():
    return run_interpreted(_CHILD, CASES, timeout_s=600)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_fused_prologue_matches_two_launches(results, name, dtype):
    hq, hkv, d, page, width, lens, stored, configs = CASES[name]
    tol = 1e-5 if dtype == "float32" else 4e-3
    for bn, splits in configs:
        r = results[f"{name},{dtype},{bn},{splits}"]
        assert r["shape"] == [len(lens), hq, d] and r["dtype"] == f"torch.{dtype}"
        assert r["err_unfused"] <= tol, (bn, splits, r)
        assert r["err_ref"] <= 10 * tol + r["err_ref_unfused"], (bn, splits, r)
        assert r["v_cache_equal"] and r["k_cache_err"] <= tol, (bn, splits, r)
        # the new rows land at their slots and nowhere else; an unstored row (slot -1) writes nothing
        assert r["changed_slots"] == r["expected_slots"] and len(r["expected_slots"]) == sum(stored)
        assert r["unfused_changed"] == bool(sum(stored))
        assert r["pad_rows_zero"]


def test_fused_choice_and_fallbacks(results):
    c = results["choice"]
    assert c["single_launch"] == [True], c  # one launch, with the prologue
    assert c["two_kernel"] == [False], c  # split kernel + reduce: the two unfused operators
    assert c["mixed"] == [False], c  # dtypes differ: not fusable
    assert c["out_err"] <= 1e-5 and c["k_err"] <= 1e-5 and c["v_equal"], c
    assert "single-launch combine" in (results["two_kernel_error"] or ""), results["two_kernel_error"]
