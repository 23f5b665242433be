"""Allow masks in the Triton sampler kernels under the CPU interpreter (TRITON_INTERPRET=1), against the torch
path: the copy kernel's masked variant gives the same tokens bit for bit and the same top-N ids (logprobs of the
raw logits) for greedy, plain, top-k, top-p, min-p and processed rows mixed with unconstrained ones, fp32 and bf16
logits, one shard at an offset that is not a multiple of 32 and TP = 2 on gloo (the same offset) against TP = 1;
masked ids are never drawn; an all-ones mask changes no bit of the kernels' outputs; a row allowing nothing draws
token 0 and leaves the other rows alone."""
import pytest

from tests.unit._interpret import run_interpreted

pytest.importorskip("triton", reason="needs triton (the Triton CPU interpreter runs its kernels)")

_CHILD = r"""
import json
import numpy as np
import torch
import torch.distributed as dist
from modeling.sampler import HostBatch, RowSpec, SamplerParams, SamplerVariant, sample
from modeling.sampler import triton_sampler as ts
from modeling.sampler.allow_bits import mask_words, pack_allowed
from tests.unit._ranks import run_ranks

ts.BLOCK, ts.MAX_CHUNK, ts.SELECT_BLOCK = 256, 512, 64
ts.TOPK_GROUP, ts.TOPP_GROUPS = 8, 64
CAPS = dict(max_bias=8, max_ban=4, max_penalty_tokens=16)
V_TP, SPLIT = 2003, 1001  # 1001 = 31 * 32 + 9


def rows(v):
    return [RowSpec(), RowSpec(temperature=1.0, seed=1, position=3), RowSpec(temperature=0.7, top_p=0.9, seed=2),
            RowSpec(temperature=1.3, top_k=20, seed=3), RowSpec(temperature=1.0, min_p=0.2, seed=4), RowSpec(),
            RowSpec(temperature=1.0, top_k=30, top_p=0.6, min_p=0.02, seed=5, position=1 << 33),
            RowSpec(temperature=1.1, top_p=0.8, seed=9, logit_bias={v - 1: 8.0, 2: -3.0}, banned_ids=[0, 5],
                    repetition_penalty=1.5, frequency_penalty=0.3, prompt_token_ids=[9, 10], output_token_ids=[10]),
            RowSpec(temperature=1.0, top_k=300, seed=10), RowSpec(temperature=2.0, seed=11)]


def logits_for(v, dtype):
    x = torch.randn(len(rows(v)), v, generator=torch.Generator().manual_seed(v)) * 2.5
    return x.to(dtype)


def masks(v, x):
    order = torch.argsort(x.float(), dim=1, descending=True)
    g = np.random.default_rng(v)
    edge = [i % v for i in range(SPLIT - 40, SPLIT + 40)]  # around the TP split
    allowed = [order[0, 4:9].tolist(), None, order[2, 3:200].tolist(), order[3, ::2].tolist(),
               order[4, 1:4].tolist() + edge[39:41], None, g.choice(v, v // 3, replace=False).tolist(),
               [0, 5, 9, 10, v - 1] + edge, order[8, 100:].tolist(), list(range(0, v, 5))]
    return pack_allowed(allowed, v)


def run(x, r, bits, variant, n, backend, v, **kw):
    p = SamplerParams(len(r), "cpu", **CAPS)
    p.load(HostBatch.from_rows(r, vocab_size=v, **CAPS, allow_bits=bits), rows=len(r))
    return sample(x, p, num_logprobs=n, variant=variant, backend=backend, **kw)


def unpack(bits, v):
    j = np.arange(v)
    return np.ascontiguousarray((bits[:, j >> 5] >> (j & 31)) & 1, dtype=bool)


def compare(a, b, bits=None):
    out = {"equal": torch.equal(a.tokens, b.tokens), "top_equal": torch.equal(a.top_ids, b.top_ids),
           "lp_err": float((a.chosen_logprob - b.chosen_logprob).abs().max()), "tokens": a.tokens.tolist()}
    if bits is not None:
        out["allowed"] = bool(unpack(bits, bits.shape[1] * 32)[np.arange(len(a.tokens)), a.tokens.numpy()].all())
    return out


def same_bits(a, b):
    return all(torch.equal(getattr(a, f), getattr(b, f))
               for f in ("tokens", "chosen_logprob", "top_ids", "top_logprobs"))


VARIANTS = {"processed": SamplerVariant(processed=True), "full": SamplerVariant.full(),
            "top_p": SamplerVariant(processed=True, top_p=True),
            "small_k": SamplerVariant(processed=True, top_k=True, top_p=True)}


def rank_main(rank, init, q):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    x = logits_for(V_TP, torch.float32)
    lo, hi = (0, SPLIT) if rank == 0 else (SPLIT, V_TP)
    o = run(x[:, lo:hi].contiguous(), rows(V_TP), masks(V_TP, x), SamplerVariant.full(), 4, "triton", V_TP,
            vocab_offset=lo, tp_group=dist.group.WORLD, shard_width=SPLIT + 1)
    q.put((rank, o.tokens.tolist(), o.top_ids.tolist()))
    dist.destroy_process_group()


if __name__ == "__main__":
    out = {}
    for v, dtype, n, names in ((1000, torch.float32, 5, list(VARIANTS)), (3001, torch.bfloat16, 3, ["full"])):
        x = logits_for(v, dtype)
        bits = masks(v, x)
        for name in names:
            r = rows(v) if name != "small_k" else [s for s in rows(v) if s.top_k <= 128]
            xs, bs = x[: len(r)], bits[: len(r)]
            a = run(xs, r, bs, VARIANTS[name], n, "triton", v)
            b = run(xs, r, bs, VARIANTS[name], n, "torch", v)
            out[f"{v} {dtype} {name}"] = compare(a, b, bs)
    # all ones: the kernels' outputs of no mask, bit for bit; a row allowing nothing: token 0, the rest unchanged
    x = logits_for(1000, torch.float32)
    ones = np.full((len(rows(1000)), mask_words(1000)), -1, np.int32)
    a = run(x, rows(1000), ones, SamplerVariant.full(), 5, "triton", 1000)
    b = run(x, rows(1000), None, SamplerVariant.full(), 5, "triton", 1000)
    none = ones.copy()
    none[[1, 5]] = 0
    c = run(x, rows(1000), none, SamplerVariant.full(), 5, "triton", 1000)
    free = [s for s in rows(1000) if not s.logit_bias]  # unprocessed rows: the kernels without the copy
    own = HostBatch.from_rows(free, vocab_size=1000, **CAPS).variant()
    xf = torch.cat([x[:7], x[8:]])
    d = run(xf, free, ones[: len(free)], SamplerVariant(True, own.top_k, own.top_p, own.large_top_k), 5, "triton",
            1000)
    e = run(xf, free, None, own, 5, "triton", 1000)
    out["ones"] = {"same_bits": same_bits(a, b), "nothing": c.tokens.tolist(), "want": a.tokens.tolist(),
                   "unprocessed_same_bits": same_bits(d, e) and not own.processed}
    # one shard at an offset that is not a multiple of 32
    x = logits_for(V_TP, torch.float32)
    bits = masks(V_TP, x)
    xs = x[:, SPLIT:].contiguous()
    a = run(xs, rows(V_TP), bits, SamplerVariant.full(), 2, "triton", V_TP, vocab_offset=SPLIT)
    b = run(xs, rows(V_TP), bits, SamplerVariant.full(), 2, "torch", V_TP, vocab_offset=SPLIT)
    out["offset shard"] = compare(a, b)
    ref = run(x, rows(V_TP), bits, SamplerVariant.full(), 4, "torch", V_TP)
    got = run_ranks(rank_main, 2, timeout_s=600)
    out["tp"] = {"want": ref.tokens.tolist(), "ranks": [got[r][0] for r in range(2)],
                 "top_ids": [got[r][1] == ref.top_ids.tolist() for r in range(2)],
                 "allowed": bool(unpack(bits, V_TP)[np.arange(len(ref.tokens)), ref.tokens.numpy()].all())}
    print("RESULT" + json.dumps(out))
"""


@pytest.fixture(scope="module")
def results() -> dict:
    return run_interpreted(_CHILD, timeout_s=900)


def test_masked_kernels_equal_the_torch_path_bitwise(results):
    cases = {k: r for k, r in results.items() if k not in ("tp", "ones", "offset shard")}
    assert len(cases) == 5
    for name, r in cases.items():
        assert r["equal"] and r["top_equal"] and r["lp_err"] < 1e-4 and r["allowed"], (name, r)
    assert len(set(results["1000 torch.float32 full"]["tokens"])) > 6


def test_all_ones_mask_changes_no_bit_and_a_row_allowing_nothing_draws_0(results):
    r = results["ones"]
    assert r["same_bits"] and r["unprocessed_same_bits"]
    assert r["nothing"][1] == r["nothing"][5] == 0
    assert [t for i, t in enumerate(r["nothing"]) if i not in (1, 5)] == [t for i, t in enumerate(r["want"])
                                                                           if i not in (1, 5)]


def test_masked_shard_at_an_offset_and_under_tp_equal_one_rank(results):
    r = results["offset shard"]
    assert r["equal"] and r["top_equal"] and r["lp_err"] < 1e-4, r
    tp = results["tp"]
    assert tp["ranks"][0] == tp["want"] and tp["ranks"][1] == tp["want"] and all(tp["top_ids"]) and tp["allowed"], tp
