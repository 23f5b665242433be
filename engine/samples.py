"""`n > 1`: several samples of one prompt as separate engine requests that share the prompt's KV blocks.

`sample_requests(base, n)` returns n requests: sample 0 is the parent, samples 1..n-1 name it in
`Request.parent_id`. The engine places a sample on its parent's DP rank and holds it until the parent has
computed its prompt (`Scheduler.add(after=...)`); the sample then reuses the parent's cached full blocks
(referenced, not copied) and computes only the rest of the prompt itself: the tokens after the last full block
before the prompt's last token (1 to block_size tokens). That partial block is recomputed per sample rather than
copied: the executor has no block-copy operation, and recomputing at most one block per sample costs less than a
copy would save. With prefix caching off nothing is shared and each sample computes the whole prompt.

Seeds: sample i of a seeded request uses `derive_seed(seed, i)` (sample 0 the seed itself, so `n = 1` and sample
0 of `n > 1` agree), hence samples differ from each other and are reproducible. Unseeded sampled samples each get
their own random seed on the driver (`Sequence`); greedy samples are identical.
"""
from __future__ import annotations

import dataclasses
import hashlib
import math

from engine.errors import RequestError
from engine.request import ModelLimits, Request
from engine.sampling_params import SEED_MAX

MAX_N = 16  # samples per prompt


def derive_seed(seed: int, index: int) -> int:
    """The seed of sample `index` of a request seeded with `seed` (in [0, 2**63-1]): `seed` for sample 0, else the
    first 63 bits of BLAKE2b(seed, index)."""
    if index == 0:
        return seed
    h = hashlib.blake2b(seed.to_bytes(8, "little") + index.to_bytes(8, "little"), digest_size=8).digest()
    return int.from_bytes(h, "little") & SEED_MAX


def sample_requests(base: Request, n: int) -> list[Request]:
    """n requests for n samples of `base`'s prompt (ids `<id>-<i>` when n > 1; `[base]` when n == 1)."""
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_N:
        raise RequestError(f"'n' must be an integer in [1, {MAX_N}], got {n!r}", "n", "invalid_value")
    if n == 1:
        return [base]
    sp = base.sampling
    out = []
    parent_id = f"{base.request_id}-0"
    for i in range(n):
        sampling = sp if sp.seed is None else dataclasses.replace(sp, seed=derive_seed(sp.seed, i))
        out.append(dataclasses.replace(base, request_id=f"{base.request_id}-{i}", sampling=sampling,
                                       parent_id=None if i == 0 else parent_id))
    return out


def blocks_for_samples(prompt_len: int, max_tokens: int, n: int, block_size: int, shared: bool) -> int:
    """KV blocks n samples of a prompt need at once: the full blocks they share (when `shared`) once, and each
    sample's own blocks for the rest of the prompt and its max_tokens."""
    total = math.ceil((prompt_len + max_tokens) / block_size)
    common = (prompt_len - 1) // block_size if shared and n > 1 else 0
    return common + n * (total - common)


def max_sample_tokens(prompt_len: int, n: int, limits: ModelLimits, shared: bool) -> int:
    """The largest max_tokens with which n samples of a prompt of `prompt_len` tokens fit one DP rank's KV cache
    together (and max_model_len); 0 when none does."""
    bs, cap = limits.block_size, limits.max_blocks_per_request
    common = (prompt_len - 1) // bs if shared and n > 1 else 0
    if cap < common:
        return 0
    per_sample = common + (cap - common) // n  # blocks of each sample's table
    return max(0, min(bs * per_sample, limits.max_model_len) - prompt_len)


def check_samples_fit(base: Request, n: int, limits: ModelLimits, shared: bool) -> None:
    """Raise `RequestError` (param `n`) when n samples of `base` cannot all hold their blocks on one DP rank."""
    p = len(base.prompt_token_ids)
    mt = base.max_tokens if base.max_tokens is not None else limits.max_model_len - p
    need = blocks_for_samples(p, mt, n, limits.block_size, shared)
    if n > 1 and need > limits.max_blocks_per_request:
        raise RequestError(f"n={n} samples of this prompt with max_tokens={mt} need {need} KV blocks of "
                           f"{limits.block_size} tokens; one DP rank holds {limits.max_blocks_per_request}: lower "
                           "'n' or 'max_tokens'", "n", "kv_capacity_exceeded")
