"""GraphRunnerConfig validation (pure CPU)."""
import dataclasses

import pytest

from graphrunner.config import GraphRunnerConfig
from graphrunner.errors import GraphRunnerConfigError


def test_defaults():
    c = GraphRunnerConfig()
    assert not c.eager_mode and c.max_decode_batch == 256 and c.pcg_max_tokens == 4096 and c.pcg_token_stride == 512
    assert c.decode_buckets()[-1] == 256
    assert c.prefill_buckets() == tuple(range(512, 4097, 512))
    assert c.pcg_enabled


def test_frozen_and_capture_sizes_become_tuple():
    c = GraphRunnerConfig(max_decode_batch=32, decode_capture_sizes=[1, 8, 32])
    assert c.decode_capture_sizes == (1, 8, 32)
    assert c.decode_buckets() == (1, 8, 32)
    hash(c)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.eager_mode = True  # type: ignore[misc]


def test_disable_paths():
    assert GraphRunnerConfig(pcg_max_tokens=None).prefill_buckets() == ()
    assert not GraphRunnerConfig(pcg_max_tokens=0).pcg_enabled
    assert GraphRunnerConfig(max_decode_batch=0).decode_buckets() == ()
    # eager mode keeps the buckets: eager ranks warm them up in the same lock-step protocol
    e = GraphRunnerConfig(eager_mode=True)
    assert e.decode_buckets() and e.prefill_buckets() and not e.pcg_enabled


def test_finer_token_buckets():
    c = GraphRunnerConfig(pcg_max_tokens=1024, pcg_min_tokens=128)
    assert c.prefill_buckets() == (128, 256, 512, 1024)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"eager_mode": 1}, "eager_mode"),
        ({"max_decode_batch": -1}, "max_decode_batch"),
        ({"max_decode_batch": 2.0}, "max_decode_batch"),
        ({"max_decode_batch": True}, "max_decode_batch"),
        ({"decode_capture_sizes": [4, 2]}, "sorted"),
        ({"decode_capture_sizes": [2, 2]}, "duplicate"),
        ({"decode_capture_sizes": [1, 512]}, "above the maximum"),
        ({"decode_capture_sizes": [0, 1]}, ">= 1"),
        ({"decode_capture_sizes": []}, "empty"),
        ({"decode_capture_sizes": "1,2"}, "sequence"),
        ({"max_decode_batch": 0, "decode_capture_sizes": [1]}, "max_decode_batch is 0"),
        ({"pcg_max_tokens": -512}, "pcg_max_tokens"),
        ({"pcg_token_stride": 0}, "pcg_token_stride"),
        ({"pcg_token_stride": -1}, "pcg_token_stride"),
        ({"pcg_min_tokens": 0}, "pcg_min_tokens"),
        ({"pcg_min_tokens": 512}, "below pcg_token_stride"),
        ({"pcg_capture_guard": "yes"}, "pcg_capture_guard"),
    ],
)
def test_invalid(kwargs, match):
    with pytest.raises(GraphRunnerConfigError, match=match):
        GraphRunnerConfig(**kwargs)


def test_config_error_is_value_error():
    with pytest.raises(ValueError):
        GraphRunnerConfig(max_decode_batch=-3)
