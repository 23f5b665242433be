"""The pair path of the routed experts (`modeling/ops/triton_moe_pairs.py`) under the Triton CPU interpreter.

One child process runs `routed_experts` both ways on the same inputs, the pair path (`pair_max_tokens=n`) and the
grouped path (`pair_max_tokens=0`), and the torch reference (`modeling/ops/moe_ref.py`); this process compares.
Shapes H=64, I=48 (not a multiple of the tiles), E=8, top-3, 1, 3 and 9 tokens; fp32, fp16 and bf16 (the pair kernels
use no `tl.dot`, so the interpreter runs bf16 too). Routings: uniform, every token on one expert, EP (this rank
holds experts 8..15 of 16; some slots -1) and a batch where no pair is local.
"""

import pytest

from tests.unit._interpret import run_interpreted

pytest.importorskip("triton", reason="needs triton (the Triton CPU interpreter runs its kernels)")

ROUTINGS = ("uniform", "one_expert", "ep", "none_local")
TOKENS = (1, 3, 9)
DTYPES = ("float32", "float16", "bfloat16")

_CHILD = r"""
import json, sys
import torch
from modeling.ops import moe_ref as ref
from modeling.ops import triton_moe as tm
from modeling.ops import triton_moe_pairs as tp

H, I, E, K = 64, 48, 8, 3
out = {}

def routing(kind, n, g):
    if kind == "uniform":
        return torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(n)]), 0
    if kind == "one_expert":
        return torch.stack([torch.full((n,), 3), torch.full((n,), 6), torch.full((n,), 0)], 1), 0
    if kind == "ep":
        ids = torch.stack([torch.randperm(2 * E, generator=g)[:K] for _ in range(n)])
        ids[torch.rand(n, K, generator=g) < 0.2] = -1
        ids[0, 0] = E + 1  # at least one local pair
        return ids, E
    if kind == "none_local":
        return torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(n)]), E
    raise ValueError(kind)

for dtype_name in json.loads(sys.argv[3]):
    dtype = getattr(torch, dtype_name)
    for kind in json.loads(sys.argv[1]):
        for n in json.loads(sys.argv[2]):
            g = torch.Generator().manual_seed(n * 31 + len(kind))
            ids, first = routing(kind, n, g)
            ids = ids.long()
            w = torch.rand(n, K, generator=g) + 0.1
            w = w / w.sum(-1, keepdim=True)
            x = torch.randn(n, H, generator=g).to(dtype)
            w13 = (torch.randn(E, 2 * I, H, generator=g) / H ** 0.5).to(dtype)
            w2 = (torch.randn(E, H, I, generator=g) / I ** 0.5).to(dtype)
            pair = tm.routed_experts(x, ids, w, w13, w2, first, pair_max_tokens=n)
            small = tp.pair_experts(x, ids, w, w13, w2, first, config=tp.PairConfig(16, 16, 8, 16))
            want = ref.experts_static(x, ids, w, w13, w2, first)
            r = {"shape": list(pair.shape), "dtype": str(pair.dtype), "finite": bool(torch.isfinite(pair).all()),
                 "err": (pair.float() - want.float()).abs().max().item(),
                 "small_tiles_err": (small.float() - want.float()).abs().max().item(),
                 "scale": want.float().abs().max().item(),
                 "zero_rows_zero": bool((pair[(ids - first).lt(0).logical_or((ids - first).ge(E)).all(1)] == 0).all())}
            if dtype != torch.bfloat16:  # the grouped path's tl.dot: not in bf16 under the interpreter
                grouped = tm.routed_experts(x, ids, w, w13, w2, first, pair_max_tokens=0)
                r["grouped_err"] = (grouped.float() - want.float()).abs().max().item()
                r["pair_vs_grouped"] = (pair.float() - grouped.float()).abs().max().item()
            out[f"{dtype_name} {kind} {n}"] = r
print("RESULT" + json.dumps(out))
"""

TOL = {"float32": 2e-5, "float16": 4e-3, "bfloat16": 3e-2}


@pytest.fixture(scope="module")
def results() -> dict:
    return run_interpreted(_CHILD, ROUTINGS, TOKENS, DTYPES, timeout_s=600)


@pytest.mark.parametrize("n", TOKENS)
@pytest.mark.parametrize("kind", ROUTINGS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_pair_path_equals_the_reference(results, dtype, kind, n):
    r = results[f"{dtype} {kind} {n}"]
    assert r["shape"] == [n, 64] and r["dtype"] == f"torch.{dtype}" and r["finite"] and r["zero_rows_zero"]
    tol = TOL[dtype] * max(1.0, r["scale"])
    assert r["err"] < tol and r["small_tiles_err"] < tol, r
    if kind == "none_local":
        assert r["scale"] == 0.0  # every output row is zero
    else:
        assert r["scale"] > 0.05  # the case computes something


@pytest.mark.parametrize("n", TOKENS)
@pytest.mark.parametrize("kind", ROUTINGS)
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_pair_path_equals_the_grouped_path(results, dtype, kind, n):
    r = results[f"{dtype} {kind} {n}"]
    tol = TOL[dtype] * max(1.0, r["scale"])
    assert r["grouped_err"] < tol and r["pair_vs_grouped"] < tol, r
