"""The packed step format of the pipe step path: one rank's share of a `StepPlan` as bytes, and the reply.

A request carries the plan's scalars and this rank's DP batch as raw little-endian arrays
(no pickle): encoding is a handful of `tobytes()` calls, decoding is `np.frombuffer` views
into the received buffer (zero-copy; the rank must not write to them). Frames are
length-prefixed so a reader knows how much to read from a stream.

request  = u32 body length | body
body     = u8 global_decode (0 False, 1 True, 2 None) | u8 flags (1 batch, 2 run) | i32 batch_bucket
           | i32 token_bucket | i32 static_tokens (-1 None) | i32 num_steps
           [| i32 B | i32 T | i32 W | token_ids i64[T] | q_seqlens i32[B] | num_history i32[B]
            | block_tables i32[B*W] | temperature f32[B] | top_k i32[B] | top_p f32[B] | seeds i64[B]]
reply    = u32 body length | u8 status | f64 in-rank seconds | payload
           status OK: next tokens i64[B] (i64[B, num_steps] row-major for multi-step decode); NONE: nothing (idle rank or TP rank > 0); ERROR: utf-8 text
"""
from __future__ import annotations

import struct
from typing import Optional

import numpy as np

from actors.batch import StepBatch
from actors.protocol import StepPlan

LENGTH = struct.Struct("<I")
_HEAD = struct.Struct("<BBiiii")
_SHAPE = struct.Struct("<iii")
_REPLY = struct.Struct("<Bd")
_DECODE_FLAG = {False: 0, True: 1, None: 2}
_FLAG_DECODE = {0: False, 1: True, 2: None}
# (field, dtype, length key): "T" tokens, "B" sequences, "BW" block-table entries
_FIELDS = (("token_ids", np.int64, "T"), ("q_seqlens", np.int32, "B"), ("num_history", np.int32, "B"),
           ("block_tables", np.int32, "BW"), ("temperature", np.float32, "B"), ("top_k", np.int32, "B"),
           ("top_p", np.float32, "B"), ("seeds", np.int64, "B"))

_SIZES = tuple(np.dtype(dtype).itemsize for _, dtype, _ in _FIELDS)

REPLY_OK, REPLY_NONE, REPLY_ERROR = 0, 1, 2


class WireError(ValueError):
    """A frame is truncated or inconsistent."""


def encode_request(plan: StepPlan, dp_rank: int) -> bytes:
    """This DP rank's share of `plan` as one length-prefixed frame."""
    batch = plan.batches[dp_rank]
    run = batch is not None or plan.run_idle
    static = -1 if plan.static_tokens is None else int(plan.static_tokens)
    head = _HEAD.pack(_DECODE_FLAG[plan.global_decode], (1 if batch is not None else 0) | (2 if run else 0),
                      int(plan.batch_bucket), int(plan.token_bucket), static, int(plan.num_steps))
    parts = [head]
    if batch is not None:
        b, t = batch.batch_size, batch.num_tokens
        w = int(batch.block_tables.shape[1])
        parts.append(_SHAPE.pack(b, t, w))
        for name, dtype, _ in _FIELDS:
            parts.append(np.ascontiguousarray(getattr(batch, name), dtype=dtype).tobytes())
    body = b"".join(parts)
    return LENGTH.pack(len(body)) + body


def decode_request(body: memoryview | bytes) -> Optional[tuple]:
    """`(args, static_tokens, num_steps)` with args the `execute` arguments `(batch, global_decode,
    batch_bucket, token_bucket)`, or None when this rank has nothing to run this step."""
    if len(body) < _HEAD.size:
        raise WireError(f"request of {len(body)} bytes is shorter than its header")
    flag, has, batch_bucket, token_bucket, static, num_steps = _HEAD.unpack_from(body, 0)
    if not has & 2:
        return None
    batch = None
    if has & 1:
        off = _HEAD.size
        b, t, w = _SHAPE.unpack_from(body, off)
        off += _SHAPE.size
        counts = (t, b, b, b * w, b, b, b, b)
        need = off + sum(c * size for c, size in zip(counts, _SIZES))
        if min(b, t, w) < 0 or need != len(body):
            raise WireError(f"request body has {len(body)} bytes, its header says {need} (B={b}, T={t}, W={w})")
        arrays = {}
        for (name, dtype, _), size, n in zip(_FIELDS, _SIZES, counts):
            arrays[name] = np.frombuffer(body, dtype=dtype, count=n, offset=off)
            off += n * size
        arrays["block_tables"] = arrays["block_tables"].reshape(b, w)
        batch = StepBatch(**arrays)
    return (batch, _FLAG_DECODE[flag], batch_bucket, token_bucket), (None if static < 0 else static), num_steps


def encode_reply(status: int, seconds: float, payload: bytes = b"") -> bytes:
    body = _REPLY.pack(status, seconds) + payload
    return LENGTH.pack(len(body)) + body


def encode_tokens(tokens: Optional[np.ndarray], seconds: float) -> bytes:
    if tokens is None:
        return encode_reply(REPLY_NONE, seconds)
    return encode_reply(REPLY_OK, seconds, np.ascontiguousarray(tokens, dtype=np.int64).tobytes())


def decode_reply(body: bytes) -> tuple[int, float, object]:
    """(status, in-rank seconds, tokens int64 `[B]` | None | error text)."""
    if len(body) < _REPLY.size:
        raise WireError(f"reply of {len(body)} bytes is shorter than its header")
    status, seconds = _REPLY.unpack_from(body, 0)
    rest = body[_REPLY.size:]
    if status == REPLY_OK:
        return status, seconds, np.frombuffer(rest, dtype=np.int64).copy()
    if status == REPLY_NONE:
        return status, seconds, None
    return status, seconds, bytes(rest).decode("utf-8", "replace")
