"""Prompt log-probabilities on one GPU (qwen3-0.6b in fp32, every graph captured): a step that asks for them takes
the general path whatever its shape (a prefill that a full prefill graph would serve, a mixed step the split path
would take, a one-token chunk shaped like a decode step) and its answers equal the whole prompt's in one step;
each target's log-probability equals the log-softmax of its prefix's last-token logits computed alone."""
import gc

import numpy as np
import pytest
import torch

from actors.batch import SampledTokens, StepBatch
from actors.prompt_logprobs import PromptLogprobsAsk
from tests.gpu.helpers import Seqs, make_runtime, random_tokens

pytestmark = pytest.mark.gpu
K = 4


@pytest.fixture(scope="module")
def rt():
    r = make_runtime("qwen3-0.6b", dtype="float32", max_decode_batch=4, pcg_max_tokens=512, pcg_token_stride=256,
                     prefill_graph_max_tokens=256, prefill_graph_max_seqs=2)
    yield r
    del r
    gc.collect()
    torch.cuda.empty_cache()


def _batch(seqs: Seqs, chunks, history, tables) -> StepBatch:
    return StepBatch.from_sequences(chunks, history, tables)


def _ask(prompt, start, n, offset=0):
    """Positions start .. start + n - 1 of `prompt` (those before its last token) at token offset `offset`."""
    hi = min(start + n, len(prompt) - 1)
    return (list(range(offset, offset + hi - start)), prompt[start + 1:hi + 1])


@torch.inference_mode()
def test_prompt_logprobs_equal_across_chunkings_and_paths(rt):
    rng = np.random.default_rng(0)
    vocab = rt.model_config.vocab_size
    seqs = Seqs(rt)
    prompt = random_tokens(rng, 300, vocab)
    whole_tab = seqs.new(301)
    whole = _batch(seqs, [prompt], [0], [whole_tab])
    rows, targets = _ask(prompt, 0, 300)
    whole.prompt_lp = PromptLogprobsAsk(np.array(rows, np.int64), np.array(targets, np.int64), K)
    ref = rt.execute(whole).prompt
    assert ref.chosen.shape == (299,)
    # the same prompt in chunks of 1, 130 and 169 tokens; the 1-token chunk rides with two decode rows
    others = [random_tokens(rng, 20, vocab) for _ in range(2)]
    o_tabs = [seqs.new(40) for _ in others]
    rt.execute(_batch(seqs, others, [0, 0], o_tabs))
    tab = seqs.new(301)
    got = []
    for start, n in ((0, 1), (1, 130), (131, 169)):
        if start == 0:  # decode-shaped: three rows of one token each
            b = _batch(seqs, [[others[0][-1]], [others[1][-1]], prompt[:1]], [20, 20, 0], [*o_tabs, tab])
            r, t = _ask(prompt, 0, 1, offset=2)
        elif start == 1:  # mixed: a decode row and a prompt chunk
            b = _batch(seqs, [[others[0][-1]], prompt[1:131]], [21, 1], [o_tabs[0], tab])
            r, t = _ask(prompt, 1, 130, offset=1)
        else:  # a prefill a full prefill graph would serve
            b = _batch(seqs, [prompt[131:]], [131], [tab])
            r, t = _ask(prompt, 131, 169)
        b.prompt_lp = PromptLogprobsAsk(np.array(r, np.int64), np.array(t, np.int64), K)
        out = rt.execute(b)
        assert isinstance(out, SampledTokens) and out.tokens.shape == (b.batch_size,)
        got.append(out.prompt)
    chosen = np.concatenate([g.chosen for g in got])
    np.testing.assert_allclose(chosen, ref.chosen, atol=2e-3)
    top = np.concatenate([g.top_ids for g in got])
    agree = (top[:, 0] == ref.top_ids[:, 0]).mean()
    assert agree > 0.97, agree  # fp32 on different step shapes: near-ties may swap
    ranks = np.concatenate([g.ranks for g in got])
    assert (np.abs(ranks.astype(np.int64) - ref.ranks) <= 2).all()
    # against each prefix alone (the eager LM head's last-token logits) at a few positions
    seen = []
    rt.logits_observer = lambda lg: seen.append(lg.detach().float().clone())
    try:
        for p in (0, 1, 130, 131, 298):
            rt.execute(_batch(seqs, [prompt[:p + 1]], [0], [seqs.new(p + 2)]))
            lp = torch.log_softmax(seen[-1][0], dim=-1)
            assert float(lp[prompt[p + 1]]) == pytest.approx(float(ref.chosen[p]), abs=2e-3), p
    finally:
        rt.logits_observer = None
