"""The routed-expert MoE kernels (`modeling/ops/triton_moe.py`) under the Triton CPU interpreter (TRITON_INTERPRET=1).

One child process runs the kernels interpreted and the torch references (`modeling/ops/moe_ref.py`) on the same
inputs; this process compares. Shapes H=64, I=32, E=8, top-2, 1..40 tokens. Routings: uniform, skewed (uneven
loads, idle experts), every token on one expert, two experts only, EP (this rank holds experts 8..15 of 16, half
the pairs go elsewhere, some ids are -1), and a token with no local expert. fp32 is compared tightly; fp16 to a few
half-precision ulps (the same rounding points as the reference). bf16 is left to the GPU tests: the interpreter's
`tl.dot` returns garbage for bf16 operands (triton 3.9). The packed (DeepEP) layout: counts 0, some and the whole
capacity.
"""

import pytest

from tests.unit._interpret import run_interpreted

pytest.importorskip("triton", reason="needs triton (the Triton CPU interpreter runs its kernels)")

ROUTINGS = ("uniform", "skewed", "one_expert", "two_experts", "ep", "ep_none_local")
TOKENS = (1, 2, 7, 16, 40, 100)  # 100 tokens: 200 pairs, two grouping chunks

_CHILD = r"""
import json, sys
import torch
from modeling.ops import moe_ref as ref
from modeling.ops import triton_moe as tm
from modeling.ops import triton_moe_pairs as tp

H, I, E, K = 64, 32, 8, 2
out = {}

def routing(kind, n, g):
    if kind == "uniform":
        return torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(n)]), 0, E
    if kind == "skewed":  # expert 0 takes most slot-0 pairs, experts 5..7 get none
        first = torch.where(torch.rand(n, generator=g) < 0.8, 0, torch.randint(1, 5, (n,), generator=g))
        second = (first + 1 + torch.randint(0, 4, (n,), generator=g)) % 5
        return torch.stack([first, second], 1), 0, E
    if kind == "one_expert":
        return torch.stack([torch.full((n,), 3), torch.full((n,), 6)], 1), 0, E
    if kind == "two_experts":
        return torch.stack([torch.full((n,), 2), torch.full((n,), 5)], 1)[:, torch.randperm(2, generator=g)], 0, E
    if kind == "ep":  # 16 global experts, this rank holds 8..15; some slots routed nowhere (-1)
        ids = torch.stack([torch.randperm(2 * E, generator=g)[:K] for _ in range(n)])
        ids[torch.rand(n, K, generator=g) < 0.15] = -1
        return ids, E, E
    if kind == "ep_none_local":  # no pair of the batch is local except one token's second slot
        ids = torch.randint(0, E, (n, K), generator=g)
        ids[-1, 1] = E + 4
        return ids, E, E
    raise ValueError(kind)

for dtype_name in json.loads(sys.argv[3]):
    dtype = getattr(torch, dtype_name)
    for kind in json.loads(sys.argv[1]):
        for n in json.loads(sys.argv[2]):
            if dtype_name == "float16" and n > 40:
                continue
            g = torch.Generator().manual_seed(n * 131 + len(kind))
            ids, first, e_local = routing(kind, n, g)
            ids = ids.long()
            w = torch.rand(n, K, generator=g)
            w = w / w.sum(-1, keepdim=True)
            x = torch.randn(n, H, generator=g).to(dtype)
            w13 = (torch.randn(e_local, 2 * I, H, generator=g) / H ** 0.5).to(dtype)
            w2 = (torch.randn(e_local, H, I, generator=g) / I ** 0.5).to(dtype)
            sp, counts = tm.group_by_expert(ids, e_local, first)
            rsp, rcounts = ref.group_by_expert(ids, e_local, first)
            sp16, counts16 = tm.group_by_expert(ids, e_local, first, block_p=16)  # many chunks: the histogram pass
            total = int(rcounts.sum())
            got = tm.routed_experts(x, ids, w, w13, w2, first)
            want = ref.experts_static(x, ids, w, w13, w2, first)
            pairs = tp.pair_experts(x, ids, w, w13, w2, first)
            by_size = tp.routed_experts_by_size(x, ids, w, w13, w2, first, pairs_max=2 * K)
            none_local = (ids - first).lt(0).logical_or((ids - first).ge(e_local)).all(1)
            grouped = ref.experts_grouped(x, ids, w, w13, w2, first)
            out[f"{dtype_name} {kind} {n}"] = {
                "counts_equal": torch.equal(counts, rcounts), "pairs_equal": torch.equal(sp[:total], rsp[:total]),
                "chunked_equal": torch.equal(counts16, rcounts) and torch.equal(sp16[:total], rsp[:total]),
                "local_pairs": total, "idle_experts": int((rcounts == 0).sum()),
                "shape": list(got.shape), "dtype": str(got.dtype), "finite": bool(torch.isfinite(got).all()),
                "err": (got.float() - want.float()).abs().max().item(),
                "by_size_is_pairs": torch.equal(by_size, pairs), "by_size_is_routed": torch.equal(by_size, got),
                "pairs_err": (pairs.float() - want.float()).abs().max().item(),
                "pairs_zero_rows_zero": bool((pairs[none_local] == 0).all()),
                "ref_err": (grouped.float() - want.float()).abs().max().item(),
                "scale": want.float().abs().max().item(),
                "zero_rows_zero": bool((got[none_local] == 0).all()),
            }
    # packed (DeepEP low-latency) layout: expert e's rows are x[e, :counts[e]]
    g = torch.Generator().manual_seed(7)
    cap = 12
    x = torch.randn(E, cap, H, generator=g).to(dtype)
    w13 = (torch.randn(E, 2 * I, H, generator=g) / H ** 0.5).to(dtype)
    w2 = (torch.randn(E, H, I, generator=g) / I ** 0.5).to(dtype)
    counts = torch.tensor([0, 1, cap, 5, 0, 11, 2, cap], dtype=torch.int32)
    got = tm.packed_experts(x, counts, w13, w2)
    want = ref.packed_experts(x, counts, w13, w2)
    rows = torch.arange(cap)[None, :] < counts[:, None]
    out[f"{dtype_name} packed"] = {"shape": list(got.shape), "err": (got.float() - want.float())[rows].abs().max().item(),
                                   "scale": want.float().abs().max().item()}
# misuse is a named error
try:
    tm.routed_experts(torch.zeros(3, H), torch.zeros(3, K, dtype=torch.int32), torch.zeros(3, K),
                      torch.zeros(E, 2 * I, H), torch.zeros(E, H, I))
    out["bad_ids"] = "no error"
except tm.MoeKernelError as e:
    out["bad_ids"] = str(e)
try:
    tm.routed_experts(torch.zeros(3, H), torch.zeros(3, K, dtype=torch.int64), torch.zeros(3, K),
                      torch.zeros(E, 2 * I, H + 1), torch.zeros(E, H, I))
    out["bad_shape"] = "no error"
except tm.MoeKernelError as e:
    out["bad_shape"] = str(e)
print("RESULT" + json.dumps(out))
"""


@pytest.fixture(scope="module")
def results() -> dict:
    return run_interpreted(_CHILD, ROUTINGS, TOKENS, ["float32", "float16"], timeout_s=600)


@pytest.mark.parametrize("n", TOKENS)
@pytest.mark.parametrize("kind", ROUTINGS)
def test_device_grouping_is_the_stable_sort_by_expert(results, kind, n):
    r = results[f"float32 {kind} {n}"]
    assert r["counts_equal"] and r["pairs_equal"] and r["chunked_equal"]


@pytest.mark.parametrize("n", TOKENS)
@pytest.mark.parametrize("kind", ROUTINGS)
def test_routed_fp32_equals_the_reference(results, kind, n):
    r = results[f"float32 {kind} {n}"]
    assert r["shape"] == [n, 64] and r["dtype"] == "torch.float32" and r["finite"]
    assert r["scale"] > 0.05 or r["local_pairs"] <= 1  # the case computes something
    assert r["err"] < 2e-5 * max(1.0, r["scale"]), r
    assert r["ref_err"] < 2e-5 * max(1.0, r["scale"])  # the two torch references agree too
    assert r["zero_rows_zero"]  # a token with no local expert gets exact zeros


@pytest.mark.parametrize("n", TOKENS)
@pytest.mark.parametrize("kind", ROUTINGS)
def test_pair_by_pair_path_equals_the_reference(results, kind, n):
    """`triton_moe_pairs.pair_experts` (no grouping, the combine in the down GEMM) as tight as the grouped kernels;
    `routed_experts_by_size` takes it up to two tokens (pairs_max = 2k) and the grouped path beyond. (Its bits
    against the grouped kernels are a GPU test: the interpreter's numpy dot is not row-independent.)"""
    r = results[f"float32 {kind} {n}"]
    assert r["pairs_err"] < 2e-5 * max(1.0, r["scale"]), r
    assert r["pairs_zero_rows_zero"]
    assert r["by_size_is_pairs"] if n <= 2 else r["by_size_is_routed"]


@pytest.mark.parametrize("n", [t for t in TOKENS if t <= 40])
@pytest.mark.parametrize("kind", ROUTINGS)
def test_pair_by_pair_path_fp16_close_to_the_reference(results, kind, n):
    r = results[f"float16 {kind} {n}"]
    assert r["pairs_err"] < 4e-3 * max(1.0, r["scale"]), r
    assert r["pairs_zero_rows_zero"]


def test_routings_cover_the_edge_cases(results):
    assert results["float32 skewed 40"]["idle_experts"] >= 3
    assert results["float32 one_expert 40"]["idle_experts"] == 6
    assert results["float32 ep 40"]["local_pairs"] < 2 * 40 * 0.75  # other ranks' experts and -1 slots dropped
    assert results["float32 ep_none_local 7"]["local_pairs"] == 1


@pytest.mark.parametrize("n", [t for t in TOKENS if t <= 40])
@pytest.mark.parametrize("kind", ROUTINGS)
def test_routed_fp16_close_to_the_reference(results, kind, n):
    r = results[f"float16 {kind} {n}"]
    assert r["shape"] == [n, 64] and r["dtype"] == "torch.float16" and r["finite"] and r["zero_rows_zero"]
    assert r["err"] < 4e-3 * max(1.0, r["scale"]), r  # a few fp16 ulps: fp32 sums ordered differently


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_packed_layout_equals_the_reference_on_received_rows(results, dtype):
    r = results[f"{dtype} packed"]
    assert r["shape"] == [8, 12, 64] and r["scale"] > 0.1
    assert r["err"] < (2e-5 if dtype == "float32" else 4e-3) * max(1.0, r["scale"])


def test_misuse_raises_named_errors(results):
    assert "int64" in results["bad_ids"]
    assert "shapes disagree" in results["bad_shape"]


_TOP_K_CHILD = r"""
import json, sys
import torch
from modeling.ops import moe_ref as ref
from modeling.ops import triton_moe_pairs as tp

H, I, E = 64, 32, 8
out = {}
for k in json.loads(sys.argv[1]):
    for n in (1, 2):
        g = torch.Generator().manual_seed(n + 10 * k)
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(n)])
        w = torch.rand(n, k, generator=g)
        w = w / w.sum(-1, keepdim=True)
        x = torch.randn(n, H, generator=g)
        w13 = torch.randn(E, 2 * I, H, generator=g) / H ** 0.5
        w2 = torch.randn(E, H, I, generator=g) / I ** 0.5
        want = ref.experts_static(x, ids, w, w13, w2, 0)
        got = tp.pair_experts(x, ids, w, w13, w2)
        out[f"{k} {n}"] = {"err": (got - want).abs().max().item(), "scale": want.abs().max().item()}
print("RESULT" + json.dumps(out))
"""


def test_pair_by_pair_path_takes_any_top_k():
    """top-1 and top-k that are not powers of two (the down kernel pads the token's pairs to a power of two)."""
    res = run_interpreted(_TOP_K_CHILD, [1, 3, 6], timeout_s=300)
    assert sorted(res) == ["1 1", "1 2", "3 1", "3 2", "6 1", "6 2"]
    for case, r in res.items():
        assert r["scale"] > 0.1 and r["err"] < 2e-5 * max(1.0, r["scale"]), (case, r)
