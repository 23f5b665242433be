"""Bucket policies: pure functions, CPU-testable, shared by config validation and the runner.

Decode buckets (batch sizes of full decode graphs), default:
    1, 2, 4, 8, then every multiple of 16 up to `max_batch` (and `max_batch` itself).
Why: below 8 a power of two wastes at most 3 rows and tiny batches are common
(single-user latency); above 8 a stride of 16 bounds the padding waste to 15 rows
(< 6 % at 256) where pure powers of two waste up to ~2x (129 -> 256). All decode
graphs share one memory pool and are captured largest first, so the extra graphs
cost capture time (20 graphs for 256), not memory. The same shape is used by
other engines (vLLM: 1, 2, 4 then multiples of 8; the seed's Ascend policy:
powers of two to 16, then 16-aligned).

Prefill token buckets (piecewise plans), default (seed): every multiple of
`stride` (512) up to `max_tokens` (and `max_tokens` itself). Optional finer
buckets below the stride: powers of two from `min_tokens` (e.g. 64, 128, 256).
Why optional: a 40-token prompt padded to 512 runs ~12x the GEMM work; power-of-two
buckets below the stride bound that to < 2x for short prompts at the price of one
extra plan (capture time + a small private pool) per bucket. Off by default until
benchmarks on the target model justify it (the seed calls 512 provisional).
"""
from __future__ import annotations

import bisect
from typing import Iterable, Optional, Sequence

from .errors import BatchTooLargeError, BucketError, GraphRunnerConfigError, TooManyTokensError

SMALL_DECODE_BUCKETS: tuple[int, ...] = (1, 2, 4, 8)
DECODE_STRIDE = 16
DEFAULT_TOKEN_STRIDE = 512


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def validate_sizes(sizes: Iterable[int], name: str, max_value: Optional[int] = None) -> tuple[int, ...]:
    """Return `sizes` as a tuple after checking: non-empty, ints >= 1, strictly increasing, <= max_value."""
    out = tuple(sizes)
    if not out:
        raise GraphRunnerConfigError(f"{name} must not be empty")
    for s in out:
        if not _is_int(s):
            raise GraphRunnerConfigError(f"{name} must hold ints, got {s!r}")
        if s < 1:
            raise GraphRunnerConfigError(f"{name} must hold sizes >= 1, got {s}")
    for a, b in zip(out, out[1:]):
        if b == a:
            raise GraphRunnerConfigError(f"{name} has a duplicate size {a}: {list(out)}")
        if b < a:
            raise GraphRunnerConfigError(f"{name} must be sorted ascending: {list(out)}")
    if max_value is not None and out[-1] > max_value:
        raise GraphRunnerConfigError(f"{name} has size {out[-1]} above the maximum {max_value}")
    return out


def decode_buckets(max_batch: int, override: Optional[Sequence[int]] = None) -> tuple[int, ...]:
    """Ascending decode batch buckets for batches up to `max_batch` (0 = no decode graphs).

    `override` replaces the default policy; it is validated (sorted, unique, 1..max_batch).
    """
    if not _is_int(max_batch) or max_batch < 0:
        raise GraphRunnerConfigError(f"max_batch must be an int >= 0, got {max_batch!r}")
    if override is not None:
        if max_batch == 0:
            raise GraphRunnerConfigError("decode capture sizes were given but max_decode_batch is 0")
        return validate_sizes(override, "decode_capture_sizes", max_batch)
    if max_batch == 0:
        return ()
    out = [b for b in SMALL_DECODE_BUCKETS if b <= max_batch]
    out.extend(range(DECODE_STRIDE, max_batch + 1, DECODE_STRIDE))
    if out[-1] != max_batch:
        out.append(max_batch)
    return tuple(out)


def round_up_decode(batch: int, buckets: Sequence[int]) -> int:
    """Smallest bucket >= `batch`; BatchTooLargeError above the largest bucket."""
    if not _is_int(batch) or batch < 1:
        raise BucketError(f"decode batch must be an int >= 1, got {batch!r}")
    if not buckets or batch > buckets[-1]:
        top = buckets[-1] if buckets else 0
        raise BatchTooLargeError(f"decode batch {batch} is above the largest decode bucket {top}")
    return buckets[bisect.bisect_left(buckets, batch)]


def prefill_token_buckets(
    max_tokens: Optional[int], stride: int = DEFAULT_TOKEN_STRIDE, min_tokens: Optional[int] = None
) -> tuple[int, ...]:
    """Ascending piecewise token buckets up to `max_tokens` (None/0 = piecewise disabled -> ()).

    Multiples of `stride` up to `max_tokens`, plus `max_tokens` when it is not a
    multiple; with `min_tokens`, also min_tokens * 2**k below min(stride, max_tokens).
    """
    if max_tokens is None or max_tokens == 0:
        return ()
    if not _is_int(max_tokens) or max_tokens < 0:
        raise GraphRunnerConfigError(f"pcg_max_tokens must be None or an int >= 0, got {max_tokens!r}")
    if not _is_int(stride) or stride <= 0:
        raise GraphRunnerConfigError(f"pcg_token_stride must be an int > 0, got {stride!r}")
    out: list[int] = []
    if min_tokens is not None:
        if not _is_int(min_tokens) or min_tokens < 1:
            raise GraphRunnerConfigError(f"pcg_min_tokens must be None or an int >= 1, got {min_tokens!r}")
        if min_tokens >= stride:
            raise GraphRunnerConfigError(f"pcg_min_tokens ({min_tokens}) must be below pcg_token_stride ({stride})")
        t = min_tokens
        while t < stride and t < max_tokens:
            out.append(t)
            t *= 2
    out.extend(range(stride, max_tokens + 1, stride))
    if not out or out[-1] != max_tokens:
        out.append(max_tokens)
    return tuple(out)


def round_up_tokens(num_tokens: int, buckets: Sequence[int]) -> int:
    """Smallest token bucket >= `num_tokens`; TooManyTokensError above the largest bucket."""
    if not _is_int(num_tokens) or num_tokens < 1:
        raise BucketError(f"token count must be an int >= 1, got {num_tokens!r}")
    if not buckets or num_tokens > buckets[-1]:
        top = buckets[-1] if buckets else 0
        raise TooManyTokensError(f"{num_tokens} tokens is above the largest token bucket {top}")
    return buckets[bisect.bisect_left(buckets, num_tokens)]
