"""Bad requests are refused with a clear `RequestError` before anything is scheduled."""
from __future__ import annotations

import numpy as np
import pytest

from engine import EngineConfig, LLMEngine, Request, RequestError, SamplingParams
from engine.testing import PagedToyExecutor


@pytest.fixture
def engine():
    return LLMEngine(PagedToyExecutor(num_kv_blocks=16, block_size=4, vocab_size=97, max_model_len=40),
                     EngineConfig(max_num_seqs=8))


@pytest.mark.parametrize("kwargs, match, param", [
    (dict(prompt_token_ids=[]), "empty", "prompt"),
    (dict(prompt_token_ids=[1, 97]), "outside the vocabulary", "prompt"),
    (dict(prompt_token_ids=[-1, 2]), "outside the vocabulary", "prompt"),
    (dict(prompt_token_ids=[1, 2.5]), "must be ints", "prompt"),
    (dict(prompt_token_ids=[1, True]), "must be ints", "prompt"),
    (dict(prompt_token_ids="hello"), "list of ints", "prompt"),
    (dict(prompt_token_ids=[1], max_tokens=-3), "max_tokens must be >= 1", "max_tokens"),
    (dict(prompt_token_ids=[1], max_tokens=0), "max_tokens must be >= 1", "max_tokens"),
    (dict(prompt_token_ids=[1], max_tokens="5"), "max_tokens must be an int", "max_tokens"),
    (dict(prompt_token_ids=list(range(40))), "maximum context length is 40", "prompt"),
    (dict(prompt_token_ids=list(range(30)), max_tokens=20), "you requested 50", "max_tokens"),
    (dict(prompt_token_ids=[1], stop_token_ids=[500]), "stop token id 500", "stop_token_ids"),
    (dict(prompt_token_ids=[1], stop_token_ids=["a"]), "stop_token_ids must be ints", "stop_token_ids"),
    (dict(prompt_token_ids=[1], sampling=SamplingParams(allowed_token_ids=[3, 97])), "allowed_token_ids token id 97",
     "allowed_token_ids"),
])
def test_bad_requests_raise_before_scheduling(engine, kwargs, match, param):
    with pytest.raises(RequestError, match=match) as err:
        engine.make_request(**kwargs)
    assert err.value.param == param
    assert not engine.has_unfinished() and engine.schedulers[0].allocator.num_free == 15


def test_a_request_larger_than_the_kv_cache_is_refused():
    eng = LLMEngine(PagedToyExecutor(num_kv_blocks=4, block_size=4, max_model_len=100), EngineConfig())
    with pytest.raises(RequestError, match="KV blocks") as err:
        eng.make_request([1, 2, 3], max_tokens=20)
    assert err.value.code == "kv_capacity_exceeded"


def test_generate_validates_every_prompt_before_any_is_scheduled(engine):
    with pytest.raises(RequestError):
        engine.generate([[1, 2], [3, 500]], max_tokens=4)
    assert not engine.has_unfinished() and engine.counters["requests_added"] == 0


def test_bad_sampling_parameters_are_refused():
    with pytest.raises(RequestError) as err:
        SamplingParams(temperature=-1)
    assert err.value.param == "temperature"
    with pytest.raises(RequestError) as err:
        SamplingParams(top_p=0)
    assert err.value.param == "top_p"


def test_duplicate_request_id_refused(engine):
    engine.add_request(engine.make_request([1, 2], request_id="x"))
    with pytest.raises(RequestError, match="already in flight"):
        engine.add_request(engine.make_request([3], request_id="x"))


def test_numpy_ints_are_accepted(engine):
    out = engine.generate([np.array([1, 2, 3])], max_tokens=3)
    assert len(out[0].token_ids) == 3


def test_request_output_timings(engine):
    out = engine.generate([[1, 2, 3]], max_tokens=4)[0]
    assert out.time_to_first_token is not None and out.time_to_first_token >= 0
    assert out.time_per_output_token is not None and out.time_per_output_token >= 0
    assert isinstance(Request.make([1]).request_id, str)
