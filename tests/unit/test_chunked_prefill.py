"""Chunked prefill on the paged toy executor: a token budget per step shared by decode rows (first, every step) and
prefill chunks; a long prompt split over steps with num_history = tokens computed; only the chunk that completes
the prompt samples; identical tokens to unchunked prefill with preemption, stop tokens, seeded sampling, DP,
multi-step decode and scheduling ahead."""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import pytest

from actors.batch import StepBatch
from engine import EngineConfig, FinishReason, LLMEngine, Request, SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig
from engine.sequence import Sequence as Seq
from engine.testing import PagedToyExecutor


class RecordingToy(PagedToyExecutor):
    """The toy executor, keeping every step's batches (copies of the arrays that matter)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.batches: list[list[Optional[dict]]] = []

    def step(self, batches: Sequence[Optional[StepBatch]], num_steps: int = 1) -> list[Optional[np.ndarray]]:
        self.batches.append([None if b is None else {"q": b.q_seqlens.tolist(), "hist": b.num_history.tolist(),
                                                     "tokens": b.num_tokens} for b in batches])
        return super().step(batches, num_steps)


def _prompts(n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 97, int(rng.integers(lo, hi))).tolist() for _ in range(n)]


def test_a_long_prompt_is_split_and_only_its_last_chunk_samples():
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=4, max_model_len=64), 32, 4)
    seq = Seq(Request.make(list(range(1, 11)), max_tokens=3))
    s.add(seq)
    for hist, q in ((0, 4), (4, 4), (8, 2)):
        b = s.schedule()
        assert b.is_prefill and b.batch.num_history.tolist() == [hist] and b.batch.q_seqlens.tolist() == [q]
        assert b.batch.token_ids.tolist() == list(range(1 + hist, 1 + hist + q))
        s.update(b, np.array([77]))  # the token after an intermediate chunk is dropped
        if hist < 8:
            assert seq.num_tokens == 10 and seq.num_computed == hist + q and seq.first_token_time is None
    assert seq.output_token_ids == [77] and seq.num_computed == 10 and seq.first_token_time is not None
    assert s.num_chunks == 2 and len(seq.block_table) == 3  # the prompt's blocks were all taken at admission
    b = s.schedule()
    assert not b.is_prefill and b.batch.num_history.tolist() == [10]


def test_decode_rows_come_first_and_the_chunk_takes_what_is_left():
    ex = RecordingToy(num_kv_blocks=64, block_size=4, max_model_len=128)
    eng = LLMEngine(ex, EngineConfig(max_num_seqs=8, max_num_batched_tokens=8))
    shorts = [[i, i + 1, i + 2] for i in (1, 11, 21)]
    ids = [eng.add_request(eng.make_request(p, max_tokens=30)) for p in shorts]
    got: dict[str, list[int]] = {r: [] for r in ids}
    for _ in range(2):  # the three short prompts (9 tokens > 8: two steps), then they decode
        for o in eng.step():
            got[o.request_id] += o.new_token_ids
    long_prompt = list(range(40, 90))  # 50 tokens
    lid = eng.add_request(eng.make_request(long_prompt, max_tokens=4))
    got[lid] = []
    start = len(ex.batches)
    while eng._seqs[lid].first_token_time is None:
        outs = {o.request_id: o for o in eng.step()}
        assert all(len(outs[r].new_token_ids) == 1 for r in ids)  # every decode row got its token this step
        assert lid not in outs or outs[lid].new_token_ids  # an intermediate chunk reports nothing
        for r, o in outs.items():
            got[r] += o.new_token_ids
    steps = [st[0] for st in ex.batches[start:]]
    assert len(steps) == 10  # 3 decode rows + a chunk of 5 tokens per step
    assert all(b["tokens"] == 8 and b["q"] == [1, 1, 1, 5] for b in steps)
    assert [b["hist"][3] for b in steps] == list(range(0, 50, 5))
    assert eng.stats()["prefill_chunks"] == 9 + 1  # the long prompt's 9, and one of the first step's
    while eng.has_unfinished():
        for o in eng.step():
            got[o.request_id] += o.new_token_ids
    assert got[lid] == ex.reference(long_prompt, 4)
    assert [got[r] for r in ids] == [ex.reference(p, 30) for p in shorts]


@pytest.mark.parametrize("dp", [1, 2])
@pytest.mark.parametrize("blocks", [400, 24])
@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.9, seed=11)])
def test_chunked_prefill_gives_the_unchunked_tokens(dp, blocks, sampling):
    """Prompts of 3-60 tokens, budget 16 (chunked, mixed steps) vs whole prompts (phased): identical outputs, equal to
    the reference, with stop tokens, max_tokens, max_model_len and (18 blocks) preemption."""
    prompts = _prompts(20, 3, 60, seed=dp)
    outs, stats = {}, {}
    for chunked in (False, True):
        ex = RecordingToy(num_kv_blocks=blocks, block_size=4, dp_size=dp, max_model_len=80)
        cfg = EngineConfig(max_num_seqs=16, max_num_batched_tokens=16) if chunked else \
            EngineConfig(max_num_seqs=16, enable_chunked_prefill=False)
        eng = LLMEngine(ex, cfg)
        seed = sampling.seed if sampling.seed is not None else -1
        stops = [ex.reference(p, 20, temperature=sampling.temperature, seed=seed)[6] if i % 4 == 0 else -1
                 for i, p in enumerate(prompts)]
        reqs = [eng.make_request(p, sampling, max_tokens=min(20, 80 - len(p)),
                                 stop_token_ids=[stops[i]] if stops[i] >= 0 else []) for i, p in enumerate(prompts)]
        res = eng.run_to_completion(reqs)
        outs[chunked] = [(o.token_ids, o.finish_reason) for o in res]
        stats[chunked] = eng.stats()
        if chunked:
            assert all(b is None or b["tokens"] <= 16 for st in ex.batches for b in st)
            mixed = [b for st in ex.batches for b in st if b is not None and 1 in b["q"] and max(b["q"]) > 1]
            assert mixed  # decode rows and a prefill chunk in one step
        for p, r, o in zip(prompts, reqs, res):
            assert o.token_ids == ex.reference(p, r.max_tokens, stop=r.stop_token_ids,
                                               temperature=sampling.temperature, seed=seed)
        assert all(s.blocks.num_referenced == 0 and s.blocks.num_free == blocks - 1 for s in eng.schedulers)
    assert outs[True] == outs[False]
    assert stats[True]["prefill_chunks"] > 0 and stats[False]["prefill_chunks"] == 0
    assert stats[True]["chunked_prefill"] and not stats[False]["chunked_prefill"]
    if blocks < 100:
        assert stats[True]["preemptions"] > 0
    assert any(r is FinishReason.STOP for _, r in outs[True])


@pytest.mark.parametrize("dp", [1, 2])
def test_chunked_prefill_with_multi_step_decode_and_scheduling_ahead(dp):
    """Multi-step decode and scheduling ahead apply to pure decode rounds only; with chunked prefill and prefix
    caching on they still give the single-step tokens and really run."""
    prompts = _prompts(12, 5, 45, seed=20 + dp)
    runs = {}
    for mode in ("plain", "multi", "ahead"):
        ex = RecordingToy(num_kv_blocks=300, block_size=4, dp_size=dp, max_model_len=80)
        cfg = dict(max_num_seqs=16, max_num_batched_tokens=12)
        if mode == "multi":
            cfg["decode_steps"] = 4
        if mode == "ahead":
            cfg["overlap"] = True
        eng = LLMEngine(ex, EngineConfig(**cfg))
        reqs = [eng.make_request(p, max_tokens=6 + i % 7) for i, p in enumerate(prompts)]
        runs[mode] = [o.token_ids for o in eng.run_to_completion(reqs)]
        if mode == "multi":
            assert ex.multi_steps > 0
        if mode == "ahead":
            assert ex.ahead_rounds > 0
        assert eng.stats()["prefill_chunks"] > 0
    assert runs["plain"] == runs["multi"] == runs["ahead"]
    assert runs["plain"] == [PagedToyExecutor().reference(p, 6 + i % 7) for i, p in enumerate(prompts)]


def test_a_budget_at_or_above_max_model_len_means_unchunked():
    cfg = SchedulerConfig(max_num_batched_tokens=64, max_model_len=64)
    assert not cfg.chunked and SchedulerConfig(max_num_batched_tokens=63, max_model_len=64).chunked
    assert not SchedulerConfig(max_num_batched_tokens=8, max_model_len=64, enable_chunked_prefill=False).chunked
    eng = LLMEngine(PagedToyExecutor(max_model_len=256), EngineConfig())
    assert eng.sched_config.max_num_batched_tokens == 2048 and not eng.sched_config.chunked
    eng = LLMEngine(PagedToyExecutor(max_model_len=256), EngineConfig(enable_chunked_prefill=False))
    assert eng.sched_config.max_num_batched_tokens == 2048 and not eng.stats()["chunked_prefill"]
