"""A request's logprob entries on the driver: handed out per step as the outputs carry them, kept compact.

An entry is (chosen logprob, top ids, top logprobs) = (float, list[int], list[float]) (`RequestOutput.new_logprobs`,
`.logprobs`). A step's entries come from its `actors.batch.StepLogprobs` arrays (N top entries per row) once per
step, not per row (`step_entries`). What a sequence keeps for its final output is not those Python objects (lists
the garbage collector would walk at every full collection, a long request's by the thousand) but one `bytes` per
token (`step_rows`): int32 `[1 + 2n]`, the chosen logprob's fp32 bits, then n (top id, top logprob fp32 bits)
pairs, so that a request asking n <= N keeps the first 1 + 2n items of its row. `entries` turns a sequence's rows
back into entries in one pass, bit for bit the values `step_entries` gave.
"""
from __future__ import annotations

import numpy as np

from actors.batch import StepLogprobs

Entry = tuple[float, list[int], list[float]]
_I32, _F32 = np.dtype(np.int32), np.dtype(np.float32)


def step_entries(lp: StepLogprobs) -> list[Entry]:
    """One entry per row of the step (each row's N top entries; a row asking fewer keeps a prefix)."""
    return list(zip(lp.chosen.tolist(), lp.top_ids.tolist(), lp.top_logprobs.tolist()))


def step_rows(lp: StepLogprobs) -> tuple[bytes, int]:
    """(the step's rows, bytes per row): int32 `[B, 1 + 2N]` row-major as bytes; row i of a request asking n is
    `rows[i * size: i * size + 4 * (1 + 2 * n)]`. chosen float32 `[B]`, top_ids int32 and top_logprobs float32
    `[B, N]` (other dtypes are cast to these)."""
    b, n = lp.top_ids.shape
    out = np.empty((b, 1 + 2 * n), _I32)
    out[:, 0] = np.asarray(lp.chosen, _F32).view(_I32)
    out[:, 1::2] = lp.top_ids
    out[:, 2::2] = np.asarray(lp.top_logprobs, _F32).view(_I32)
    return out.tobytes(), 4 * (1 + 2 * n)


def entries(rows: list[bytes], n: int) -> list[Entry]:
    """The entries of a request's kept rows (`step_rows` prefixes of 1 + 2n int32 each), in order."""
    if not rows:
        return []
    a = np.frombuffer(b"".join(rows), _I32).reshape(len(rows), 1 + 2 * n)
    return list(zip(a[:, 0].view(_F32).tolist(), a[:, 1::2].tolist(), a[:, 2::2].view(_F32).tolist()))
