"""The Gumbel-max kernel skips a tile's logs when even its largest possible score cannot win; this pins what that
rests on, and that the tokens stay the reference's.

1. `noise_bound` (integer work) is at least the noise -plog(-plog(u)) for all 2^23 values of u's random bits,
   with the reference numerics (the kernel's rounding, op for op), and non-decreasing in them, so the bound of a
   tile's largest bits is at least every token's noise; no noise exceeds `NOISE_MAX`.
2. Under the CPU interpreter, with 32-id steps and 256-id chunks (many tiles a chunk, so tiles are skipped both
   before and after the chunk's first candidate), sampled rows of several shapes (16 rows of 1031 ids, 2 seeds)
   give the reference's tokens and chosen logprobs, with temperature, top-k, min-p and top-p, rows whose largest
   z is tied, all banned but a few, and greedy rows beside them; the plain path (`SAMPLE_SKIP` off) gives the
   same tokens, and computes the noise of more tiles.
"""
import pytest
import torch

from modeling.sampler import numerics as nx
from tests.unit._interpret import run_interpreted

triton = pytest.importorskip("triton", reason="needs triton (its language module and the CPU interpreter)")


def test_noise_bound_holds_for_every_value_of_the_bits():
    from modeling.sampler.triton_numerics import NOISE_MAX

    bits = torch.arange(0, 1 << 23, dtype=torch.int64)
    g = -nx.plog(-nx.plog((bits * 2 + 1).to(torch.float32) * nx.TWO_M24))
    n = (16777215 - 2 * bits).to(torch.int32).to(torch.float32)  # `noise_bound`, op for op in fp32
    e = (n.view(torch.int32) >> 23) - 127
    bound = (24 - e).to(torch.float32) * 0.6931471805599453 + 0.01
    assert bool((g <= bound).all()), f"noise above its bound at bits {int(torch.nonzero(g > bound)[0])}"
    assert bool((bound[1:] >= bound[:-1]).all())  # so the tile's largest bits bound every token's noise
    assert float(g.max()) < NOISE_MAX.value
    top = bits >= (1 << 23) * 99 // 100  # a tile's largest bits (u >= 0.99): the bound is about ln 2 / 2 above
    assert float((bound - g)[top].mean()) < 0.45


_CHILD = r"""
import json
import torch
from modeling.sampler import HostBatch, RowSpec, SamplerParams, SamplerVariant, sample
from modeling.sampler import triton_sampler as ts
from modeling.sampler import triton_numerics as tn

ts.BLOCK, ts.MAX_CHUNK, ts.SELECT_BLOCK, ts.TOPK_GROUP, ts.TOPP_GROUPS = 256, 256, 64, 8, 64
ts.SAMPLE_BLOCK = 32
CAPS = dict(max_bias=8, max_ban=4, max_penalty_tokens=16)
V = 1031


def logits():
    g = torch.Generator().manual_seed(3)
    rows = []
    for i in range(16):
        kind = i % 8
        x = torch.randn(V, generator=g) * (1.0 + 0.5 * (i % 3))
        if kind == 1:
            x[torch.randint(0, V, (8,), generator=g)] += torch.linspace(12, 4, 8)  # a few strong candidates
        elif kind == 2:
            x = -1.5 * (torch.randperm(V, generator=g).float() + 1).log()  # Zipf over a random order
        elif kind == 3:
            x = x * 0.05  # flat
        elif kind == 4:
            x[torch.randint(0, V, (5,), generator=g)] = 9.0  # the largest z tied on five ids
        elif kind == 5:
            x[:] = float("-inf")
            x[torch.randint(0, V, (7,), generator=g)] = torch.randn(7, generator=g)  # all but a few banned
        elif kind == 6:
            x[-3] += 20.0  # the winner in the last tile of the row
        elif kind == 7:
            x = x * 10  # wide
        rows.append(x)
    return torch.stack(rows)


def specs(seed):
    out = []
    for i in range(16):
        extra = ({"top_k": 30} if i % 5 == 1 else {"min_p": 0.02} if i % 5 == 2 else {"top_p": 0.9} if i % 5 == 3
                 else {})
        t = 0.0 if i % 7 == 6 else (1.0, 0.7, 1.5)[i % 3]
        out.append(RowSpec(temperature=t, seed=1000 * seed + i, **extra))
    return out


def run(x, rows, variant, backend):
    p = SamplerParams(len(rows), "cpu", **CAPS)
    p.load(HostBatch.from_rows(rows, vocab_size=V, **CAPS))
    return sample(x, p, variant=variant, backend=backend)


x = logits()
variant = SamplerVariant(top_k=True, top_p=True)
out = {"tokens": [], "lp": []}
for seed in range(2):
    rows = specs(seed)
    a, b = run(x, rows, variant, "triton"), run(x, rows, variant, "torch")
    out["tokens"].append([a.tokens.tolist(), b.tokens.tolist()])
    out["lp"].append(float((a.chosen_logprob - b.chosen_logprob).abs().max()))

# the same rows on the plain path (SAMPLE_SKIP off: every tile within NOISE_MAX of the best score computed),
# counting the tiles whose noise is computed (calls of gumbel_of on a tile, not on one id's bits)
import modeling.sampler.triton_kernels as tk
calls = {"n": 0}
real = tk.gumbel_of


def counting(bits):
    n = getattr(bits, "numel", 1)
    calls["n"] += int(getattr(n, "value", n) > 4)
    return real(bits)


tk.gumbel_of = counting
rows = specs(0)
skipped = run(x, rows, variant, "triton")
ts.SAMPLE_SKIP, skipping, calls["n"] = False, calls["n"], 0
plain = run(x, rows, variant, "triton")
out["calls"] = [skipping, calls["n"]]
out["plain_tokens"] = [skipped.tokens.tolist(), plain.tokens.tolist()]
print("RESULT" + json.dumps(out))
"""


@pytest.fixture(scope="module")
def results() -> dict:
    return run_interpreted(_CHILD, timeout_s=900)


def test_tokens_equal_the_reference(results):
    for got, want in results["tokens"]:
        assert got == want
    assert max(results["lp"]) < 1e-5
    skipped, plain = results["plain_tokens"]
    assert skipped == plain == results["tokens"][0][1]


def test_tiles_were_skipped(results):
    skipping, full = results["calls"]
    assert 0 < skipping < full
