"""Bucket policies (pure CPU)."""
import pytest

from graphrunner.buckets import decode_buckets, prefill_token_buckets, round_up_decode, round_up_tokens
from graphrunner.errors import BatchTooLargeError, BucketError, GraphRunnerConfigError, TooManyTokensError


def test_default_decode_buckets_256():
    b = decode_buckets(256)
    assert b[:5] == (1, 2, 4, 8, 16)
    assert b[-1] == 256
    assert all(x % 16 == 0 for x in b[4:])
    assert len(b) == 4 + 16
    assert list(b) == sorted(set(b))


@pytest.mark.parametrize(
    "max_batch,expected",
    [(0, ()), (1, (1,)), (3, (1, 2, 3)), (5, (1, 2, 4, 5)), (8, (1, 2, 4, 8)), (20, (1, 2, 4, 8, 16, 20)),
     (48, (1, 2, 4, 8, 16, 32, 48))],
)
def test_default_decode_buckets_small(max_batch, expected):
    assert decode_buckets(max_batch) == expected


def test_decode_override_validated():
    assert decode_buckets(64, [1, 3, 64]) == (1, 3, 64)
    for bad in ([], [2, 1], [1, 1], [0, 4], [1, 65], [1.5], [True]):
        with pytest.raises(GraphRunnerConfigError):
            decode_buckets(64, bad)
    with pytest.raises(GraphRunnerConfigError):
        decode_buckets(-1)
    with pytest.raises(GraphRunnerConfigError):
        decode_buckets(0, [1])


def test_round_up_decode():
    b = decode_buckets(256)
    assert [round_up_decode(x, b) for x in (1, 3, 5, 8, 9, 16, 17, 255, 256)] == [1, 4, 8, 8, 16, 16, 32, 256, 256]
    with pytest.raises(BatchTooLargeError):
        round_up_decode(257, b)
    with pytest.raises(BatchTooLargeError):
        round_up_decode(1, ())
    with pytest.raises(BucketError):
        round_up_decode(0, b)


def test_prefill_token_buckets():
    assert prefill_token_buckets(4096, 512) == tuple(range(512, 4097, 512))
    assert prefill_token_buckets(1000, 512) == (512, 1000)
    assert prefill_token_buckets(300, 512) == (300,)
    assert prefill_token_buckets(None, 512) == ()
    assert prefill_token_buckets(0, 512) == ()
    assert prefill_token_buckets(2048, 512, min_tokens=64) == (64, 128, 256, 512, 1024, 1536, 2048)
    assert prefill_token_buckets(100, 512, min_tokens=64) == (64, 100)
    for kwargs in ({"stride": 0}, {"stride": -4}, {"min_tokens": 512}, {"min_tokens": 0}):
        with pytest.raises(GraphRunnerConfigError):
            prefill_token_buckets(1024, **{"stride": 512, **kwargs})
    with pytest.raises(GraphRunnerConfigError):
        prefill_token_buckets(-1, 512)


def test_round_up_tokens():
    b = prefill_token_buckets(4096, 512)
    assert round_up_tokens(1, b) == 512
    assert round_up_tokens(512, b) == 512
    assert round_up_tokens(513, b) == 1024
    assert round_up_tokens(4096, b) == 4096
    with pytest.raises(TooManyTokensError):
        round_up_tokens(4097, b)
    with pytest.raises(BucketError):
        round_up_tokens(0, b)
