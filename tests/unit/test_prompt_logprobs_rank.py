"""Prompt log-probabilities on a CPU rank (`actors.rank_prompt_logprobs`) and across the pipe wire format.

The rank's answer for a prompt computed in two chunks beside another prompt equals, position by position, the
log-softmax of the last-token logits of that prompt's prefix computed alone (the eager LM head's logits, seen by a
logits observer): the target's log-probability, its rank among all ids, and the top ids and log-probabilities."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from actors.batch import SampledTokens, StepBatch, StepLogprobs
from actors.prompt_logprobs import PromptLogprobs, PromptLogprobsAsk
from actors.protocol import StepPlan
from actors.local import LocalExecutor
from actors.runtime_config import RuntimeConfig
from graphrunner.config import GraphRunnerConfig
from actors.wire import decode_reply, decode_request, encode_request, encode_tokens
from engine.sampling_rows import build_extras

K = 5


@pytest.fixture(scope="module")
def rank():
    ex = LocalExecutor(RuntimeConfig(model="qwen3-tiny", device="cpu", num_kv_blocks=128, max_model_len=512,
                                     graph=GraphRunnerConfig(max_decode_batch=4, pcg_max_tokens=64,
                                                             pcg_token_stride=32)))
    ex.start()
    return ex.runtime


def _reference(rt, prompt: list[int], first_block: int) -> list[tuple[float, int, list[int], list[float]]]:
    """Per position p < len - 1: the prefix prompt[:p + 1] alone, its last-token logits -> prompt[p + 1]'s entry."""
    seen: list[torch.Tensor] = []
    rt.logits_observer = lambda lg: seen.append(lg.detach().clone())
    out = []
    try:
        for p in range(len(prompt) - 1):
            rt.execute(StepBatch.from_sequences([prompt[:p + 1]], [0], [[first_block, first_block + 1]]))
            lp = torch.log_softmax(seen[-1][0].float(), dim=-1)
            t = prompt[p + 1]
            vals, ids = lp.topk(K)
            out.append((float(lp[t]), int((lp > lp[t]).sum()) + 1, ids.tolist(), vals.tolist()))
    finally:
        rt.logits_observer = None
    return out


@torch.inference_mode()
def test_chunked_prompt_logprobs_equal_each_prefix_alone(rank):
    rng = np.random.default_rng(0)
    vocab = rank.model_config.vocab_size
    a = [int(x) for x in rng.integers(0, vocab, 9)]
    b = [int(x) for x in rng.integers(0, vocab, 30)]
    # step 1: a whole (positions 0..7 ask) and b's first 20 tokens (positions 0..19); step 2: b's last 10 (20..28)
    ask1 = PromptLogprobsAsk(np.array(list(range(8)) + list(range(9, 29)), np.int64),
                             np.array(a[1:9] + b[1:21], np.int64), K)
    step1 = StepBatch.from_sequences([a, b[:20]], [0, 0], [[1, 2], [3, 4]])
    step1.prompt_lp = ask1
    out1 = rank.execute(step1)
    step2 = StepBatch.from_sequences([b[20:]], [20], [[3, 4]])
    step2.prompt_lp = PromptLogprobsAsk(np.arange(9, dtype=np.int64), np.array(b[21:30], np.int64), K)
    out2 = rank.execute(step2)
    assert isinstance(out1, SampledTokens) and out1.logprobs is None and out1.prompt.chosen.shape == (28,)
    got = [(float(c), int(r), i.tolist(), v.tolist()) for p in (out1.prompt, out2.prompt)
           for c, r, i, v in zip(p.chosen, p.ranks, p.top_ids, p.top_logprobs)]
    want = _reference(rank, a, 10)[:8] + _reference(rank, b, 20)
    assert len(got) == len(want) == 8 + 29
    for (gc, gr, gi, gv), (wc, wr, wi, wv) in zip(got, want):
        assert gc == pytest.approx(wc, abs=1e-4) and gr == wr and gi == wi
        assert np.allclose(gv, wv, atol=1e-4)
    # the step's tokens are those of the same step without the ask
    again = rank.execute(StepBatch.from_sequences([a, b[:20]], [0, 0], [[1, 2], [3, 4]]))
    assert out1.tokens.tolist() == again.tolist()
    # with sampled rows that ask for logprobs too: both come back, each in its own shape
    step1.temperature = np.ones(2, np.float32)
    step1.seeds = np.array([3, 4], np.int64)
    seqs_lp = build_extras([_Row(3), _Row(3)])
    step1.extras = seqs_lp
    both = rank.execute(step1)
    assert both.logprobs.top_ids.shape == (2, 3) and both.prompt.chosen.tolist() == out1.prompt.chosen.tolist()


class _Row:
    """A sequence stand-in for `build_extras`: a request asking for `n` logprobs."""

    def __init__(self, n: int):
        from engine.sampling_rows import LOGPROBS, FLAG_BITS
        self.extras_flags = LOGPROBS | (n + 1) << FLAG_BITS


def test_the_pipe_wire_carries_asks_and_answers():
    rng = np.random.default_rng(1)
    batch = StepBatch.from_sequences([[1, 2, 3], [4, 5]], [0, 7], [[1], [2, 3]], temperature=[0.0, 1.0],
                                     seeds=[-1, 9])
    batch.prompt_lp = PromptLogprobsAsk(np.array([0, 1, 3], np.int64), np.array([2, 3, 5], np.int64), 4)
    for extras in (None, build_extras([_Row(2), _Row(2)])):
        batch.extras = extras
        plan = StepPlan((batch,))
        frame = encode_request(plan, 0)
        (got, _), _, _ = decode_request(memoryview(frame)[4:])
        assert got.prompt_lp.rows.tolist() == [0, 1, 3] and got.prompt_lp.targets.tolist() == [2, 3, 5]
        assert got.prompt_lp.num_top == 4 and got.token_ids.tolist() == [1, 2, 3, 4, 5]
        assert (got.extras is None) == (extras is None)
        if extras is not None:
            assert got.extras.num_logprobs == 2
    m, k = 3, 4
    prompt = PromptLogprobs(-rng.random(m, dtype=np.float32), np.array([1, 7, 2], np.int32),
                            rng.integers(0, 99, (m, k)).astype(np.int32), -rng.random((m, k), dtype=np.float32))
    step_lp = StepLogprobs(-rng.random(2, dtype=np.float32), rng.integers(0, 99, (2, 2)).astype(np.int32),
                           -rng.random((2, 2), dtype=np.float32))
    for lp in (None, step_lp):
        reply = encode_tokens(SampledTokens(np.array([5, 6], np.int64), lp, prompt), 0.5)
        _, seconds, out = decode_reply(reply[4:])
        assert seconds == 0.5 and out.tokens.tolist() == [5, 6]
        assert (out.logprobs is None) == (lp is None)
        if lp is not None:
            assert all(np.array_equal(x, y) for x, y in zip(out.logprobs, lp))
        assert all(np.array_equal(x, y) for x, y in zip(out.prompt, prompt))
    one = StepLogprobs(*(a[:1] for a in step_lp))
    _, _, plain = decode_reply(encode_tokens(SampledTokens(np.array([5], np.int64), one), 0.1)[4:])
    assert plain.prompt is None and plain.logprobs.top_ids.shape == (1, 2)
