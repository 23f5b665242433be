"""Scheduler policies: FCFS admission under a token budget and a sequence cap, decode of every running
sequence, block accounting, preemption by recompute (identical tokens), stop conditions."""
from __future__ import annotations

import collections

import numpy as np
import pytest

from engine import EngineConfig, FinishReason, LLMEngine, Request, SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig, SchedulerError
from engine.sequence import Sequence, SeqStatus
from engine.testing import PagedToyExecutor, ToyExecutorError


def _prompts(n: int, lo: int = 3, hi: int = 12, vocab: int = 97, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, int(rng.integers(lo, hi))).tolist() for _ in range(n)]


def _seq(n_prompt: int, max_tokens: int = 8, **kw) -> Sequence:
    return Sequence(Request.make(list(range(1, n_prompt + 1)), max_tokens=max_tokens, **kw))


def test_fcfs_admission_respects_token_budget_and_seq_cap():
    """The phased policy (chunked prefill off): whole prompts, FCFS, within the budget and the sequence cap."""
    s = Scheduler(SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=20, max_model_len=64,
                                  enable_chunked_prefill=False), 100, 4)
    seqs = [_seq(8), _seq(8), _seq(8), _seq(2), _seq(2)]
    for q in seqs:
        s.add(q)
    b = s.schedule()
    assert b.is_prefill and b.seqs == seqs[:2]  # 8 + 8 fits 20, the third 8 does not
    assert list(b.batch.q_seqlens) == [8, 8] and list(b.batch.num_history) == [0, 0]
    s.update(b, np.array([5, 6]))
    b = s.schedule()  # the head (8 tokens) fits now; the cap of 3 running stops there (FCFS, no skipping)
    assert b.is_prefill and b.seqs == [seqs[2]]
    s.update(b, np.array([7]))
    b = s.schedule()
    assert not b.is_prefill and b.seqs == seqs[:3] and b.batch.is_decoding
    assert list(b.batch.num_history) == [8, 8, 8] and list(b.batch.token_ids) == [5, 6, 7]


def test_single_prompt_larger_than_budget_is_admitted_alone():
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=4, max_model_len=64, enable_chunked_prefill=False), 100, 4)
    a, b = _seq(10), _seq(2)
    s.add(a)
    s.add(b)
    first = s.schedule()
    assert first.seqs == [a]


def test_blocks_allocated_lazily_and_freed_on_finish():
    s = Scheduler(SchedulerConfig(max_model_len=64), 10, 4)
    q = _seq(4, max_tokens=3)
    s.add(q)
    b = s.schedule()
    assert len(q.block_table) == 1 and s.allocator.num_free == 8
    s.update(b, np.array([1]))
    b = s.schedule()  # decode feeds position 4: a second block
    assert len(q.block_table) == 2 and b.batch.block_tables.shape == (1, 2)
    s.update(b, np.array([2]))
    b = s.schedule()
    s.update(b, np.array([3]))
    assert q.is_finished and q.finish_reason is FinishReason.LENGTH and q.output_token_ids == [1, 2, 3]
    assert s.allocator.num_free == 9 and not s.has_unfinished
    assert 0 not in q.block_table


def test_preemption_frees_newest_and_requeues_it_first():
    s = Scheduler(SchedulerConfig(max_model_len=64, watermark_blocks=0), 3, 4)  # 2 usable blocks
    a, b = _seq(4, max_tokens=8), _seq(4, max_tokens=8)
    s.add(a)
    s.add(b)
    step = s.schedule()
    assert step.seqs == [a, b] and s.allocator.num_free == 0
    s.update(step, np.array([1, 2]))
    step = s.schedule()  # both need a second block: b (newest) is preempted, a decodes
    assert step.seqs == [a] and not step.is_prefill
    assert b.status is SeqStatus.WAITING and b.num_computed == 0 and b.block_table == [] and b.num_preemptions == 1
    assert s.waiting[0] is b and b.token_ids == [1, 2, 3, 4, 2]  # recomputed with its generated token
    assert s.num_preemptions == 1


def test_a_lone_sequence_that_cannot_grow_preempts_itself():
    s = Scheduler(SchedulerConfig(max_model_len=64, watermark_blocks=0), 2, 4)  # 1 usable block
    a = _seq(4, max_tokens=8)
    s.add(a)
    s.update(s.schedule(), np.array([1]))
    assert s.schedule() is None and a.status is SeqStatus.WAITING


def test_schedule_update_protocol_errors():
    s = Scheduler(SchedulerConfig(max_model_len=64), 10, 4)
    s.add(_seq(3))
    b = s.schedule()
    with pytest.raises(SchedulerError):
        s.schedule()
    with pytest.raises(SchedulerError):
        s.update(b, np.array([1, 2]))


@pytest.mark.parametrize("dp", [1, 2])
@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.8, seed=7)])
def test_preemption_under_memory_pressure_gives_identical_tokens(dp, sampling):
    prompts = _prompts(24, seed=dp)
    roomy = LLMEngine(PagedToyExecutor(num_kv_blocks=400, block_size=4, dp_size=dp), EngineConfig(max_num_seqs=32))
    tight = LLMEngine(PagedToyExecutor(num_kv_blocks=14, block_size=4, dp_size=dp), EngineConfig(max_num_seqs=32))
    a = roomy.generate(prompts, sampling, max_tokens=24)
    b = tight.generate(prompts, sampling, max_tokens=24)
    assert roomy.stats()["preemptions"] == 0
    assert tight.stats()["preemptions"] > 0
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    ref = roomy.executor.reference
    assert [o.token_ids for o in a] == [ref(p, 24, temperature=sampling.temperature, seed=sampling.seed or -1)
                                        for p in prompts]
    assert all(s.allocator.num_free == 13 for s in tight.schedulers)


def test_stop_token_ends_generation_and_is_its_last_counted_token():
    ex = PagedToyExecutor()
    eng = LLMEngine(ex, EngineConfig())
    prompt = [1, 2, 3]
    free = ex.reference(prompt, 10)
    stop = free[4]
    out = eng.generate([prompt], max_tokens=10, stop_token_ids=[stop])[0]
    assert out.finish_reason is FinishReason.STOP and out.stopped_on_token
    assert out.token_ids == free[: free.index(stop) + 1]


def test_the_models_eos_stops_generation_unless_ignore_eos():
    from engine import SamplingParams

    ex = PagedToyExecutor()
    prompt = [1, 2, 3]
    free = ex.reference(prompt, 10)
    eos = free[3]
    eng = LLMEngine(ex, EngineConfig(eos_token_ids=(eos,)))
    stopped = eng.generate([prompt], max_tokens=10)[0]
    ignored = eng.generate([prompt], SamplingParams(ignore_eos=True), max_tokens=10)[0]
    assert stopped.token_ids == free[: free.index(eos) + 1] and stopped.finish_reason is FinishReason.STOP
    assert ignored.token_ids == free and ignored.finish_reason is FinishReason.LENGTH


def test_max_tokens_and_max_model_len_stop_with_length():
    ex = PagedToyExecutor(max_model_len=20)
    eng = LLMEngine(ex, EngineConfig())
    out = eng.generate([[1, 2, 3]], max_tokens=5)[0]
    assert out.finish_reason is FinishReason.LENGTH and len(out.token_ids) == 5
    out = eng.generate([[1, 2, 3]], max_tokens=None)[0]  # until max_model_len
    assert out.finish_reason is FinishReason.LENGTH and len(out.token_ids) == 17
    assert out.token_ids == ex.reference([1, 2, 3], 17)


def test_abort_frees_blocks_and_other_requests_continue():
    ex = PagedToyExecutor(num_kv_blocks=32)
    eng = LLMEngine(ex, EngineConfig())
    r1 = eng.add_request(eng.make_request([1, 2, 3], max_tokens=20))
    r2 = eng.add_request(eng.make_request([4, 5, 6], max_tokens=6))
    eng.step()
    eng.step()
    out = eng.abort(r1)
    assert out.request_id == r1 and len(out.token_ids) == 2
    assert eng.abort(r1) is None
    final = {}
    while eng.has_unfinished():
        for o in eng.step():
            final[o.request_id] = o
    assert list(final) == [r2] and final[r2].token_ids == ex.reference([4, 5, 6], 6)
    assert eng.schedulers[0].allocator.num_free == 31


def test_continuous_batching_admits_new_requests_while_others_decode():
    ex = PagedToyExecutor(num_kv_blocks=64)
    eng = LLMEngine(ex, EngineConfig())
    a = eng.add_request(eng.make_request([1, 2, 3], max_tokens=10))
    for _ in range(3):
        eng.step()
    b = eng.add_request(eng.make_request([7, 8], max_tokens=4))
    outs = {}
    while eng.has_unfinished():
        for o in eng.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert ("decode", 2) in [s[0] for s in ex.steps]  # a and b decoded together
    assert outs[b] == ex.reference([7, 8], 4)
    assert len(outs[a]) == 7  # 3 tokens were returned before b arrived


def test_toy_executor_catches_a_wrong_history():
    ex = PagedToyExecutor()
    s = Scheduler(SchedulerConfig(max_model_len=64), 64, 4)
    q = _seq(5)
    s.add(q)
    b = s.schedule()
    b.batch.num_history[:] = 1  # claims one cached token nobody wrote
    b.batch.block_tables[:] = [[1, 2]]
    with pytest.raises(ToyExecutorError, match="unwritten"):
        ex.step([b.batch])


def test_dp_ranks_share_the_load():
    ex = PagedToyExecutor(num_kv_blocks=64, dp_size=2)
    eng = LLMEngine(ex, EngineConfig())
    outs = eng.generate(_prompts(6), max_tokens=4)
    assert len(outs) == 6
    assert any(s[0] is not None and s[1] is not None for s in ex.steps)  # both ranks busy in one step


@pytest.mark.parametrize("dp", [1, 2])
@pytest.mark.parametrize("blocks", [400, 14])
def test_multi_step_decode_gives_the_single_step_tokens(dp, blocks):
    """decode_steps=5: rounds of several decode steps (tokens fed back by the executor) produce exactly the
    tokens of one step at a time, with stop tokens, max_tokens, max_model_len and memory pressure (fewer
    steps when lookahead blocks are short, preemption as usual); every block is free at the end."""
    prompts = _prompts(24, seed=dp)
    ex = PagedToyExecutor(num_kv_blocks=blocks, block_size=4, dp_size=dp, max_model_len=36)
    eng = LLMEngine(ex, EngineConfig(max_num_seqs=32, decode_steps=5))
    ref = ex.reference
    stops = [ref(p, 30)[7] if i % 3 == 0 else -1 for i, p in enumerate(prompts)]
    reqs = [eng.make_request(p, max_tokens=min([3, 17, 30][i % 3], 36 - len(p)),
                             stop_token_ids=[stops[i]] if stops[i] >= 0 else []) for i, p in enumerate(prompts)]
    outs = eng.run_to_completion(reqs)
    assert any(len(p) + r.max_tokens == 36 for p, r in zip(prompts, reqs))  # some run into max_model_len
    for p, r, o in zip(prompts, reqs, outs):
        assert o.token_ids == ref(p, r.max_tokens, stop=r.stop_token_ids), (len(p), r.max_tokens)
    assert ex.multi_steps > 0
    assert all(s.allocator.num_free == blocks - 1 for s in eng.schedulers)


def test_multi_step_decode_serves_sampled_requests_not_sampler_extras_and_is_validated():
    ex = PagedToyExecutor(num_kv_blocks=100, block_size=4)
    eng = LLMEngine(ex, EngineConfig(decode_steps=4))
    eng.generate([[1, 2, 3], [4, 5]], SamplingParams(temperature=0.7, seed=3), max_tokens=6)
    assert ex.multi_steps > 0  # temperature / top-k / top-p rows: each step's draw keyed by its own position
    ex2 = PagedToyExecutor(num_kv_blocks=100, block_size=4)
    eng2 = LLMEngine(ex2, EngineConfig(decode_steps=4))
    eng2.generate([[1, 2, 3], [4, 5]], SamplingParams(temperature=0.7, seed=3, presence_penalty=0.5), max_tokens=6)
    assert ex2.multi_steps == 0  # penalties need each step's token on the driver first
    from actors.batch import BatchError, StepBatch

    b = StepBatch.from_sequences([[5]], [6], [[1, 2]])
    with pytest.raises(BatchError, match="too short for 3 decode steps"):
        b.check_multi_step(3, 4)
    with pytest.raises(BatchError, match="decode batch"):
        StepBatch.from_sequences([[5, 6]], [0], [[1, 2]]).check_multi_step(2, 4)
    StepBatch.from_sequences([[5]], [1], [[1, 2]], temperature=[0.5]).check_multi_step(2, 4)  # sampled: allowed
    with pytest.raises(ValueError, match="decode_steps"):
        EngineConfig(decode_steps=0) and LLMEngine(ex, EngineConfig(decode_steps=0))


@pytest.mark.parametrize("dp", [1, 2])
@pytest.mark.parametrize("blocks", [14, 400])
def test_overlapped_rounds_give_the_synchronous_tokens(dp, blocks):
    """Scheduling ahead (token ids referring to the round in flight) under preemption, stop tokens, seeded
    sampling and max_tokens: the same outputs as synchronous rounds, rounds really ran ahead, no block leaks."""
    prompts = _prompts(20, seed=10 + dp)
    sp = [SamplingParams(), SamplingParams(temperature=0.7, seed=3)]
    runs = {}
    for overlap in (False, True):
        ex = PagedToyExecutor(num_kv_blocks=blocks, block_size=4, dp_size=dp)
        eng = LLMEngine(ex, EngineConfig(max_num_seqs=32, overlap=overlap))
        stops = [ex.reference(p, 12)[5] for p in prompts[:5]]  # five requests stop on their sixth token
        ids = [eng.add_request(eng.make_request(p, sp[i % 2], max_tokens=6 + i % 9,
                                                stop_token_ids=[stops[i]] if i < 5 else []))
               for i, p in enumerate(prompts)]
        final = {}
        while eng.has_unfinished():
            for o in eng.step():
                assert o.request_id not in final, "a request was reported finished twice"
                if o.finished:
                    final[o.request_id] = o
        runs[overlap] = ([(final[i].token_ids, final[i].finish_reason) for i in ids], ex.ahead_rounds)
        assert all(s.allocator.num_free == blocks - 1 for s in eng.schedulers)
    assert runs[True][0] == runs[False][0]
    assert runs[False][1] == 0 and runs[True][1] > (10 if blocks > 100 else 0)  # tight: waiting requests go first
    assert any(reason is FinishReason.STOP for _, reason in runs[True][0])


def test_abort_and_reset_while_a_round_runs_ahead():
    ex = PagedToyExecutor(num_kv_blocks=64, block_size=4)
    eng = LLMEngine(ex, EngineConfig(overlap=True))
    keep = eng.add_request(eng.make_request([1, 2, 3], max_tokens=12))
    gone = eng.add_request(eng.make_request([4, 5, 6], max_tokens=12))
    got = {keep: [], gone: []}
    for _ in range(3):
        for o in eng.step():
            got[o.request_id] += o.new_token_ids
    assert eng._ahead is not None  # a decode round was submitted ahead and is still in flight
    out = eng.abort(gone)
    assert out.finished and out.finish_reason is FinishReason.ABORT
    eng.reset()  # collects the round in flight first; its tokens come with the next step
    while eng.has_unfinished():
        for o in eng.step():
            assert o.request_id == keep
            got[keep] += o.new_token_ids
    assert got[keep] == ex.reference([1, 2, 3], 12)
    assert eng.schedulers[0].allocator.num_free == 63
    assert ex.ahead_rounds > 0


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_the_priority_policy_admits_lower_values_first_and_keeps_arrival_order_within_one(policy):
    """One running sequence at a time: the admission order is arrival order under fcfs, and (priority, arrival)
    under priority; a preempted sequence still goes back to the front."""
    s = Scheduler(SchedulerConfig(max_num_seqs=1, max_model_len=64, scheduling_policy=policy), 100, 4)
    prios = [0, 5, -3, 0, 5, -3, 2]
    seqs = [_seq(3, max_tokens=1, priority=p) for p in prios]
    for q in seqs:
        s.add(q)
    order = []
    while s.has_unfinished:
        b = s.schedule()
        order += b.seqs
        s.update(b, np.array([1] * len(b.seqs)))
    want = seqs if policy == "fcfs" else [seqs[i] for i in sorted(range(len(prios)), key=lambda i: (prios[i], i))]
    assert order == want
    with pytest.raises(ValueError):
        SchedulerConfig(scheduling_policy="lifo")


def test_priority_needs_the_priority_policy():
    fcfs = LLMEngine(PagedToyExecutor(num_kv_blocks=16, block_size=4), EngineConfig(max_model_len=64))
    from engine.errors import RequestError

    with pytest.raises(RequestError) as info:
        fcfs.make_request([1, 2, 3], priority=1)
    assert info.value.param == "priority"
    prio = LLMEngine(PagedToyExecutor(num_kv_blocks=16, block_size=4),
                     EngineConfig(max_model_len=64, scheduling_policy="priority"))
    assert prio.make_request([1, 2, 3], priority=-7).priority == -7
    with pytest.raises(RequestError):
        prio.make_request([1, 2, 3], priority=2**31)


@pytest.mark.parametrize("chunked", [True, False])
def test_a_waiting_higher_priority_request_preempts_the_lowest_running_one(chunked):
    """Priority policy, one sequence slot: a running request of priority 3 is preempted as soon as one of priority
    -1 waits, which runs to the end first; the preempted one then recomputes its tokens and finishes. Equal or
    larger values never preempt. Under fcfs nothing is preempted."""
    for policy in ("priority", "fcfs"):
        s = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=16, max_model_len=64,
                                      scheduling_policy=policy, enable_chunked_prefill=chunked), 100, 4)
        low = _seq(5, max_tokens=6, priority=3)
        s.add(low)
        for _ in range(3):  # prefill + two decode steps
            b = s.schedule()
            s.update(b, np.array([7]))
        same = _seq(3, max_tokens=2, priority=3)
        s.add(same)
        b = s.schedule()
        assert b.seqs == [low]  # an equal priority waits
        s.update(b, np.array([7]))
        high = _seq(4, max_tokens=2, priority=-1)
        s.add(high)
        order = []
        while s.has_unfinished:
            b = s.schedule()
            order.append([q for q in b.seqs])
            s.update(b, np.array([7] * len(b.seqs)))
        if policy == "fcfs":
            assert low.num_preemptions == 0 and order[0] == [low]
            continue
        assert order[0] == [high] and order[1] == [high] and low.num_preemptions == 1
        assert order[2] == [low] and low.is_finished and low.num_output_tokens == 6
        assert s.waiting == collections.deque() and same.is_finished


def test_under_kv_pressure_the_priority_policy_preempts_the_largest_value_not_the_newest():
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64,
                                  scheduling_policy="priority", watermark_blocks=0), 5, 4)  # 4 usable blocks
    old_low = _seq(4, max_tokens=20, priority=9)
    new_high = _seq(4, max_tokens=20, priority=0)
    s.add(old_low)
    s.update(s.schedule(), np.array([7]))
    s.add(new_high)  # admitted beside it (a free slot and blocks): the newest running sequence
    b = s.schedule()
    assert b.seqs == [old_low, new_high]
    s.update(b, np.array([7, 7]))
    while not old_low.num_preemptions:
        b = s.schedule()
        s.update(b, np.array([7] * len(b.seqs)))
    assert new_high.num_preemptions == 0 and s.running == [new_high] and s.waiting[0] is old_low
