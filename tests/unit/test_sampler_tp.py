"""The sampler under TP on CPU: 2 processes on gloo, each holding one vocabulary shard (of unequal widths and an
offset that is not a multiple of 4), return the same tokens, chosen logprobs and top-N as TP = 1 on the full
logits, identical on both ranks. The Triton kernels' TP protocol is checked the same way under the interpreter
(test_sampler_interpret.py)."""
import torch
import torch.distributed as dist

from modeling.sampler import HostBatch, RowSpec, SamplerParams, SamplerVariant, sample
from tests.unit._ranks import run_ranks
from tests.unit._sampler_cases import CAPS

V = 2003
SPLIT = 1001  # rank 0: [0, 1001), rank 1: [1001, 2003)
WORLD = 2


def _rows() -> list[RowSpec]:
    return [RowSpec(), RowSpec(temperature=1.0, seed=1, position=3), RowSpec(temperature=0.6, top_p=0.9, seed=2),
            RowSpec(temperature=1.2, top_k=15, seed=3, position=77), RowSpec(temperature=1.0, min_p=0.05, seed=4),
            RowSpec(temperature=1.0, top_k=40, top_p=0.5, min_p=0.01, seed=5, position=1 << 33),
            RowSpec(temperature=0.9, seed=6, logit_bias={1500: 6.0, 3: -4.0}, banned_ids=[1000, 1001],
                    repetition_penalty=1.3, frequency_penalty=0.2, presence_penalty=0.4,
                    prompt_token_ids=[10, 1200], output_token_ids=[1200, 1200, 7]),
            RowSpec(temperature=3.0, top_p=0.95, seed=7)]


def _inputs():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(len(_rows()), V, generator=g) * 2
    logits[2, 1500:1510] += 5  # top-p mass straddling the shard boundary
    return logits


def _params() -> SamplerParams:
    p = SamplerParams(8, "cpu", **CAPS)
    p.load(HostBatch.from_rows(_rows(), vocab_size=V, **CAPS))
    return p


def _rank(rank: int, init: str, q) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    try:
        logits = _inputs()
        lo, hi = (0, SPLIT) if rank == 0 else (SPLIT, V)
        out = {}
        for name, variant in (("full", SamplerVariant.full()), ("top_p", SamplerVariant(True, False, True))):
            o = sample(logits[:, lo:hi], _params(), num_logprobs=5, vocab_offset=lo, tp_group=dist.group.WORLD,
                       variant=variant, shard_width=max(SPLIT, V - SPLIT))
            out[name] = (o.tokens.tolist(), o.chosen_logprob.tolist(), o.top_ids.tolist(), o.top_logprobs.tolist())
        q.put((rank, out))
    finally:
        dist.destroy_process_group()


def test_two_shards_equal_one_rank():
    want = {}
    for name, variant in (("full", SamplerVariant.full()), ("top_p", SamplerVariant(True, False, True))):
        o = sample(_inputs(), _params(), num_logprobs=5, variant=variant)
        want[name] = o
    got = {r: payload[0] for r, payload in run_ranks(_rank, WORLD).items()}
    for name, o in want.items():
        for r in range(WORLD):
            tokens, chosen, top_ids, top_lp = got[r][name]
            assert tokens == o.tokens.tolist(), (name, r)
            assert top_ids == o.top_ids.tolist(), (name, r)
            assert torch.allclose(torch.tensor(chosen), o.chosen_logprob, atol=1e-4)  # sums over shards: another order
            assert torch.allclose(torch.tensor(top_lp), o.top_logprobs, atol=1e-4)
        assert got[0][name] == got[1][name]  # every rank returns the same bits
    assert len(set(want["full"].tokens.tolist())) > 4
