"""The MoE block's routing and expert grouping in one launch (`modeling/ops/triton_moe_route.py`) under the Triton
CPU interpreter (TRITON_INTERPRET=1), against the two launches it replaces (`triton_router.route_topk`, then
`triton_moe.group_by_expert`) on the same logits: the weights and ids bitwise (the same routing code and warps),
the per-expert counts and the grouped pair order exactly; and `route_and_run_experts` (fp32, the interpreter's
`tl.dot` is exact there) bitwise equal to `routed_experts` over `route_topk`'s choice. Steps of 1-8 tokens take the
one launch where one program holds the step (1024 logits: 8 tokens of 128 experts, 64 of 16) and one grouping chunk
its pairs (128), larger ones the two; E 16, 60 (not a power of two), 128, 256; k 1, 3 (not a power of two), 4, 8;
renormalised or not; a padded logits row stride."""
import pytest

from tests.unit._interpret import run_interpreted

pytest.importorskip("triton", reason="needs triton (the Triton CPU interpreter runs its kernels)")

# (N, E, k, renormalize, strided)
CASES = [(1, 128, 8, True, False), (2, 128, 8, True, False), (5, 128, 8, False, False), (8, 128, 8, True, True),
         (3, 60, 3, True, False), (7, 16, 1, False, False), (4, 16, 3, True, True), (8, 256, 8, True, False),
         (9, 128, 8, True, False), (20, 16, 4, False, False), (40, 16, 4, True, False)]

_CHILD = r"""
import json, sys
import torch
from modeling.ops import triton_moe, triton_moe_route
from modeling.ops.triton_router import route_topk

out = {}
for n, e, k, renorm, strided in json.loads(sys.argv[1]):
    g = torch.Generator().manual_seed(n * 100 + e + k)
    padded = torch.randn(n, e + 3, generator=g) * 2
    logits = padded[:, :e] if strided else padded[:, :e].contiguous()
    w, i, srt, cnt = triton_moe_route.route_and_group(logits, k, renorm)
    rw, ri = route_topk(logits, k, renorm)
    rsrt, rcnt = triton_moe.group_by_expert(ri, e, 0)
    h, inter = 16, 8
    x = torch.randn(n, h, generator=g)
    w13 = torch.randn(e, 2 * inter, h, generator=g) / 4
    w2 = torch.randn(e, h, inter, generator=g) / 3
    y = triton_moe_route.route_and_run_experts(x, logits, k, renorm, w13, w2)
    ry = triton_moe.routed_experts(x, ri, rw, w13, w2)
    out[f"{n} {e} {k} {renorm} {strided}"] = {
        "fused": triton_moe_route.fused_route_group_applies(n, e, k),
        "weights": torch.equal(w, rw), "ids": torch.equal(i, ri), "counts": torch.equal(cnt, rcnt),
        "sorted": torch.equal(srt, rsrt), "count_sum": int(cnt.sum()), "experts": torch.equal(y, ry),
        "y_shape": list(y.shape)}
try:
    triton_moe_route.route_and_run_experts(torch.zeros(2, 16), torch.zeros(3, 8), 2, True,
                                           torch.zeros(8, 16, 16), torch.zeros(8, 16, 8))
    out["bad_logits"] = "no error"
except ValueError as err:
    out["bad_logits"] = str(err)
print("RESULT" + json.dumps(out))
"""


@pytest.fixture(scope="module")
def results() -> dict:
    return run_interpreted(_CHILD, CASES)


def _one_launch(n: int, e: int, k: int) -> bool:
    e_pad = 1 << (e - 1).bit_length()
    return n <= 1024 // e_pad and n * k <= 128


@pytest.mark.parametrize("n,e,k,renorm,strided", CASES)
def test_one_launch_routes_and_groups_as_the_two_launches(results, n, e, k, renorm, strided):
    r = results[f"{n} {e} {k} {renorm} {strided}"]
    assert r["fused"] == _one_launch(n, e, k)
    assert r["weights"] and r["ids"], r
    assert r["counts"] and r["count_sum"] == n * k and r["sorted"], r
    assert r["experts"] and r["y_shape"] == [n, 16], r


def test_which_steps_take_one_launch(results):
    fused = {key: r["fused"] for key, r in results.items() if isinstance(r, dict)}
    assert fused["1 128 8 True False"] and fused["8 128 8 True True"] and fused["20 16 4 False False"]
    assert not fused["9 128 8 True False"]  # 9 rows of 128 experts: two routing programs
    assert not fused["8 256 8 True False"]  # 8 x 256 logits: more than one program holds
    assert not fused["40 16 4 True False"]  # 160 pairs: two grouping chunks
    assert "router_logits (3, 8) must be [2, 8]" in results["bad_logits"]
