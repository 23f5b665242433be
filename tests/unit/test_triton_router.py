"""The one-launch MoE router (`modeling/ops/triton_router.py`) under the Triton CPU interpreter (TRITON_INTERPRET=1).

One child process runs `route_topk` interpreted and the torch `modeling.moe.route` on the same logits; this process
compares. N 0, 1, 7, 64; E 8, 60 (not a power of two), 128; k 1, 2, 8; renormalised or not; fp32 and bf16 logits,
contiguous and with a padded row stride (`VARIANTS`). Weights within 1e-6 relative of `route`'s; ids equal to a stable descending
sort of the probabilities (ties to the lower id) and to `route`'s wherever the row's top k + 1 probabilities are
distinct. Ties: equal logits pick the lowest ids. The MoE block takes the kernel when its ops have `moe_route`.
"""
import pytest

from tests.unit._interpret import run_interpreted

pytest.importorskip("triton", reason="needs triton (the Triton CPU interpreter runs its kernels)")

TOKENS = (0, 1, 7, 64)
EXPERTS = (8, 60, 128)
TOP_K = (1, 2, 8)
# (dtype, renormalize, strided): every (N, E, k) for the first; the others at N <= 7 (the interpreter's bitonic top-k
# costs seconds at 64 rows of 128 experts, and they change nothing that depends on N)
VARIANTS = (("float32", True, False), ("bfloat16", True, False), ("float32", False, False), ("float32", True, True),
            ("bfloat16", False, True))
CASES = [(dt, n, e, k, renorm, strided) for dt, renorm, strided in VARIANTS for n in TOKENS for e in EXPERTS
         for k in TOP_K if n <= 7 or (dt, renorm, strided) == VARIANTS[0]]

_CHILD = r"""
import dataclasses, json, sys
import torch
from modeling import moe
from modeling.config import get_preset
from modeling.ops import get_kernel_ops
from modeling.ops.triton_router import route_topk
from parallel.context import ParallelContext

def compare(logits, k, renorm):
    w, i = route_topk(logits, k, renorm)
    rw, ri = moe.route(logits, k, renorm)
    probs = torch.softmax(logits.float(), dim=-1)
    stable = torch.sort(probs, dim=-1, descending=True, stable=True)
    distinct = [len(set(r)) == len(r) for r in stable.values[:, : k + 1].tolist()]
    rel = ((w - rw).abs() / rw.abs().clamp_min(1e-30)).max().item() if w.numel() else 0.0
    return {"shape": [list(w.shape), list(i.shape)], "dtypes": [str(w.dtype), str(i.dtype)], "rel": rel,
            "ids_stable": torch.equal(i, stable.indices[:, :k]),
            "ids_route": all(torch.equal(a, b) for a, b, d in zip(i, ri, distinct) if d),
            "rows_distinct": sum(distinct)}

out = {}
for dt, n, e, k, renorm, strided in json.loads(sys.argv[1]):
    g = torch.Generator().manual_seed(n * 1000 + e)
    padded = (torch.randn(n, e + 5, generator=g) * 3).to(getattr(torch, dt))
    logits = padded[:, :e] if strided else padded[:, :e].contiguous()
    assert n < 2 or logits.stride(0) == (e + 5 if strided else e)
    out[f"{dt} {n} {e} {k} {renorm} {strided}"] = compare(logits, k, renorm)
# ties: every logit equal, and a row whose top values repeat at scattered ids
w, i = route_topk(torch.zeros(3, 60), 8, True)
out["tie_equal"] = {"ids": i.tolist(), "w": w.tolist()}
row = torch.full((1, 16), -1.0)
row[0, [11, 3, 7]] = 2.0
row[0, [14, 5]] = 1.0
w, i = route_topk(row, 4, False)
out["tie_scattered"] = {"ids": i.tolist()}

# the MoE block routes through ops.moe_route when it has one (the real kernel, counted)
calls = []
def counted(logits, k, renorm):
    calls.append((tuple(logits.shape), k, renorm))
    return route_topk(logits, k, renorm)
cfg = get_preset("qwen3-moe-tiny")
ops = dataclasses.replace(get_kernel_ops("cpu"), moe_route=counted)
kernel_block, torch_block = moe.SparseMoeBlock(cfg, ParallelContext(), ops=ops), moe.SparseMoeBlock(cfg, ParallelContext())
g = torch.Generator().manual_seed(3)
for p, q in zip((kernel_block.gate.weight, kernel_block.w13, kernel_block.w2),
                (torch_block.gate.weight, torch_block.w13, torch_block.w2)):
    p.data.copy_(torch.randn(p.shape, generator=g) * 0.1)
    q.data.copy_(p.data)
x = torch.randn(5, cfg.hidden_size, generator=g)
with torch.inference_mode():
    got, want = kernel_block(x), torch_block(x)
out["block"] = {"calls": calls, "err": (got - want).abs().max().item(), "scale": want.abs().max().item(),
                "torch_block_kernel": torch_block.route_kernel is None}
print("RESULT" + json.dumps(out))
"""


@pytest.fixture(scope="module")
def results() -> dict:
    return run_interpreted(_CHILD, CASES, timeout_s=300)


@pytest.mark.parametrize("dtype, n, e, k, renorm, strided", CASES)
def test_route_topk_equals_route(results, dtype, n, e, k, renorm, strided):
    r = results[f"{dtype} {n} {e} {k} {renorm} {strided}"]
    assert r["shape"] == [[n, k], [n, k]] and r["dtypes"] == ["torch.float32", "torch.int64"], r
    assert r["rel"] <= 1e-6, r
    assert r["ids_stable"] and r["ids_route"], r


def test_random_fp32_rows_have_no_ties_so_route_ids_are_compared(results):
    assert results["float32 64 128 8 True False"]["rows_distinct"] == 64


def test_ties_go_to_the_lowest_expert_ids(results):
    tie = results["tie_equal"]
    assert tie["ids"] == [list(range(8))] * 3
    assert all(abs(w - 1 / 8) < 1e-7 for row in tie["w"] for w in row)
    assert results["tie_scattered"]["ids"] == [[3, 7, 11, 5]]


def test_moe_block_routes_with_the_backend_kernel(results):
    b = results["block"]
    assert b["calls"] == [[[5, 8], 2, True]] and b["torch_block_kernel"]
    assert b["err"] <= 1e-6 * max(1.0, b["scale"]) and b["scale"] > 0, b
