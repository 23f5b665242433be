"""The model's norm-first layout (each residual add + RMSNorm in the prologue of the projection after it, used at
1-2 tokens with the Triton GEMV) computes the same operators in the same order as the default layout (the add +
norm after the projection before it): on the torch backend the two give the same bits, for dense and MoE layers,
prefill and decode, with a paged KV cache written by each layout alike."""
import dataclasses

import pytest
import torch

from modeling.attn_metadata import SequenceSlice, build_step
from modeling.config import get_preset
from modeling.kv_cache import KVCacheSpec, PagedKVCache
from modeling.loader import init_random
from modeling.ops import get_kernel_ops
from modeling.qwen3 import Qwen3ForCausalLM

BS = 4


@pytest.fixture(scope="module", params=["qwen3-tiny", "qwen3-moe-tiny"])
def preset(request):
    torch.set_num_threads(2)
    return request.param


def _model(preset: str, norm_first: bool, calls: list | None = None) -> Qwen3ForCausalLM:
    ops = get_kernel_ops("cpu")
    assert ops.prologue_norm_max_tokens == 0  # the torch backend keeps the default layout unless told
    if norm_first:
        def counted(*args, _fn=ops.norm_linear, **kwargs):
            calls.append(kwargs.get("gated", False))
            return _fn(*args, **kwargs)

        def counted_normed(*args, _fn=ops.norm_linear_normed):
            calls.append("router")
            return _fn(*args)

        ops = dataclasses.replace(ops, prologue_norm_max_tokens=1 << 20, norm_linear=counted,
                                  norm_linear_normed=counted_normed)
    m = Qwen3ForCausalLM(get_preset(preset), ops=ops)
    init_random(m, seed=5)
    return m


def _run(model: Qwen3ForCausalLM, steps: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    cache = PagedKVCache(KVCacheSpec.for_model(model.config, 32, block_size=BS), "cpu")
    prompt, table = [3, 17, 250, 9, 41, 8], list(range(1, 9))
    ids, pos, meta = build_step([SequenceSlice(prompt, 0, table)], BS, "cpu")
    logits = []
    seq = list(prompt)
    with torch.no_grad():
        hidden = model(ids, pos, cache.layers, meta)
        logits.append(model.compute_logits(hidden, meta.last_token_index))
        for _ in range(steps):
            nxt = int(logits[-1].argmax(-1)[0])
            seq.append(nxt)
            ids, pos, meta = build_step([SequenceSlice([nxt], len(seq) - 1, table)], BS, "cpu")
            logits.append(model.compute_logits(model(ids, pos, cache.layers, meta), meta.last_token_index))
    return hidden, logits


def test_norm_first_layout_gives_the_same_bits(preset):
    base_hidden, base = _run(_model(preset, False), 6)
    calls: list = []
    hidden, got = _run(_model(preset, True, calls), 6)
    layers = get_preset(preset).num_layers
    dense = sum(not get_preset(preset).layer_is_moe(i) for i in range(layers))
    # per forward: every layer's qkv, every dense layer's gate_up, every MoE layer's router (keeping the normed rows)
    assert len(calls) == 7 * (2 * layers)
    assert calls.count(True) == 7 * dense and calls.count("router") == 7 * (layers - dense)
    assert torch.equal(hidden, base_hidden)
    assert len(got) == len(base) == 7
    for a, b in zip(got, base):
        assert torch.equal(a, b)
    assert not torch.equal(base[1], base[2])  # the steps differ: the comparison is not of constants


def test_norm_linear_reference_matches_its_definition():
    from modeling.ops import fused_ref

    ops = get_kernel_ops("cpu")
    g = torch.Generator().manual_seed(0)
    x, r = torch.randn(3, 16, generator=g), torch.randn(3, 16, generator=g)
    nw, w = torch.randn(16, generator=g), torch.randn(10, 16, generator=g)
    y, s = ops.norm_linear(x, r, nw, 1e-6, w)
    normed, summed = fused_ref.add_rms_norm(x, r, nw, 1e-6)
    assert torch.equal(s, summed) and torch.equal(y, normed @ w.T)
    y, s = ops.norm_linear(x, None, nw, 1e-6, w, gated=True)
    assert s is x and torch.equal(y, fused_ref.silu_and_mul(fused_ref.rms_norm(x, nw, 1e-6) @ w.T))


@pytest.mark.parametrize("tp_size,per_token", [(1, 5), (2, 4)])
def test_projection_warm_up_calls_cover_each_decode_projection(preset, tp_size, per_token):
    """One call per projection of the decode layout for 1..prologue_norm_max_tokens tokens, over this rank's
    shapes; every call runs (here on the reference operators, which is what makes the shapes line up)."""
    from modeling.qwen3 import config_projection_warm_up_calls
    from parallel.context import ParallelContext

    cfg = get_preset(preset)
    ops = get_kernel_ops("cpu")
    assert config_projection_warm_up_calls(cfg, ParallelContext(), ops, torch.device("cpu")) == []
    seen = []

    def counted(name):
        fn = getattr(ops, name)
        return lambda *a, **k: seen.append((name, a[0].shape[0])) or fn(*a, **k)

    ops = dataclasses.replace(ops, moe_router_linear=torch.nn.functional.linear)  # a backend with a router GEMV
    ops = dataclasses.replace(ops, prologue_norm_max_tokens=2, linear=counted("linear"),
                              norm_linear=counted("norm_linear"), silu_mul_linear=counted("silu_mul_linear"),
                              norm_linear_normed=counted("norm_linear_normed"),
                              moe_router_linear=counted("moe_router_linear"))
    calls = config_projection_warm_up_calls(cfg, ParallelContext(tp_rank=tp_size - 1, tp_size=tp_size), ops,
                                            torch.device("cpu"))
    dense = any(not cfg.layer_is_moe(i) for i in range(cfg.num_layers))
    sparse = any(cfg.layer_is_moe(i) for i in range(cfg.num_layers))
    assert len(calls) == 2 * ((per_token if dense else 3 if tp_size == 1 else 2) + sparse)
    for call in calls:
        call()
    assert sorted({t for _, t in seen}) == [1, 2] and len(seen) == len(calls)
    names = {"linear", "norm_linear"} if tp_size == 1 else {"linear", "silu_mul_linear"} if dense else {"linear"}
    if sparse:  # the router: its add + norm prologue keeping the normed rows at TP = 1, the plain GEMV under TP
        names.add("norm_linear_normed" if tp_size == 1 else "moe_router_linear")
    assert {name for name, _ in seen} == names
    off = dataclasses.replace(ops, options=dataclasses.replace(ops.options, moe_router_gemv=False))
    assert len(config_projection_warm_up_calls(cfg, ParallelContext(), off, torch.device("cpu"))) == \
        2 * ((5 if dense else 3) + 0)
