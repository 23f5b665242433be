"""Allow masks of structured outputs (numpy, no torch): which token ids a row may draw this step.

Layout (llguidance's / xgrammar's token bitmask): int32 `[n, W]`, W = ceil(V / 32) for the full (unsharded)
vocabulary V; token id j may be drawn when bit (j & 31) of word j >> 5 is set, `(word >> (j & 31)) & 1`
(little-endian bit order inside the int32). An unconstrained row of a masked batch is all -1 words. Bits at ids
>= V are never read. A row that allows nothing draws token 0 (as a row whose every id is banned).
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np


def mask_words(vocab_size: int) -> int:
    """W: int32 words per row of a vocabulary of `vocab_size` ids."""
    return -(-vocab_size // 32)


def allow_bits_error(bits: Optional[np.ndarray], n: int, vocab_size: int) -> Optional[str]:
    """None when `bits` is None or int32 `[n, mask_words(vocab_size)]` (any width >= 1 when `vocab_size` is 0:
    unknown), else what is wrong."""
    if bits is None:
        return None
    ok = isinstance(bits, np.ndarray) and bits.dtype == np.int32 and bits.ndim == 2 and bits.shape[0] == n
    if ok and (bits.shape[1] == mask_words(vocab_size) if vocab_size else bits.shape[1] >= 1):
        return None
    return (f"allow_bits: expected int32 [n, ceil(vocab_size / 32)] with n = {n}, vocab_size = {vocab_size}, got "
            f"{getattr(bits, 'dtype', type(bits).__name__)} {getattr(bits, 'shape', '')}")


def pack_allowed(rows: Sequence[Optional[Sequence[int]]], vocab_size: int) -> np.ndarray:
    """int32 `[len(rows), W]`: row i allows the ids `rows[i]` (ids in [0, vocab_size)), or everything when None."""
    bits = np.full((len(rows), mask_words(vocab_size)), -1, np.int32)
    u = bits.view(np.uint32)
    for i, ids in enumerate(rows):
        if ids is None:
            continue
        ids = np.asarray(list(ids), np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
            raise ValueError(f"row {i}: allowed ids must be in [0, {vocab_size})")
        u[i] = 0
        np.bitwise_or.at(u[i], ids >> 5, (np.uint32(1) << (ids & 31).astype(np.uint32)))
    return bits
