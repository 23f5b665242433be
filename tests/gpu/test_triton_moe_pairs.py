"""The pair-by-pair routed experts (`modeling/ops/triton_moe_pairs.py`) on the GPU: bitwise equal to the grouped
kernels (`triton_moe.routed_experts`) at 1-8 tokens in bf16 and fp32, for every routing kind, the EP layout and any
launch config; replayed from a CUDA graph with new inputs and routing, under each PDL mode; and
`routed_experts_by_size` takes it exactly up to `pairs_max` pairs."""
import pytest
import torch

from tests.gpu.test_triton_moe import ROUTINGS, SHAPES, _close, _inputs, _reference, _replays, _weights

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("n", [1, 2, 3, 8])
@pytest.mark.parametrize("kind", ROUTINGS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", list(SHAPES))
def test_pairs_equal_the_grouped_kernels_bitwise(name, dtype, kind, n):
    from modeling.ops.triton_moe import routed_experts
    from modeling.ops.triton_moe_pairs import pair_experts

    shape = SHAPES[name]
    w13, w2 = _weights(shape, dtype, seed=11)
    x, ids, w = _inputs(shape, n, dtype, kind, seed=12)
    got = pair_experts(x, ids, w, w13, w2)
    assert got.shape == x.shape and got.dtype == dtype
    assert torch.equal(got, routed_experts(x, ids, w, w13, w2))
    _close(got, _reference(x, ids, w, w13, w2), dtype)


@pytest.mark.parametrize("c13,c2", [((32, 64, 4, 3), (32, 32, 2, 3)), ((64, 128, 4, 3), (32, 64, 4, 3)),
                                    ((16, 128, 2, 4), (16, 32, 2, 4))])
def test_pair_launch_configs_do_not_change_the_bits(c13, c2):
    """The tuning sweep may pick any tile: the K order (16-wide MMA steps) and the roundings stay the same."""
    from modeling.ops.triton_moe import MoeGemmConfig, routed_experts
    from modeling.ops.triton_moe_pairs import pair_experts

    shape, dtype = SHAPES["qwen3-30b-a3b"], torch.bfloat16
    w13, w2 = _weights(shape, dtype, seed=13)
    for n in (1, 2):
        x, ids, w = _inputs(shape, n, dtype, seed=14)
        configs = (MoeGemmConfig(16, *c13), MoeGemmConfig(16, *c2))
        assert torch.equal(pair_experts(x, ids, w, w13, w2, configs=configs), routed_experts(x, ids, w, w13, w2))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_pairs_ep_layout_only_local_experts_count(dtype):
    """EP rank 1 of 2 (experts 64..127): pairs on rank 0's experts and -1 slots add nothing; a token with no local
    expert gets exact zeros; bits equal the grouped kernels'."""
    from modeling.ops.triton_moe import routed_experts
    from modeling.ops.triton_moe_pairs import pair_experts

    shape = SHAPES["qwen3-30b-a3b"]
    w13, w2 = _weights(shape, dtype, seed=15)
    local13, local2 = w13[64:].contiguous(), w2[64:].contiguous()
    x, ids, w = _inputs(shape, 2, dtype, "holes", seed=16)
    ids[0] = torch.arange(shape[3], device="cuda")  # token 0 only on rank 0's experts
    got = pair_experts(x, ids, w, local13, local2, first_expert=64)
    assert torch.equal(got[0], torch.zeros_like(got[0]))
    assert torch.equal(got, routed_experts(x, ids, w, local13, local2, first_expert=64))
    _close(got, _reference(x, ids, w, local13, local2, first=64), dtype)


@pytest.mark.parametrize("pdl_mode", [0, 1, 2])
@pytest.mark.parametrize("n", [1, 2])
def test_pairs_graph_replay_serves_new_routing(n, pdl_mode):
    from modeling.ops import pdl
    from modeling.ops.triton_moe import routed_experts
    from modeling.ops.triton_moe_pairs import pair_experts

    if pdl_mode and not pdl.pdl_supported(torch.device("cuda", 0)):
        pytest.skip("PDL needs sm_90+")
    shape, dtype = SHAPES["qwen3-30b-a3b"], torch.bfloat16
    w13, w2 = _weights(shape, dtype, seed=17)
    x, ids, w = _inputs(shape, n, dtype)
    for kind, y in _replays(lambda *a: pair_experts(*a, w13, w2, pdl=pdl_mode), x, ids, w, shape, dtype, seed=30):
        assert torch.equal(y, routed_experts(x, ids, w, w13, w2)), kind


def test_by_size_takes_pairs_exactly_up_to_pairs_max(monkeypatch):
    from modeling.ops import triton_moe_pairs

    calls = []
    real = triton_moe_pairs.pair_experts
    monkeypatch.setattr(triton_moe_pairs, "pair_experts", lambda *a, **k: calls.append(a[1].shape[0]) or real(*a, **k))
    shape, dtype = SHAPES["qwen3-30b-a3b"], torch.bfloat16
    w13, w2 = _weights(shape, dtype, seed=18)
    for n in (1, 2, 3):
        x, ids, w = _inputs(shape, n, dtype, seed=19)
        for pairs_max in (0, 8, 16):
            got = triton_moe_pairs.routed_experts_by_size(x, ids, w, w13, w2, pairs_max=pairs_max)
            _close(got, _reference(x, ids, w, w13, w2), dtype)
    assert calls == [1, 1, 2]  # n * 8 pairs <= pairs_max: (1, 8), (1, 16), (2, 16)
