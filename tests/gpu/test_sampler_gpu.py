"""The batched sampler's Triton kernels on one GPU, captured in CUDA graphs.

Per decode bucket (1, 8, 64, 256) and bf16 logits `[B, 151936]`: the sampler captured in a graph (the full
variant and the plain one, top-5 logprobs) and replayed with new parameters and new logits copied into the
graph's inputs equals the eager kernels and the CPU torch path bitwise for tokens (the noise and thresholds are
bit-exact on every device), logprobs within bf16 tolerance of `log_softmax` of the logits; top-1 and top-20
logprobs over rows of one value, few values, few finite logits and top ties across the row equal the CPU path's
ids (and eager's bits); 100k small-vocabulary draws equal the CPU path's draws one for one.
"""
import numpy as np
import pytest
import torch

from modeling.sampler import HostBatch, RowSpec, SamplerParams, SamplerVariant, sample

pytestmark = pytest.mark.gpu

V = 151936
CAPS = dict(max_bias=8, max_ban=4, max_penalty_tokens=32)
BUCKETS = (1, 8, 64, 256)


def _rows(b: int, salt: int) -> list[RowSpec]:
    g = np.random.default_rng(b * 7 + salt)
    kinds = [
        lambda: RowSpec(),
        lambda: RowSpec(temperature=1.0),
        lambda: RowSpec(temperature=float(g.uniform(0.5, 1.5)), top_p=0.9),
        lambda: RowSpec(temperature=1.0, top_k=50),
        lambda: RowSpec(temperature=1.0, min_p=0.1),
        lambda: RowSpec(temperature=0.8, top_k=200, top_p=0.7, min_p=0.01),
        lambda: RowSpec(temperature=2.0, top_p=0.95),
        lambda: RowSpec(temperature=1.0, top_p=0.8, logit_bias={int(g.integers(V)): 8.0}, banned_ids=[151643],
                        repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2,
                        prompt_token_ids=g.integers(0, V, 12).tolist(), output_token_ids=g.integers(0, V, 6).tolist()),
    ]
    rows = []
    for i in range(b):
        spec = kinds[(i + salt) % len(kinds)]()
        rows.append(RowSpec(**{**spec.__dict__, "seed": int(g.integers(1 << 62)), "position": int(g.integers(1 << 20))}))
    return rows


def _logits(b: int, salt: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(b * 13 + salt)
    x = torch.randn(b, V, device="cuda", generator=g) * 2
    top = torch.randint(0, V, (b, 8), device="cuda", generator=g)
    x.scatter_add_(1, top, torch.linspace(10, 3, 8, device="cuda").expand(b, 8).contiguous())
    return x.bfloat16()


def _load(p: SamplerParams, rows: list[RowSpec]) -> None:
    p.load(HostBatch.from_rows(rows, vocab_size=V, **CAPS), rows=p.max_batch)


def _cpu(logits: torch.Tensor, rows: list[RowSpec], n: int, variant: SamplerVariant):
    p = SamplerParams(len(rows), "cpu", **CAPS)
    p.load(HostBatch.from_rows(rows, vocab_size=V, **CAPS))
    return sample(logits.cpu(), p, num_logprobs=n, variant=variant)


def _capture(fn):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # compiles the kernels outside the capture
        side.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            out = fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    return graph, out


@pytest.fixture(scope="module")
def params() -> SamplerParams:
    return SamplerParams(max(BUCKETS), "cuda", **CAPS)


@pytest.mark.parametrize("variant", [SamplerVariant.full(), SamplerVariant()], ids=["full", "plain"])
@pytest.mark.parametrize("b", BUCKETS)
def test_graph_replay_equals_eager_and_the_cpu_reference(params, b, variant):
    n = 5
    static = torch.empty(b, V, dtype=torch.bfloat16, device="cuda")
    graph, out = _capture(lambda: sample(static, params, num_logprobs=n, variant=variant))
    for salt in (1, 2):  # new parameters and new logits into the captured graph's inputs
        rows = _rows(b, salt)
        if variant == SamplerVariant():
            rows = [RowSpec(temperature=r.temperature, min_p=r.min_p, seed=r.seed, position=r.position) for r in rows]
        logits = _logits(b, salt)
        _load(params, rows)
        static.copy_(logits)
        graph.replay()
        eager = sample(logits, params, num_logprobs=n, variant=variant)
        torch.cuda.synchronize()
        ref = _cpu(logits, rows, n, variant)
        assert torch.equal(out.tokens, eager.tokens), (b, salt)
        assert torch.equal(out.tokens.cpu(), ref.tokens), (b, salt, (out.tokens.cpu() != ref.tokens).nonzero())
        lsm = torch.log_softmax(logits.float(), dim=-1)
        assert torch.allclose(out.chosen_logprob, lsm.gather(1, out.tokens[:, None]).squeeze(1), atol=2e-3)
        assert torch.equal(out.top_ids.cpu(), ref.top_ids)
        assert torch.allclose(out.top_logprobs, lsm.gather(1, out.top_ids), atol=2e-3)
        assert torch.equal(out.chosen_logprob, eager.chosen_logprob)
        greedy = torch.tensor([r.temperature == 0 for r in rows], device="cuda")
        if variant == SamplerVariant() and greedy.any():
            assert torch.equal(out.tokens[greedy], logits.float().argmax(-1)[greedy])


def _tie_logits(b: int) -> torch.Tensor:
    x = _logits(b, 3)
    x[0] = 0.0  # one value: the lowest ids
    if b > 1:
        x[1] = torch.round(x[1].float() / 2).bfloat16()  # few values: ties at the N-th
    if b > 2:
        x[2] = float("-inf")
        x[2, [5, 77777, V - 1]] = 1.0  # fewer finite logits than N
    if b > 3:
        x[3, [0, 50000, V - 1]] = 30.0  # top ties across groups and chunks, one in the last id
    return x


@pytest.mark.parametrize("n", [1, 20])
@pytest.mark.parametrize("b", (1, 8, 64))
def test_top_logprobs_equal_the_cpu_reference(params, b, n):
    rows = [RowSpec(temperature=1.0, seed=i) if i % 2 else RowSpec() for i in range(b)]
    logits = _tie_logits(b)
    _load(params, rows)
    static = torch.empty_like(logits)
    graph, out = _capture(lambda: sample(static, params, num_logprobs=n, variant=SamplerVariant()))
    static.copy_(logits)
    graph.replay()
    eager = sample(logits, params, num_logprobs=n, variant=SamplerVariant())
    torch.cuda.synchronize()
    ref = _cpu(logits, rows, n, SamplerVariant())
    assert torch.equal(out.top_ids.cpu(), ref.top_ids), (b, n, (out.top_ids.cpu() != ref.top_ids).nonzero()[:5])
    assert torch.equal(out.top_ids, eager.top_ids) and torch.equal(out.top_logprobs, eager.top_logprobs)
    assert torch.equal(out.tokens.cpu(), ref.tokens)
    lsm = torch.log_softmax(logits.float(), dim=-1)
    assert torch.allclose(out.top_logprobs, lsm.gather(1, out.top_ids), atol=2e-3)
    assert out.top_ids[0].tolist() == list(range(n))


@pytest.mark.parametrize("spec", [RowSpec(temperature=1.0, top_p=0.8, seed=3), RowSpec(temperature=0.7, top_k=9, seed=4),
                                  RowSpec(temperature=1.0, min_p=0.05, top_k=20, top_p=0.9, seed=5)],
                         ids=["top_p", "top_k", "combined"])
def test_100k_draws_equal_the_cpu_draws(spec):
    n, v = 100_000, 64
    one = HostBatch.from_rows([spec], vocab_size=v, **CAPS)
    arrays = {k: np.repeat(getattr(one, k), n, axis=0) for k in {**HostBatch.SCALARS, **HostBatch.LISTS}}
    arrays["position"] = np.arange(n, dtype=np.int64)
    host = HostBatch(**arrays, vocab_size=v)
    x = torch.from_numpy(np.random.default_rng(0).normal(0, 2, v).astype(np.float32)).expand(n, v)
    got = {}
    for dev in ("cuda", "cpu"):
        p = SamplerParams(n, dev, **CAPS)
        p.load(host)
        got[dev] = sample(x.to(dev), p, variant=SamplerVariant(top_k=True, top_p=True)).tokens.cpu()
    assert torch.equal(got["cuda"], got["cpu"])
    assert len(set(got["cpu"].tolist())) > 3


@pytest.mark.parametrize("b", (1, 64))
def test_top_p_threshold_equals_the_cpu_reference(b):
    """The top-p threshold key the kernels leave for the sample pass equals the reference's on the full vocabulary,
    for bulk, peaked, flat, tied and wide rows with top-k and min-p before it; at batch 64 both ways of
    `triton_topp` are taken (candidates, radix)."""
    from modeling.sampler import triton_sampler as ts
    from modeling.sampler.collectives import ShardGroup
    from tests.unit._topp_keys import kernel_key, reference_key, resolved_rows

    x = _logits(b, 4).float()
    for r in range(b):
        x[r] *= (1.0, 0.01, 3.0, 0.5)[r % 4]  # peaked / flat / wide / narrow
        if r % 5 == 3:
            x[r] = torch.round(x[r])  # ties across the threshold
    x = x.bfloat16()
    rows = [RowSpec(temperature=(1.0, 0.6, 1.5)[r % 3], top_p=(0.9, 0.95, 0.5, 0.99, 0.01)[r % 5], seed=r,
                    **({"top_k": 20} if r % 7 == 2 else {"min_p": 0.05} if r % 7 == 4 else {})) for r in range(b)]
    p = SamplerParams(b, "cuda", **CAPS)
    p.load(HostBatch.from_rows(rows, vocab_size=V, **CAPS))
    state = {}
    ts.sample_triton(x, p, SamplerVariant(top_k=True, top_p=True), 0, 0, ShardGroup(None), V, state=state)
    torch.cuda.synchronize()
    cpu = SamplerParams(b, "cpu", **CAPS)
    cpu.load(HostBatch.from_rows(rows, vocab_size=V, **CAPS))
    want, _key_lo = reference_key(x.cpu(), cpu)
    got = kernel_key(state).cpu()
    assert torch.equal(got, want), (got != want).nonzero()[:5]
    res = resolved_rows(state)
    assert all(res[r] for r in range(b) if r % 7 == 2)  # top-k rows
    if b == 64:
        assert any(res) and not all(res), res
