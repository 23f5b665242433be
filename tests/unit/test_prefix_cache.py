"""Automatic prefix caching through `LLMEngine` on the paged toy executor (which really reads the K/V slots its block
tables name, so a wrong hit, a block overwritten while cached or a stale cache after a reset / rebuild gives wrong
tokens or an unwritten-slot error): cached requests give the reference tokens, hits are counted, shared blocks are
referenced not copied, across eviction, preemption, reset, a rank failure, DP placement and `n > 1` samples."""
from __future__ import annotations

import numpy as np
import pytest

from engine import EngineConfig, EngineStepError, LLMEngine, SamplingParams
from engine.samples import derive_seed
from engine.testing import PagedToyExecutor

BS = 4


def _engine(blocks: int = 200, dp: int = 1, **cfg) -> LLMEngine:
    return LLMEngine(PagedToyExecutor(num_kv_blocks=blocks, block_size=BS, dp_size=dp, max_model_len=128),
                     EngineConfig(max_num_seqs=32, **cfg))


def _shared_prefix_prompts(n: int, prefix_len: int = 21, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    system = rng.integers(0, 97, prefix_len).tolist()
    return [system + rng.integers(0, 97, int(rng.integers(1, 9))).tolist() for _ in range(n)]


def _check(eng: LLMEngine, prompts, outs, max_tokens: int, sampling: SamplingParams = SamplingParams()) -> None:
    ref = eng.executor.reference
    assert [o.token_ids for o in outs] == [ref(p, max_tokens, temperature=sampling.temperature,
                                               seed=sampling.seed if sampling.seed is not None else -1)
                                           for p in prompts]
    for s in eng.schedulers:
        s.blocks.check()


def test_requests_sharing_a_prefix_hit_the_cache_and_give_the_uncached_tokens():
    prompts = _shared_prefix_prompts(8)
    on, off = _engine(), _engine(enable_prefix_caching=False)
    first = on.generate(prompts[:1], max_tokens=6)  # computes and registers the shared blocks
    rest_on = on.generate(prompts[1:], max_tokens=6)
    rest_off = off.generate(prompts[1:], max_tokens=6)
    assert [o.token_ids for o in rest_on] == [o.token_ids for o in rest_off]
    _check(on, prompts, first + rest_on, 6)
    pc = on.stats()["prefix_cache"]
    assert pc["hits"] == 7 * 20  # 21 shared tokens = 5 full blocks of 4 (20 tokens) for each later request
    assert pc["queries"] == sum(len(p) for p in prompts) and pc["hit_rate"] == pytest.approx(140 / pc["queries"])
    assert off.stats()["prefix_cache"] == {**off.stats()["prefix_cache"], "hits": 0, "cached_blocks": 0}
    assert on.stats()["dp_ranks"][0]["prefix_cache"]["hits"] == 140
    assert on.schedulers[0].blocks.num_free == 199  # cached blocks count as free (evictable)


def test_a_hit_ends_on_the_last_full_block_and_the_rest_is_computed():
    """A hit covers whole blocks only (the partial block after it is computed); a prompt that is fully cached on a
    block boundary still computes its last token, i.e. its whole last block; a follow-up turn (prompt + answer +
    new text) reuses the blocks of the answer too."""
    eng = _engine()
    base = list(range(1, 11))  # 10 tokens: 2 full blocks + 2 tokens
    out = eng.generate([base], max_tokens=7)[0]
    s = eng.schedulers[0]
    assert s.blocks.num_cached == (10 + 7 - 1) // BS  # every full block of prompt + answer whose K/V was written

    def admitted_history(prompt: list[int]) -> int:
        rid = eng.add_request(eng.make_request(prompt, max_tokens=3))
        eng.step()
        seq = eng._seqs[rid]
        hist = seq.num_cached_tokens
        while eng.has_unfinished():
            eng.step()
        return hist

    assert admitted_history(base[:9] + [50, 51]) == 8  # shares 9 tokens: 2 full blocks, the partial one computed
    assert admitted_history(base[:8]) == 4  # fully cached on a block boundary: its last block is recomputed
    follow = base + out.token_ids + [60, 61, 62]
    assert admitted_history(follow) == 16  # the prompt's and the answer's full blocks
    outs = eng.generate([base[:9] + [50, 51], base[:8], follow], max_tokens=3)
    _check(eng, [base[:9] + [50, 51], base[:8], follow], outs, 3)


def test_blocks_computed_in_the_same_step_are_not_shared_and_registered_once():
    """A block is registered only after the step that wrote its K/V: two equal prompts admitted together both
    compute; only one copy of each full block is cached and both sequences' blocks are released at the end."""
    eng = _engine(blocks=40)
    prompt = list(range(20, 33))  # 13 tokens: 3 full blocks
    outs = eng.generate([prompt, prompt], max_tokens=2)
    assert outs[0].token_ids == outs[1].token_ids == eng.executor.reference(prompt, 2)
    s = eng.schedulers[0]
    assert s.stats()["prefix_cache"]["hits"] == 0 and s.blocks.num_cached == 3
    assert s.blocks.num_free == 39 and s.blocks.num_referenced == 0


def test_evicted_blocks_are_recomputed_correctly():
    eng = _engine(blocks=12)  # 11 usable blocks: every new prompt evicts cached ones
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 97, 17).tolist() for _ in range(6)]
    outs = [eng.generate([p], max_tokens=4)[0] for p in prompts + prompts[:2]]
    _check(eng, prompts + prompts[:2], outs, 4)
    st = eng.stats()["prefix_cache"]
    assert st["evictions"] > 0 and st["hits"] == 0  # prompts[0] and [1] were evicted before they came back
    again = eng.generate([prompts[1]], max_tokens=4)[0]  # just computed: cached now
    assert again.token_ids == outs[1].token_ids and eng.stats()["prefix_cache"]["hits"] == 16


@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.8, seed=9)])
def test_preemption_with_a_tiny_pool_and_shared_prefixes(chunked, sampling):
    prompts = _shared_prefix_prompts(16, prefix_len=13, seed=4)
    extra = {"max_num_batched_tokens": 8} if chunked else {"enable_chunked_prefill": False}
    tight = _engine(blocks=14, **extra)
    outs = tight.generate(prompts, sampling, max_tokens=20)
    _check(tight, prompts, outs, 20, sampling)
    st = tight.stats()
    assert st["preemptions"] > 0 and st["prefix_cache"]["hits"] > 0
    assert tight.schedulers[0].blocks.num_free == 13 and tight.schedulers[0].blocks.num_referenced == 0


def test_reset_empties_the_cache():
    """The toy executor wipes its K/V store on reset: a cache that survived the reset would read unwritten slots."""
    eng = _engine()
    prompts = _shared_prefix_prompts(4)
    eng.generate(prompts[:2], max_tokens=5)
    assert eng.schedulers[0].blocks.num_cached > 0
    rid = eng.add_request(eng.make_request(prompts[2], max_tokens=9))
    eng.step()
    eng.step()
    eng.reset()  # mid-flight: the running request is preempted and recomputed afterwards
    assert eng.schedulers[0].blocks.num_cached == 0
    hits_before = eng.stats()["prefix_cache"]["hits"]
    final = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                final[o.request_id] = o
    assert final[rid].token_ids == eng.executor.reference(prompts[2], 9)
    assert eng.stats()["prefix_cache"]["hits"] == hits_before  # nothing cached survived to hit
    out = eng.generate([prompts[3]], max_tokens=5)[0]
    assert out.token_ids == eng.executor.reference(prompts[3], 5) and eng.stats()["prefix_cache"]["hits"] > hits_before


def test_a_rank_failure_requeues_and_the_rebuild_empties_the_cache():
    eng = _engine()
    ex = eng.executor
    prompts = _shared_prefix_prompts(6, seed=8)
    eng.generate(prompts[:1], max_tokens=4)
    ids = [eng.add_request(eng.make_request(p, max_tokens=10)) for p in prompts[1:]]
    for _ in range(3):
        eng.step()
    ex.fail_next = 1
    with pytest.raises(EngineStepError):
        eng.step()
    eng.requeue_after_failure()
    eng.rebuild()  # the toy's store is wiped: a block still cached would be read unwritten
    assert eng.schedulers[0].blocks.num_cached == 0 and ex.rebuilds == 1
    final = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                final[o.request_id] = o
    assert [final[i].token_ids for i in ids] == [ex.reference(p, 10) for p in prompts[1:]]
    assert eng.schedulers[0].blocks.num_cached > 0  # the requeued requests cached their blocks again


def test_dp_placement_prefers_the_rank_holding_the_prefix_then_the_least_loaded():
    eng = _engine(dp=2)
    prompts = _shared_prefix_prompts(3, seed=5)
    eng.generate(prompts[:1], max_tokens=3)
    home = [i for i, s in enumerate(eng.schedulers) if s.blocks.num_cached][0]

    def placed(prompt: list[int]) -> int:
        return eng._seqs[eng.add_request(eng.make_request(prompt, max_tokens=30))].dp_rank

    def load() -> list[int]:
        return [len(s.waiting) + len(s.running) for s in eng.schedulers]

    while load()[home] <= load()[1 - home]:  # make the prefix's rank the busier one
        placed([90] * 9)
    assert placed(prompts[1]) == home  # the longest cached prefix wins over the load
    assert placed(prompts[2][:4] + [1, 2, 3, 4, 5]) == home  # one cached block is enough
    assert placed(prompts[2][:3] + [1, 2, 3, 4, 5]) == 1 - home  # shorter than a block: the least loaded
    assert placed([70] * 9) == int(np.argmin(load()))
    while eng.has_unfinished():
        eng.step()
    st = eng.stats()
    assert st["dp_ranks"][home]["prefix_cache"]["hits"] == 20 + 4 and st["prefix_cache"]["hits"] == 24
    assert st["prefix_cache"]["queries"] == sum(r["prefix_cache"]["queries"] for r in st["dp_ranks"])


def test_n_samples_share_the_prompt_blocks_and_differ():
    """n = 4 seeded: the samples wait for the first to compute the prompt, then reference its full blocks (ref
    count 4, no copy) and compute only the partial block; each sample equals the reference with its derived seed,
    the four differ, and a second run reproduces them."""
    eng = _engine()
    prompt = list(range(3, 26))  # 23 tokens: 5 full blocks + 3
    sp = SamplingParams(temperature=1.0, seed=42)
    runs = []
    for _ in range(2):
        reqs = eng.make_samples(eng.make_request(prompt, sp, max_tokens=12), 4)
        ids = [eng.add_request(r) for r in reqs]
        s = eng.schedulers[0]
        eng.step()  # the first sample's prefill; the others are held
        assert [eng._seqs[i].status.value for i in ids] == ["running", "waiting", "waiting", "waiting"]
        eng.step()  # the three others admitted with the shared blocks
        tables = [eng._seqs[i].block_table for i in ids]
        shared = tables[0][:5]
        assert all(t[:5] == shared for t in tables) and len({t[5] for t in tables}) == 4
        assert all(s.blocks.ref_count(b) == 4 for b in shared)
        assert s.stats()["shared_kv_blocks"] == 5
        assert s.stats()["referenced_kv_blocks"] == 5 + 4 * 1  # 24 tokens -> 6 blocks each, 5 of them shared
        final = {}
        while eng.has_unfinished():
            for o in eng.step():
                if o.finished:
                    final[o.request_id] = o
        runs.append([final[i].token_ids for i in ids])
    assert runs[0] == runs[1] and len({tuple(t) for t in runs[0]}) == 4
    ref = eng.executor.reference
    assert runs[0] == [ref(prompt, 12, temperature=1.0, seed=derive_seed(42, i)) for i in range(4)]
    assert runs[0][0] == eng.generate([prompt], sp, max_tokens=12)[0].token_ids  # sample 0 is the n = 1 sample


def test_n_samples_are_checked_against_the_kv_capacity():
    from engine import RequestError

    eng = _engine(blocks=20)  # 19 usable blocks of 4 tokens
    req = eng.make_request(list(range(1, 22)), max_tokens=8)  # 29 tokens -> 8 blocks each, 5 shareable
    assert len(eng.make_samples(req, 4)) == 4  # 5 + 4 * 3 = 17 blocks
    with pytest.raises(RequestError) as e:
        eng.make_samples(req, 5)  # 5 + 5 * 3 = 20
    assert e.value.param == "n" and e.value.code == "kv_capacity_exceeded"
    with pytest.raises(RequestError):
        eng.make_samples(req, 17)
    off = _engine(blocks=20, enable_prefix_caching=False)
    with pytest.raises(RequestError):
        off.make_samples(off.make_request(list(range(1, 22)), max_tokens=8), 3)  # 3 * 8 = 24 without sharing


def test_a_sample_whose_parent_is_aborted_still_runs():
    eng = _engine()
    prompt = list(range(30, 50))
    reqs = eng.make_samples(eng.make_request(prompt, SamplingParams(temperature=0.5, seed=1), max_tokens=5), 3)
    ids = [eng.add_request(r) for r in reqs]
    eng.abort(ids[0])  # before its prompt was computed: the held samples are released
    final = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                final[o.request_id] = o
    assert sorted(final) == sorted(ids[1:])
    ref = eng.executor.reference
    assert [final[i].token_ids for i in ids[1:]] == [ref(prompt, 5, temperature=0.5, seed=derive_seed(1, i))
                                                      for i in (1, 2)]
