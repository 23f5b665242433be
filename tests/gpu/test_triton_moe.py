"""The routed-expert MoE kernels (`modeling/ops/triton_moe.py`) on the GPU: equal to the torch reference
(`modeling/ops/moe_ref.py`) in bf16 and fp32 at 1..2048 tokens on the Qwen3-30B-A3B layer shape and a small one,
eager and inside a CUDA graph replayed with new inputs and new routing (one graph serves every expert load, and
its replay equals the eager call bitwise); the EP layout (other ranks' experts and -1 slots contribute zero); the
packed DeepEP layout; and greedy tokens of qwen3-moe-small through the rank's decode graphs equal to the torch
reference path for 64 steps."""
import numpy as np
import pytest
import torch

from tests.gpu.helpers import Seqs, make_runtime, random_tokens

pytestmark = pytest.mark.gpu

# (H, I, E, top_k)
SHAPES = {"qwen3-30b-a3b": (2048, 768, 128, 8), "small": (256, 128, 16, 4)}
TOKENS = (1, 2, 8, 64, 256, 512, 2048)
ROUTINGS = ("uniform", "one_expert", "skewed", "holes")


def _weights(shape, dtype, seed=0):
    h, i, e, _ = shape
    g = torch.Generator(device="cuda").manual_seed(seed)
    w13 = (torch.randn(e, 2 * i, h, device="cuda", generator=g) / h ** 0.5).to(dtype)
    w2 = (torch.randn(e, h, i, device="cuda", generator=g) / i ** 0.5).to(dtype)
    return w13, w2


def _inputs(shape, n, dtype, kind="uniform", seed=0, num_experts=None):
    """x `[n, H]`, distinct top-k ids per token (int64) and renormalised fp32 weights, by routing kind."""
    h, _, e, k = shape
    e = num_experts or e
    g = torch.Generator(device="cuda").manual_seed(seed * 7919 + n)
    x = torch.randn(n, h, device="cuda", generator=g).to(dtype)
    scores = torch.rand(n, e, device="cuda", generator=g)
    if kind == "one_expert":  # every token's first slot on one expert
        scores[:, 5] = 2.0
    elif kind == "skewed":  # most tokens on the first quarter of the experts
        scores[:, : max(k, e // 4)] += 1.0
    ids = scores.topk(k, dim=-1).indices
    if kind == "holes":  # dispatch padding: some slots routed nowhere
        ids = torch.where(torch.rand(n, k, device="cuda", generator=g) < 0.2, torch.full_like(ids, -1), ids)
    w = torch.rand(n, k, device="cuda", generator=g) + 0.1
    return x, ids.long(), (w / w.sum(-1, keepdim=True)).float()


def _reference(x, ids, w, w13, w2, first=0):
    from modeling.ops import moe_ref

    return moe_ref.experts_grouped(x, ids, w, w13, w2, first)


def _close(got, want, dtype):
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    else:
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("n", TOKENS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", list(SHAPES))
def test_routed_matches_reference(name, dtype, n):
    from modeling.ops.triton_moe import routed_experts

    shape = SHAPES[name]
    w13, w2 = _weights(shape, dtype)
    x, ids, w = _inputs(shape, n, dtype)
    got = routed_experts(x, ids, w, w13, w2)
    assert got.shape == x.shape and got.dtype == dtype
    _close(got, _reference(x, ids, w, w13, w2), dtype)


@pytest.mark.parametrize("n", TOKENS)
@pytest.mark.parametrize("name", list(SHAPES))
def test_graph_replay_serves_new_routing_and_equals_eager_bitwise(name, n):
    from modeling.ops.triton_moe import routed_experts

    shape, dtype = SHAPES[name], torch.bfloat16
    w13, w2 = _weights(shape, dtype, seed=1)
    x, ids, w = _inputs(shape, n, dtype)
    routed_experts(x, ids, w, w13, w2)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = routed_experts(x, ids, w, w13, w2)
    for seed, kind in enumerate(ROUTINGS):
        x2, ids2, w2_ = _inputs(shape, n, dtype, kind, seed=seed + 10)
        x.copy_(x2), ids.copy_(ids2), w.copy_(w2_)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, routed_experts(x, ids, w, w13, w2)), kind
        _close(y, _reference(x, ids, w, w13, w2), dtype)


@pytest.mark.parametrize("n", [1, 64, 512])
def test_fp32_graph_replay(n):
    from modeling.ops.triton_moe import routed_experts

    shape, dtype = SHAPES["small"], torch.float32
    w13, w2 = _weights(shape, dtype, seed=2)
    x, ids, w = _inputs(shape, n, dtype)
    routed_experts(x, ids, w, w13, w2)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = routed_experts(x, ids, w, w13, w2)
    for seed, kind in enumerate(ROUTINGS):
        x2, ids2, w2_ = _inputs(shape, n, dtype, kind, seed=seed + 20)
        x.copy_(x2), ids.copy_(ids2), w.copy_(w2_)
        graph.replay()
        _close(y, _reference(x, ids, w, w13, w2), dtype)


@pytest.mark.parametrize("n", [1, 8, 256, 512])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_ep_layout_only_local_experts_count(dtype, n):
    """EP rank 1 of 2 (experts 64..127 of 128): gathered rows of both ranks, pairs routed to rank 0's experts and
    -1 slots contribute zero; a token with no local expert gets exact zeros."""
    from modeling.ops.triton_moe import routed_experts

    shape = SHAPES["qwen3-30b-a3b"]
    w13, w2 = _weights(shape, dtype, seed=3)
    local13, local2 = w13[64:].contiguous(), w2[64:].contiguous()
    x, ids, w = _inputs(shape, 2 * n, dtype, "holes", seed=4)
    ids[0] = torch.arange(shape[3], device="cuda")  # token 0 only on rank 0's experts
    got = routed_experts(x, ids, w, local13, local2, first_expert=64)
    _close(got, _reference(x, ids, w, local13, local2, first=64), dtype)
    assert torch.equal(got[0], torch.zeros_like(got[0]))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = routed_experts(x, ids, w, local13, local2, first_expert=64)
    x2, ids2, w2_ = _inputs(shape, 2 * n, dtype, "skewed", seed=5)
    x.copy_(x2), ids.copy_(ids2), w.copy_(w2_)
    graph.replay()
    _close(y, _reference(x, ids, w, local13, local2, first=64), dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_packed_layout_eager_and_replayed_with_new_counts(dtype):
    from modeling.ops import moe_ref
    from modeling.ops.triton_moe import packed_experts

    h, i, _, _ = SHAPES["qwen3-30b-a3b"]
    e_local, cap = 16, 2 * 128  # EP 8 of 128 experts, 128 tokens per rank, 2 ranks' worth
    w13, w2 = _weights((h, i, e_local, 1), dtype, seed=6)
    g = torch.Generator(device="cuda").manual_seed(6)
    x = torch.randn(e_local, cap, h, device="cuda", generator=g).to(dtype)
    counts = torch.randint(0, cap + 1, (e_local,), device="cuda", generator=g, dtype=torch.int32)
    counts[0], counts[1], counts[2] = 0, cap, 1

    def check(y):
        want = moe_ref.packed_experts(x, counts, w13, w2)
        rows = torch.arange(cap, device="cuda")[None, :] < counts[:, None]
        _close(y[rows], want[rows], dtype)

    check(packed_experts(x, counts, w13, w2))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = packed_experts(x, counts, w13, w2)
    for seed in range(3):
        x.copy_(torch.randn(x.shape, device="cuda", generator=g).to(dtype))
        counts.copy_(torch.randint(0, cap + 1, (e_local,), device="cuda", generator=g, dtype=torch.int32))
        counts[seed] = 0
        graph.replay()
        check(y)


def _greedy(rt, prompts: list[list[int]], steps: int) -> tuple[list[list[int]], int]:
    """Prefill, then `steps - 1` decode steps through `rt.runner`; returns (tokens per prompt, decode steps the runner
    served from full decode graphs)."""
    seqs = Seqs(rt)
    tables = [seqs.new(len(p) + steps + 1) for p in prompts]
    before = rt.runner.stats.snapshot()["steps"].get("full_graph", 0)
    step = seqs.step(prompts, [0] * len(prompts), tables)
    out = [[t] for t in rt.model.greedy_tokens(rt.runner(step), step.attn_metadata.last_token_index).tolist()]
    hist = [len(p) for p in prompts]
    for _ in range(steps - 1):
        step = seqs.step([[o[-1]] for o in out], hist, tables)
        toks = rt.model.greedy_tokens(rt.runner(step), step.attn_metadata.last_token_index).tolist()
        for o, t in zip(out, toks):
            o.append(t)
        hist = [x + 1 for x in hist]
    return out, rt.runner.stats.snapshot()["steps"].get("full_graph", 0) - before


@torch.inference_mode()
def test_moe_decode_graphs_greedy_equal_torch_reference_64_steps():
    """qwen3-moe-small (bf16, 64 experts, top-8): the routed kernels inside the rank's captured decode graphs give
    the torch reference path's greedy tokens (static experts, torch operators, eager) for 64 steps."""
    from actors.rank import RankRuntime, RuntimeConfig
    from graphrunner.config import GraphRunnerConfig
    from parallel.context import ParallelContext

    rt = make_runtime("qwen3-moe-small", max_decode_batch=8, pcg_max_tokens=0)
    assert rt.model.layers[0].mlp.routed_kernel is not None
    ref_cfg = RuntimeConfig(model="qwen3-moe-small", device="cuda", num_kv_blocks=512, max_model_len=4096,
                            kernel_backend="torch", graph=GraphRunnerConfig(eager_mode=True, max_decode_batch=8,
                                                                            pcg_max_tokens=0))
    ref = RankRuntime(ref_cfg, ParallelContext(), torch.device("cuda", 0))
    ref.load_model()
    ref.allocate_kv_cache()
    ref.build_runner()
    assert ref.model.layers[0].mlp.routed_kernel is None
    rng = np.random.default_rng(3)
    prompts = [random_tokens(rng, n, rt.model_config.vocab_size) for n in (17, 64, 130)]
    got, graph_steps = _greedy(rt, prompts, 64)
    want, ref_graph_steps = _greedy(ref, prompts, 64)
    assert graph_steps == 63 and ref_graph_steps == 0
    assert got == want
