"""Sampled requests through the engine on the real model (qwen3-tiny, one CPU rank, the sampler's torch path):

- a seeded request samples the same tokens alone, in a batch of 8 and of 64 at any row, after a preemption,
  with overlapped rounds (`EngineConfig.overlap`) and through multi-step decode (`decode_steps`);
- an unseeded request gets one seed on the driver (two requests differ, a requeued one repeats itself);
- logprobs equal log_softmax of the model's own logits (chosen token and top-N);
- penalties, logit bias and min_tokens change the tokens exactly as a float64 reference of their definitions
  (applied to the model's logits) says, for greedy rows.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from actors.rank import RuntimeConfig
from engine import EngineConfig, LLMEngine, LocalEngineExecutor, SamplingParams
from graphrunner.config import GraphRunnerConfig

SEEDED = SamplingParams(temperature=1.0, top_p=0.9, seed=1234)


def _engine(num_kv_blocks: int = 512, max_num_seqs: int = 64, **cfg) -> LLMEngine:
    rt = RuntimeConfig(model="qwen3-tiny", device="cpu", block_size=4, num_kv_blocks=num_kv_blocks, max_model_len=128,
                       graph=GraphRunnerConfig(max_decode_batch=4, pcg_max_tokens=32, pcg_token_stride=32))
    ex = LocalEngineExecutor(rt)
    ex.start(progress=False)
    return LLMEngine(ex, EngineConfig(max_num_seqs=max_num_seqs, **cfg))


@pytest.fixture(scope="module")
def roomy():
    return _engine()


def _prompts(n: int, seed: int = 3) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 512, int(rng.integers(3, 12))).tolist() for _ in range(n)]


def test_a_seeded_request_samples_the_same_tokens_in_any_batch_and_after_preemption(roomy):
    target = [7, 8, 9, 10]
    alone = roomy.generate([target], SEEDED, max_tokens=16)[0].token_ids
    for n, row in ((8, 5), (64, 41)):
        others = _prompts(n - 1)
        batch = others[:row] + [target] + others[row:]
        assert roomy.generate(batch, SEEDED, max_tokens=16)[row].token_ids == alone
    tight = _engine(num_kv_blocks=14)
    outs = tight.generate(_prompts(5) + [target], SEEDED, max_tokens=16)
    assert tight.stats()["preemptions"] > 0 and outs[-1].token_ids == alone
    overlapped = _engine(overlap=True)
    assert overlapped.generate(_prompts(3) + [target], SEEDED, max_tokens=16)[-1].token_ids == alone
    assert overlapped.counters["rounds_ahead"] > 0
    multi = _engine(decode_steps=4)
    steps = []
    multi.on_step = lambda info: steps.append(info.num_steps)
    assert multi.generate(_prompts(3) + [target], SEEDED, max_tokens=16)[-1].token_ids == alone
    assert max(steps) == 4  # sampled rows took multi-step rounds


def test_unseeded_requests_get_a_driver_seed_each(roomy):
    sp = SamplingParams(temperature=1.0)
    a, b = roomy.generate([[5, 6, 7], [5, 6, 7]], sp, max_tokens=12)
    assert a.token_ids != b.token_ids  # two draws of 63-bit seeds: equal only with negligible probability


def _model_logits(engine: LLMEngine, tokens: list[int]) -> torch.Tensor:
    """fp32 logits `[len(tokens), V]` of the rank's own model over `tokens` (positions 0..), full recompute."""
    from modeling.attn_metadata import SequenceSlice, build_step
    from modeling.kv_cache import KVCacheSpec, PagedKVCache

    rt = engine.executor.runtime
    model = rt.model
    spec = KVCacheSpec.for_model(model.config, 64, 4, 1)
    cache = PagedKVCache(spec, model.device)
    nblocks = -(-len(tokens) // 4)
    ids, pos, meta = build_step([SequenceSlice(list(tokens), 0, list(range(1, nblocks + 1)))], 4, model.device,
                                nblocks)
    with torch.inference_mode():
        hidden = model(ids, pos, cache.layers, meta)
        return model.compute_logits(hidden, torch.arange(len(tokens)))


def test_logprobs_equal_log_softmax_of_the_models_logits(roomy):
    prompt = [11, 12, 13, 14, 15]
    out = roomy.generate([prompt], SamplingParams(temperature=1.0, seed=9, logprobs=5), max_tokens=6)[0]
    lps = out.logprobs
    assert lps is not None and len(lps) == 6, out
    logits = _model_logits(roomy, prompt + out.token_ids[:-1])
    ref = torch.log_softmax(logits.double(), dim=-1)[len(prompt) - 1:]
    for k, (tok, (chosen, top_ids, top_lps)) in enumerate(zip(out.token_ids, lps)):
        assert chosen == pytest.approx(float(ref[k, tok]), abs=1e-4)
        want = torch.topk(ref[k], 5)
        assert top_ids == want.indices.tolist()
        assert np.allclose(top_lps, want.values.numpy(), atol=1e-4)


def test_rows_asking_for_different_logprob_counts_share_a_step(roomy):
    """One step's rows asking for 0, 2 and 5 logprobs (and one asking for none) each get their own count, as
    Python values, the first entries of what the widest row gets for the same prompt."""
    from engine import Request
    prompt = [21, 22, 23, 24]
    reqs = [Request.make(prompt, SamplingParams(logprobs=n), max_tokens=4) for n in (5, 0, 2, None)]
    for r in reqs:
        roomy.add_request(r)
    done = {}
    while len(done) < len(reqs):
        for o in roomy.step():
            if o.finished:
                done[o.request_id] = o
    outs = [done[r.request_id] for r in reqs]
    assert outs[3].logprobs is None and len({tuple(o.token_ids) for o in outs}) == 1  # greedy: the same tokens
    wide = outs[0].logprobs
    for o, n in zip(outs[:3], (5, 0, 2)):
        assert len(o.logprobs) == 4
        for (chosen, ids, lps), (w_chosen, w_ids, w_lps) in zip(o.logprobs, wide):
            assert type(chosen) is float and chosen == w_chosen
            assert ids == w_ids[:n] and lps == w_lps[:n] and all(type(x) is float for x in lps)
            assert all(type(x) is int for x in ids)


def _penalised_greedy(engine: LLMEngine, prompt: list[int], n: int, presence=0.0, frequency=0.0, repetition=1.0,
                      bias=None, banned_until=None) -> list[int]:
    """Greedy tokens with vLLM's penalty definitions applied in float64 to the model's logits, step by step."""
    out: list[int] = []
    for _ in range(n):
        logits = _model_logits(engine, prompt + out)[-1].double().numpy().copy()
        if bias:
            for t, b in bias.items():
                logits[t] += b
        if banned_until is not None and len(out) < banned_until[0]:
            logits[list(banned_until[1])] = -np.inf
        seen_prompt = set(prompt)
        counts: dict[int, int] = {}
        for t in out:
            counts[t] = counts.get(t, 0) + 1
        for t in seen_prompt | set(counts):
            if repetition != 1:
                logits[t] = logits[t] / repetition if logits[t] > 0 else logits[t] * repetition
        for t, c in counts.items():
            logits[t] -= frequency * c + presence
        out.append(int(np.argmax(logits)))
    return out


@pytest.mark.parametrize("kw", [dict(repetition_penalty=1.8), dict(presence_penalty=1.5),
                                dict(frequency_penalty=1.2), dict(logit_bias={17: 30.0})],
                         ids=["repetition", "presence", "frequency", "logit_bias"])
def test_penalties_and_bias_match_their_definitions(roomy, kw):
    prompt = [1, 2, 3]  # greedy repeats 231, 226, ... on this prompt: every parameter changes the tokens
    got = roomy.generate([prompt], SamplingParams(**kw), max_tokens=8)[0].token_ids
    ref = _penalised_greedy(roomy, prompt, 8, presence=kw.get("presence_penalty", 0.0),
                            frequency=kw.get("frequency_penalty", 0.0), repetition=kw.get("repetition_penalty", 1.0),
                            bias=kw.get("logit_bias"))
    assert got == ref
    plain = roomy.generate([prompt], SamplingParams(), max_tokens=8)[0].token_ids
    assert got != plain  # the parameter mattered on this prompt


def test_min_tokens_bans_the_stop_ids_until_reached():
    prompt = [31, 32, 33]
    free = _engine().generate([prompt], SamplingParams(ignore_eos=True), max_tokens=10)[0].token_ids
    eos = free[1]
    eng = _engine(eos_token_ids=(eos,))
    stopped = eng.generate([prompt], SamplingParams(), max_tokens=10)[0]
    assert stopped.token_ids == free[:2]
    held = eng.generate([prompt], SamplingParams(min_tokens=4), max_tokens=10)[0]
    ref = _penalised_greedy(eng, prompt, 4, banned_until=(4, [eos]))
    assert held.token_ids[:4] == ref and eos not in held.token_ids[:4]
