"""The scheduler on the real model (qwen3-tiny, one rank, CPU): preemption under memory pressure and
arbitrary batch composition give the same tokens as a roomy run, greedy and seeded sampling; chunked prefill
(mixed steps) and prefix-cached prompts give the unchunked, uncached tokens; n samples share the prompt."""
from __future__ import annotations

import numpy as np
import pytest

from actors.rank import RuntimeConfig
from engine import EngineConfig, FinishReason, LLMEngine, LocalEngineExecutor, SamplingParams
from graphrunner.config import GraphRunnerConfig
from modeling.generate import generate as reference_generate


def _engine(num_kv_blocks: int, max_num_seqs: int = 16) -> LLMEngine:
    cfg = RuntimeConfig(model="qwen3-tiny", device="cpu", block_size=4, num_kv_blocks=num_kv_blocks, max_model_len=128,
                        graph=GraphRunnerConfig(max_decode_batch=4, pcg_max_tokens=32, pcg_token_stride=32))
    ex = LocalEngineExecutor(cfg)
    ex.start(progress=False)
    return LLMEngine(ex, EngineConfig(max_num_seqs=max_num_seqs))


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(11)
    return [rng.integers(1, 512, int(rng.integers(3, 14))).tolist() for _ in range(12)]


@pytest.fixture(scope="module")
def roomy():
    return _engine(256)


@pytest.fixture(scope="module")
def tight():
    return _engine(16)


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.9, top_k=50, seed=5)],
                         ids=["greedy", "seeded"])
def test_preemption_on_the_real_model_gives_identical_tokens(prompts, roomy, tight, sampling):
    before = tight.stats()["preemptions"]
    a = roomy.generate(prompts, sampling, max_tokens=20)
    b = tight.generate(prompts, sampling, max_tokens=20)
    assert tight.stats()["preemptions"] > before
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert all(o.finish_reason is FinishReason.LENGTH and len(o.token_ids) == 20 for o in b)
    assert tight.schedulers[0].allocator.num_free == 15


def test_engine_equals_the_single_batch_reference(prompts, roomy):
    model = roomy.executor.runtime.model
    ref = [reference_generate(model, [p], max_new_tokens=10, block_size=4).tokens[0] for p in prompts[:4]]
    out = roomy.generate(prompts[:4], max_tokens=10)
    assert [o.token_ids for o in out] == ref


def test_stop_token_on_the_real_model(prompts, roomy):
    free = roomy.generate([prompts[0]], max_tokens=12)[0].token_ids
    stop = free[5]
    out = roomy.generate([prompts[0]], max_tokens=12, stop_token_ids=[stop])[0]
    assert out.finish_reason is FinishReason.STOP and out.token_ids == free[: free.index(stop) + 1]


@pytest.fixture(scope="module")
def long_prompts():
    """A shared 37-token system prompt and suffixes of 5-60 tokens (several blocks of 4, longer than a chunk)."""
    rng = np.random.default_rng(12)
    system = rng.integers(1, 512, 37).tolist()
    return [system + rng.integers(1, 512, int(rng.integers(5, 60))).tolist() for _ in range(6)]


def _over(engine: LLMEngine, **cfg) -> LLMEngine:
    """Another engine (fresh schedulers and block pools) over the same started executor. The new engine overwrites
    K/V that `engine`'s prefix cache names, so that cache is emptied (`engine` is idle between tests)."""
    for s in engine.schedulers:
        s.reset_blocks(engine.limits.num_kv_blocks)
    return LLMEngine(engine.executor, EngineConfig(max_num_seqs=16, **cfg))


def test_chunked_prefill_on_the_real_model_gives_the_unchunked_tokens(long_prompts, roomy):
    phased = _over(roomy, enable_chunked_prefill=False, enable_prefix_caching=False)
    chunked = _over(roomy, max_num_batched_tokens=16, enable_prefix_caching=False)
    a = phased.generate(long_prompts, max_tokens=12)
    b = chunked.generate(long_prompts, max_tokens=12)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert chunked.stats()["prefill_chunks"] >= sum(len(p) // 16 for p in long_prompts) - len(long_prompts)
    assert chunked.stats()["chunked_prefill"] and phased.stats()["prefill_chunks"] == 0


@pytest.mark.parametrize("chunked", [False, True], ids=["phased", "chunked"])
def test_prefix_cached_requests_on_the_real_model_give_the_uncached_tokens(long_prompts, roomy, tight, chunked):
    budget = {"max_num_batched_tokens": 16} if chunked else {"enable_chunked_prefill": False}
    off = _over(roomy, enable_prefix_caching=False, **budget)
    on = _over(roomy, **budget)
    ref = [o.token_ids for o in off.generate(long_prompts, max_tokens=10)]
    on.generate(long_prompts[:1], max_tokens=2)  # caches the system prompt's 9 full blocks
    got = [o.token_ids for o in on.generate(long_prompts, max_tokens=10)]
    assert got == ref
    assert on.stats()["prefix_cache"]["hits"] >= 36 * len(long_prompts)
    on.reset(recapture=False)  # the cache is emptied with the KV contents
    assert on.schedulers[0].blocks.num_cached == 0
    assert [o.token_ids for o in on.generate(long_prompts[:2], max_tokens=10)] == ref[:2]
    # a tiny pool (15 usable blocks of 4): evictions and preemptions with shared prefixes
    small = [p[:30] for p in long_prompts]
    want = [o.token_ids for o in _over(roomy, enable_prefix_caching=False, **budget).generate(small, max_tokens=20)]
    pressed = _over(tight, **budget)
    assert [o.token_ids for o in pressed.generate(small, max_tokens=20)] == want
    st = pressed.stats()
    assert st["preemptions"] > 0 and st["prefix_cache"]["hits"] > 0 and st["prefix_cache"]["evictions"] > 0


def test_n_samples_on_the_real_model_share_blocks_differ_and_reproduce(long_prompts, roomy):
    eng = _over(roomy, max_num_batched_tokens=16)
    sp = SamplingParams(temperature=1.0, top_k=50, seed=77)
    prompt = long_prompts[2]
    runs = []
    for _ in range(2):
        reqs = eng.make_samples(eng.make_request(prompt, sp, max_tokens=10), 4)
        runs.append([o.token_ids for o in eng.run_to_completion(reqs)])
    assert runs[0] == runs[1] and len({tuple(t) for t in runs[0]}) == 4
    assert eng.generate([prompt], sp, max_tokens=10)[0].token_ids == runs[0][0]
    full = (len(prompt) - 1) // 4
    assert eng.stats()["prefix_cache"]["hits"] >= 3 * full * 4  # the three forks reused the prompt's full blocks
