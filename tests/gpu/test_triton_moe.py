"""The routed-expert MoE kernels (`modeling/ops/triton_moe.py`) on the GPU: equal to the torch reference
(`modeling/ops/moe_ref.py`) in bf16 and fp32 at 1..2048 tokens on the Qwen3-30B-A3B layer shape and a small one,
eager and inside a CUDA graph replayed with new inputs and new routing (one graph serves every expert load, and
its replay equals the eager call bitwise); the EP layout (other ranks' experts and -1 slots contribute zero); the
packed DeepEP layout; the one-launch router (`modeling/ops/triton_router.py`) equal to `modeling.moe.route` eager and
replayed with new logits; and qwen3-moe-small through the rank's decode graphs: greedy tokens equal to the torch
reference path for 64 steps in fp32, teacher-forced agreement in bf16, graph == bucket-padded eager bitwise."""
import numpy as np
import pytest
import torch

from graphrunner.staging import staging_for
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


def _replays(experts, x, ids, w, shape, dtype, seed):
    """Capture `experts(x, ids, w)` once in a CUDA graph (after an eager call that compiles it), then for each
    routing kind copy fresh inputs into `x`, `ids`, `w`, replay, and yield `(kind, graph output)`."""
    experts(x, ids, w)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = experts(x, ids, w)
    for i, kind in enumerate(ROUTINGS):
        x2, ids2, w2 = _inputs(shape, x.shape[0], dtype, kind, seed=seed + i)
        x.copy_(x2), ids.copy_(ids2), w.copy_(w2)
        graph.replay()
        torch.cuda.synchronize()
        yield kind, y


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
    for kind, y in _replays(lambda *a: routed_experts(*a, w13, w2), x, ids, w, shape, dtype, seed=10):
        assert torch.equal(y, routed_experts(x, ids, w, w13, w2)), kind
        _close(y, _reference(x, ids, w, w13, w2), dtype)


@pytest.mark.parametrize("n", [1, 64, 512])
def test_fp32_graph_replay(n):
    from modeling.ops.triton_moe import routed_experts

    shape, dtype = SHAPES["small"], torch.float32
    w13, w2 = _weights(shape, dtype, seed=2)
    x, ids, w = _inputs(shape, n, dtype)
    for _, y in _replays(lambda *a: routed_experts(*a, w13, w2), x, ids, w, shape, dtype, seed=20):
        _close(y, _reference(x, ids, w, w13, w2), dtype)


def _router_logits(n, e, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed * 7919 + n)
    return (torch.randn(n, e, device="cuda", generator=g) * 3).to(dtype)


def _assert_routes_like_torch(weights, ids, logits, k, renormalize):
    """weights within 1e-6 relative of `route`'s; ids those of the stable descending sort of the probabilities
    (ties to the lower id), and `route`'s wherever the row's top k + 1 probabilities are distinct."""
    from modeling.moe import route

    want_w, want_ids = route(logits, k, renormalize)
    torch.testing.assert_close(weights, want_w, rtol=1e-6, atol=0)
    stable = torch.sort(torch.softmax(logits.float(), dim=-1), dim=-1, descending=True, stable=True)
    assert torch.equal(ids, stable.indices[:, :k])
    top = stable.values[:, : k + 1]
    distinct = (top[:, 1:] != top[:, :-1]).all(dim=1)
    assert torch.equal(ids[distinct], want_ids[distinct])


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n", [1, 8, 64, 256])
def test_router_kernel_eager_and_replayed_equals_route(n, dtype, renormalize):
    """`triton_router.route_topk` (the backend's bound `moe_route` with `KernelOptions.moe_route_kernel`, PDL as configured) on the Qwen3-30B-A3B router
    shape (E=128, top-8): eager, and captured in a CUDA graph replayed with new logits in the static input."""
    from modeling.ops import get_kernel_ops
    from modeling.ops.options import KernelOptions

    e, k = 128, 8
    route_kernel = get_kernel_ops("cuda", options=KernelOptions(moe_route_kernel=True)).moe_route
    logits = _router_logits(n, e, dtype, seed=0)
    w, ids = route_kernel(logits, k, renormalize)  # compiles outside the capture
    assert w.dtype == torch.float32 and ids.dtype == torch.int64 and w.shape == ids.shape == (n, k)
    _assert_routes_like_torch(w, ids, logits, k, renormalize)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gw, gids = route_kernel(logits, k, renormalize)
    for seed in (1, 2, 3):
        logits.copy_(_router_logits(n, e, dtype, seed))
        if seed == 3:
            logits[0] = 0  # a row of ties: the lowest ids
        graph.replay()
        torch.cuda.synchronize()
        _assert_routes_like_torch(gw, gids, logits, k, renormalize)
        ew, eids = route_kernel(logits, k, renormalize)
        assert torch.equal(gw, ew) and torch.equal(gids, eids)
    assert gids[0].tolist() == list(range(k))


@pytest.mark.parametrize("n", [1, 2, 3, 64])
def test_router_projection_takes_the_gemv_up_to_its_rows_and_cublas_beyond(n):
    """The backend's `moe_router_linear` (`triton_gemm.router_linear`, `KernelOptions.moe_router_gemv`) on the
    Qwen3-30B-A3B router shape (E=128, H=2048): the decode GEMV at 1-2 rows (the model's rows at hidden 2048), within
    bf16 rounding of cuBLAS, and cuBLAS itself, bit for bit, beyond; eager equals a replayed capture bitwise."""
    import torch.nn.functional as F

    from modeling.ops import get_kernel_ops
    from modeling.ops.options import KernelOptions

    ops = get_kernel_ops("cuda", options=KernelOptions().for_model(2048))
    g = torch.Generator(device="cuda").manual_seed(n)
    w = (torch.randn(128, 2048, device="cuda", generator=g) / 45).to(torch.bfloat16)
    x = torch.randn(n, 2048, device="cuda", generator=g).to(torch.bfloat16)
    got = ops.moe_router_linear(x, w)
    want = F.linear(x, w)
    if n <= ops.options.gemv_max_rows():
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    else:
        assert torch.equal(got, want)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = ops.moe_router_linear(x, w)
    x.copy_(torch.randn(n, 2048, device="cuda", generator=g).to(torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(replayed, ops.moe_router_linear(x, w))


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


def _decode_run(rt, prompts: list[list[int]], steps: int, forced: list[list[int]] | None = None):
    """Prefill, then `steps - 1` decode steps through `rt.runner`, feeding back the greedy tokens (or, teacher
    forced, `forced[i][s]` at step s). Returns (greedy tokens per prompt, decode steps served by full graphs)."""
    seqs = Seqs(rt)
    tables = [seqs.new(len(p) + steps + 1) for p in prompts]
    before = rt.runner.stats.snapshot()["steps"].get("full_graph", 0)
    step = seqs.step(prompts, [0] * len(prompts), tables)
    out = [[t] for t in rt.model.greedy_tokens(rt.runner(step), step.attn_metadata.last_token_index).tolist()]
    hist = [len(p) for p in prompts]
    for s in range(steps - 1):
        feed = [[o[-1]] for o in out] if forced is None else [[f[s]] for f in forced]
        step = seqs.step(feed, hist, tables)
        toks = rt.model.greedy_tokens(rt.runner(step), step.attn_metadata.last_token_index).tolist()
        for o, t in zip(out, toks):
            o.append(t)
        hist = [x + 1 for x in hist]
    return out, rt.runner.stats.snapshot()["steps"].get("full_graph", 0) - before


def _reference_runtime(dtype: str):
    """qwen3-moe-small on the torch reference path: torch operators, static experts, eager."""
    from actors.rank import RankRuntime, RuntimeConfig
    from graphrunner.config import GraphRunnerConfig
    from parallel.context import ParallelContext

    cfg = RuntimeConfig(model="qwen3-moe-small", device="cuda", num_kv_blocks=512, max_model_len=4096, dtype=dtype,
                        kernel_backend="torch", graph=GraphRunnerConfig(eager_mode=True, max_decode_batch=8,
                                                                        pcg_max_tokens=0))
    rt = RankRuntime(cfg, ParallelContext(), torch.device("cuda", 0))
    rt.load_model()
    rt.allocate_kv_cache()
    rt.build_runner()
    assert rt.model.layers[0].mlp.routed_kernel is None
    return rt


def _prompts(vocab: int, seed: int = 3) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [random_tokens(rng, n, vocab) for n in (17, 64, 130)]


def _agreement(a: list[list[int]], b: list[list[int]]) -> float:
    pairs = [(x, y) for p, q in zip(a, b) for x, y in zip(p, q)]
    return sum(x == y for x, y in pairs) / len(pairs)


@torch.inference_mode()
def test_moe_decode_graphs_greedy_equal_torch_reference_64_steps_fp32():
    """qwen3-moe-small in fp32: the routed kernels inside the rank's captured decode graphs give the torch
    reference path's greedy tokens (torch operators, static experts, eager) for 64 steps."""
    rt = make_runtime("qwen3-moe-small", max_decode_batch=8, pcg_max_tokens=0, dtype="float32")
    assert rt.model.layers[0].mlp.routed_kernel is not None
    prompts = _prompts(rt.model_config.vocab_size)
    got, graph_steps = _decode_run(rt, prompts, 64)
    want, ref_graph_steps = _decode_run(_reference_runtime("float32"), prompts, 64)
    assert graph_steps == 63 and ref_graph_steps == 0
    assert got == want


@torch.inference_mode()
def test_moe_decode_graphs_bf16_teacher_forced_agree_with_the_references():
    """bf16: greedy runs of a random-weight MoE part at routing near-ties (the 8th and 9th expert's scores within
    bf16 noise), so free-running tokens of two correct backends diverge within a few steps (measured: the torch
    reference at steps 1-6, even torch static experts inside the same graphs at 14-37). Teacher forced on the
    reference's tokens, every step is compared on its own, over three prompt seeds (3 x 3 x 64 tokens): the routed
    graphs (the default router kernel) agree with the torch reference path on >= 85% (measured 93-95% per seed)
    and with the same graphs computing the experts with the torch static path on >= 95% (measured 96.4-97.9% per
    seed with the router kernel, 97.9-98.4% with torch's routing; over six seeds, `python -m
    bench.moe_router_agreement`, 96.4-98.4% and 95.8-99.0%); a wrong expert kernel agrees on almost none."""
    rt = make_runtime("qwen3-moe-small", max_decode_batch=8, pcg_max_tokens=0)
    assert rt.model.layers[0].mlp.route_kernel is not None  # the default routing
    static = make_runtime("qwen3-moe-small", max_decode_batch=8, pcg_max_tokens=0, capture=False)
    for layer in static.model.layers:
        layer.mlp.routed_kernel = None  # the torch static experts, captured in the same decode graphs
    static.capture_all()
    reference = _reference_runtime("bfloat16")
    want, got, same_graphs = [], [], []
    for seed in (3, 0, 1):
        prompts = _prompts(rt.model_config.vocab_size, seed)
        w, _ = _decode_run(reference, prompts, 64)
        g, graph_steps = _decode_run(rt, prompts, 64, forced=w)
        s, static_steps = _decode_run(static, prompts, 64, forced=w)
        assert graph_steps == static_steps == 63
        want, got, same_graphs = want + w, got + g, same_graphs + s
    assert _agreement(got, want) >= 0.85, _agreement(got, want)
    assert _agreement(got, same_graphs) >= 0.95, _agreement(got, same_graphs)


@torch.inference_mode()
def test_moe_decode_graph_equals_bucket_eager_exactly():
    """The captured decode graph of qwen3-moe-small (bf16, routed kernels) equals the same model run eagerly on the
    bucket-padded inputs bitwise: the kernels are deterministic and the capture replays them with new routing."""
    rt = make_runtime("qwen3-moe-small", max_decode_batch=8, pcg_max_tokens=0)
    rng = np.random.default_rng(0)
    buckets = rt.capture_sizes()[0]
    vocab = rt.model_config.vocab_size
    for b in (1, 3, 8):
        seqs = Seqs(rt)
        prompts = [random_tokens(rng, int(rng.integers(20, 200)), vocab) for _ in range(b)]
        tables = [seqs.new(len(p) + 8) for p in prompts]
        s = seqs.step(prompts, [0] * b, tables)
        rt.model(s.input_ids, s.position_ids, s.kv_caches, s.attn_metadata)
        step = seqs.step([random_tokens(rng, 1, vocab) for _ in prompts], [len(p) for p in prompts], tables)
        graph_out = rt.runner(step).clone()
        padded = min(x for x in buckets if x >= b)
        bufs = rt.model.make_buffers(rt.runner.graph_meta, staging_for(rt.model, rt.runner.graph_meta))
        rt.model.fill_buffers(bufs, step, padded)
        s2 = rt.model.update_context(bufs, step, padded)
        bucket_out = rt.model(s2.input_ids, s2.position_ids, s2.kv_caches, s2.attn_metadata)[:b]
        assert torch.equal(graph_out, bucket_out), f"batch {b}"
        for t in tables:
            seqs.alloc.free(t)
