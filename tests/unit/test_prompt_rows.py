"""`engine.prompt_rows` through the scheduler: a sequence asking for prompt log-probabilities gets exactly one entry
per prompt token after the first, in order, whatever the chunking, with other rows in its steps, after a
preemption in the middle of its prompt and with its prompt's blocks in the prefix cache. The ranks' answers are
made from each ask here (an entry encodes its target token), so a misplaced, skipped or repeated position shows."""
from __future__ import annotations

import numpy as np
import pytest

from actors.batch import SampledTokens
from actors.prompt_logprobs import PromptLogprobs
from engine import Request, SamplingParams
from engine.prompt_rows import PromptRowsError, build_ask
from engine.scheduler import Scheduler, SchedulerConfig
from engine.sequence import Sequence


def _answer(batch) -> SampledTokens:
    """Tokens 7 for every row; for the ask, chosen = -target, rank = target, top ids = [target, row]."""
    toks = np.full(batch.batch_size, 7, np.int64)
    ask = batch.prompt_lp
    if ask is None:
        return toks
    t = ask.targets
    return SampledTokens(toks, None, PromptLogprobs(-t.astype(np.float32), t.astype(np.int32),
                                                    np.stack([t, ask.rows], 1).astype(np.int32)[:, :ask.num_top],
                                                    np.zeros((len(t), ask.num_top), np.float32)))


def _run(s: Scheduler, until) -> None:
    while not until():
        b = s.schedule()
        s.update(b, _answer(b.batch))


@pytest.mark.parametrize("budget", [5, 8, 64])
def test_every_prompt_position_is_asked_once_in_order(budget):
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget, max_model_len=128), 64, 4)
    prompt = [int(x) for x in np.random.default_rng(budget).integers(10, 500, 30)]
    other = Sequence(Request.make(list(range(1, 12)), max_tokens=6))
    seq = Sequence(Request.make(prompt, SamplingParams(prompt_logprobs=2), max_tokens=3))
    s.add(other)
    s.add(seq)
    _run(s, lambda: seq.is_finished and other.is_finished)
    assert [e[1] for e in seq.prompt_lp] == prompt[1:]  # rank = target: position p's entry is prompt[p + 1]
    assert [e[0] for e in seq.prompt_lp] == [-float(t) for t in prompt[1:]]
    assert all(len(e[2]) == 2 for e in seq.prompt_lp) and other.prompt_lp is None
    out = seq.take_output()
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)


def test_a_preempted_or_cached_prompt_asks_only_what_it_lacks():
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8, max_model_len=128), 64, 4)
    prompt = list(range(100, 140))
    plain = Sequence(Request.make(prompt, max_tokens=1))  # puts the prompt's blocks in the prefix cache
    s.add(plain)
    _run(s, lambda: plain.is_finished)
    seq = Sequence(Request.make(prompt, SamplingParams(prompt_logprobs=0), max_tokens=2))
    s.add(seq)
    b = s.schedule()
    assert b.batch.num_history.tolist() == [0]  # the cache is not used for positions it still needs
    s.update(b, _answer(b.batch))
    b = s.schedule()
    s.update(b, _answer(b.batch))
    assert len(seq.prompt_lp) == 16
    s.running.remove(seq)
    s._preempt(seq)  # in the middle of its prompt
    b = s.schedule()
    hist = int(b.batch.num_history[0])
    assert 0 < hist <= 16 and hist % 4 == 0  # whole cached blocks, none past its entries
    s.update(b, _answer(b.batch))
    _run(s, lambda: seq.is_finished)
    assert [e[1] for e in seq.prompt_lp] == prompt[1:]


def test_an_ask_that_would_skip_positions_is_an_error():
    seq = Sequence(Request.make(list(range(1, 20)), SamplingParams(prompt_logprobs=1)))
    with pytest.raises(PromptRowsError, match="after the 0 prompt positions"):
        build_ask([seq], [4], [8])
    assert build_ask([seq], [0], [1])[0].rows.tolist() == [0]  # a one-token chunk asks one position
    seq.prompt_lp.extend([(0.0, 1, [], [])] * 18)
    assert build_ask([seq], [18], [1]) == (None, [])  # the last prompt position predicts the first output


def test_a_held_sample_takes_its_parents_entries_and_reuses_its_blocks():
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=8, max_model_len=128), 64, 4)
    prompt = list(range(200, 222))
    sp = SamplingParams(prompt_logprobs=1, temperature=1.0)
    parent = Sequence(Request.make(prompt, sp, max_tokens=4))
    child = Sequence(Request.make(prompt, sp, max_tokens=4))
    s.add(parent)
    s.add(child, after=parent)
    asked = []
    while not (parent.is_finished and child.is_finished):
        b = s.schedule()
        if child in b.seqs and not child.prefilled:
            owners = [b.seqs[i] for i, _ in b.prompt_owners or ()]
            asked.append((int(b.batch.num_history[b.seqs.index(child)]), child in owners))
        s.update(b, _answer(b.batch))
    assert child.prompt_lp == parent.prompt_lp and len(child.prompt_lp) == len(prompt) - 1
    assert asked == [(20, False)]  # the parent's 5 full blocks, then its last two tokens: nothing asked
