"""The scheduler on the real model (qwen3-tiny, one rank, CPU): preemption under memory pressure and
arbitrary batch composition give the same tokens as a roomy run, greedy and seeded sampling."""
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
