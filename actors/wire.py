"""The packed step format of the pipe step path: one rank's share of a `StepPlan` as bytes, and the reply.

A request carries the plan's scalars and this rank's DP batch as raw little-endian arrays
(no pickle): encoding is a handful of `tobytes()` calls, decoding is `np.frombuffer` views
into the received buffer (zero-copy; the rank must not write to them). Frames are
length-prefixed so a reader knows how much to read from a stream.

request  = u32 body length | body
body     = u8 global_decode (0 False, 1 True, 2 None) | u8 flags (1 batch, 2 run, 4 arm next, 8 disarm,
           16 extras, 32 prompt logprobs) | i32 batch_bucket | i32 token_bucket | i32 static_tokens (-1 None)
           | i32 num_steps
           (global_decode, batch_bucket, token_bucket: the plan's `StepHints`)
           [| i32 B | i32 T | i32 W | token_ids i64[T] | q_seqlens i32[B] | num_history i32[B]
            | block_tables i32[B*W] | temperature f32[B] | top_k i32[B] | top_p f32[B] | seeds i64[B]
            [| the batch's `PromptLogprobsAsk` (flag 32): i32 M | i32 K | rows i64[M] | targets i64[M]]
            [| the batch's `SamplerExtras` (flag 16: only steps with penalties, bias, bans, min_p, logprobs or
               allow masks carry them): i32 K | i32 M | i32 P | i32 num_logprobs | i32 A | min_p f32[B]
               | penalties f32[B*3] | bias_ids i32[B*K] | bias_vals f32[B*K] | ban_ids i32[B*M] | pen_ids i32[B*P]
               | pen_counts i32[B*P] | allow_bits i32[B*A]; A = 0: no allow_bits (None), else its words per row;
               K = -1, M = P = A = 0 and no arrays: logprobs only, every array off (`SamplerExtras.off`)]]
           flag 4 (`StepPlan.arm_next`): the driver waits for this step's tokens before it sends anything else, so
           a tensor-parallel rank may arm the next decode step (`actors.armed`); flag 8 alone: a disarm frame (the
           driver went idle after such a step: cancel the arm), which gets no reply
reply    = u32 body length | u8 status | f64 in-rank seconds | payload
           status OK: next tokens i64[B] (i64[B, num_steps] row-major for multi-step decode); NONE: nothing (idle
           rank or TP rank > 0); ERROR: utf-8 text;
           LOGPROBS: i32 B | i32 N | i32 M | i32 K | tokens i64[B] | [chosen f32[B] | top_ids i32[B*N]
           | top_logprobs f32[B*N], when N >= 0] | [prompt: chosen f32[M] | ranks i32[M] | top_ids i32[M*K]
           | top_logprobs f32[M*K], when M >= 0]
"""
from __future__ import annotations

import operator
import struct
from typing import Optional

import numpy as np

from actors.batch import SampledTokens, SamplerExtras, StepBatch, StepLogprobs
from actors.prompt_logprobs import PromptLogprobs, PromptLogprobsAsk
from actors.protocol import RankArgs, StepHints, StepPlan, step_hints

LENGTH = struct.Struct("<I")
_HEAD = struct.Struct("<BBiiii")
_SHAPE = struct.Struct("<iii")
_REPLY = struct.Struct("<Bd")
_FRAME_HEAD = struct.Struct("<I" + _HEAD.format[1:])  # length prefix + head: one pack
_FRAME_BATCH = struct.Struct(_FRAME_HEAD.format + _SHAPE.format[1:])  # ... + shape
_FRAME_REPLY = struct.Struct("<I" + _REPLY.format[1:])
_DECODE_FLAG = {False: 0, True: 1, None: 2}
_FLAG_DECODE = {0: False, 1: True, 2: None}
# (global_decode flag, batch_bucket, token_bucket) -> the decoded `StepHints`, shared by every request with those
# three (few: the coordinator's buckets); forgotten all at once beyond _MAX_HINTS
_HINTS_OF: dict[tuple[int, int, int], StepHints] = {}
_MAX_HINTS = 4096
# (field, dtype, length key): "T" tokens, "B" sequences, "BW" block-table entries; StepBatch's field order
_FIELDS = (("token_ids", np.int64, "T"), ("q_seqlens", np.int32, "B"), ("num_history", np.int32, "B"),
           ("block_tables", np.int32, "BW"), ("temperature", np.float32, "B"), ("top_k", np.int32, "B"),
           ("top_p", np.float32, "B"), ("seeds", np.int64, "B"))

_DTYPES = tuple(np.dtype(dtype) for _, dtype, _ in _FIELDS)
_fields_of = operator.attrgetter(*(name for name, _, _ in _FIELDS))
_dtype_of = operator.attrgetter("dtype")
_NDARRAYS = (np.ndarray,) * len(_FIELDS)
_I64, _I32, _F32 = np.dtype(np.int64), np.dtype(np.int32), np.dtype(np.float32)

REPLY_OK, REPLY_NONE, REPLY_ERROR, REPLY_LOGPROBS = 0, 1, 2, 3
ARM_NEXT, DISARM, EXTRAS, PROMPT_LP = 4, 8, 16, 32  # request flags (see the module docstring)
_LP_HEAD = struct.Struct("<iiii")
_ASK_HEAD = struct.Struct("<ii")
_EXTRAS_HEAD = struct.Struct("<iiiii")  # K (bias columns), M (banned), P (penalised), num_logprobs, A (mask words)
# SamplerExtras' arrays in wire order: (field, dtype, columns: 1, 3 or the head's K / M / P)
_EXTRAS = (("min_p", _F32, 1), ("penalties", _F32, 3), ("bias_ids", _I32, "K"), ("bias_vals", _F32, "K"),
           ("ban_ids", _I32, "M"), ("pen_ids", _I32, "P"), ("pen_counts", _I32, "P"))
_EXTRAS_DTYPES = tuple(dtype for _, dtype, _ in _EXTRAS)
_EXTRAS_NDARRAYS = (np.ndarray,) * len(_EXTRAS)


class WireError(ValueError):
    """A frame is truncated or inconsistent."""


def encode_request(plan: StepPlan, dp_rank: int) -> bytes:
    """This DP rank's share of `plan` as one length-prefixed frame."""
    batch = plan.batches[dp_rank]
    flags = (3 if batch is not None else (2 if plan.run_idle else 0)) | (ARM_NEXT if plan.arm_next else 0)
    extras = b"" if batch is None or batch.extras is None else encode_extras(batch.extras)
    if extras:
        flags |= EXTRAS
    if batch is not None and batch.prompt_lp is not None:  # before the extras
        ask = batch.prompt_lp
        flags |= PROMPT_LP
        extras = b"".join([_ASK_HEAD.pack(int(ask.rows.shape[0]), ask.num_top),
                           np.ascontiguousarray(ask.rows, _I64).tobytes(),
                           np.ascontiguousarray(ask.targets, _I64).tobytes(), extras])
    static = -1 if plan.static_tokens is None else plan.static_tokens
    hints = plan.hints
    head = (_DECODE_FLAG[hints.global_decode], flags, hints.batch_bucket, hints.token_bucket, static, plan.num_steps)
    if batch is None:
        return _FRAME_HEAD.pack(_HEAD.size, *head)
    arrays = _fields_of(batch)
    if tuple(map(type, arrays)) == _NDARRAYS and tuple(map(_dtype_of, arrays)) == _DTYPES:
        body = b"".join([a.tobytes() for a in arrays])  # C order whatever the strides
    else:
        body = b"".join([np.ascontiguousarray(a, dtype=dtype).tobytes() for a, dtype in zip(arrays, _DTYPES)])
    shape = (arrays[1].shape[0], arrays[0].shape[0], arrays[3].shape[1])  # B, T, W
    return _FRAME_BATCH.pack(_HEAD.size + _SHAPE.size + len(body) + len(extras), *head, *shape) + body + extras


def encode_extras(ex: SamplerExtras) -> bytes:
    """A batch's `SamplerExtras` as raw arrays (its section of a request body; `validate`d on the driver); extras
    that only ask for logprobs (`SamplerExtras.logprobs_only`) as their head alone (K = -1)."""
    if ex.logprobs_only:
        return _EXTRAS_HEAD.pack(-1, 0, 0, ex.num_logprobs, 0)
    k, m, p = ex.bias_ids.shape[1], ex.ban_ids.shape[1], ex.pen_ids.shape[1]
    arrays = (ex.min_p, ex.penalties, ex.bias_ids, ex.bias_vals, ex.ban_ids, ex.pen_ids, ex.pen_counts)
    bits = ex.allow_bits
    head = _EXTRAS_HEAD.pack(k, m, p, ex.num_logprobs, 0 if bits is None else bits.shape[1])
    if tuple(map(type, arrays)) == _EXTRAS_NDARRAYS and tuple(map(_dtype_of, arrays)) == _EXTRAS_DTYPES:
        parts = [head, *[a.tobytes() for a in arrays]]  # C order whatever the strides
    else:
        parts = [head, *[np.ascontiguousarray(a, dtype).tobytes() for a, (_, dtype, _) in zip(arrays, _EXTRAS)]]
    if bits is not None:
        parts.append(np.ascontiguousarray(bits, _I32).tobytes())  # no copy for the usual int32 C-order mask
    return b"".join(parts)


def decode_ask(body: memoryview | bytes, off: int) -> tuple[PromptLogprobsAsk, int]:
    """The `PromptLogprobsAsk` at `off`: (it, the offset after it). Its arrays are views into `body`."""
    if len(body) < off + _ASK_HEAD.size:
        raise WireError(f"request body of {len(body)} bytes ends inside its prompt logprobs head")
    m, k = _ASK_HEAD.unpack_from(body, off)
    off += _ASK_HEAD.size
    end = off + 16 * m
    if m < 0 or end > len(body):
        raise WireError(f"request body of {len(body)} bytes ends inside its prompt logprobs (M={m})")
    return PromptLogprobsAsk(np.frombuffer(body, _I64, m, off), np.frombuffer(body, _I64, m, off + 8 * m), k), end


def decode_extras(body: memoryview | bytes, off: int, b: int) -> SamplerExtras:
    """The `SamplerExtras` of `b` rows at `off` (to the end of `body`): views into it, like the batch's arrays."""
    if len(body) < off + _EXTRAS_HEAD.size:
        raise WireError(f"request body of {len(body)} bytes ends inside its sampler extras")
    k, m, p, num_logprobs, a = _EXTRAS_HEAD.unpack_from(body, off)
    off += _EXTRAS_HEAD.size
    if k == -1 and m == p == a == 0 and len(body) == off:  # logprobs only: every array off (shared, read-only)
        return SamplerExtras.off(b, num_logprobs)
    n = b * (4 + 2 * k + m + 2 * p + a)  # 4-byte items: min_p, 3 penalties, 2K bias, M bans, 2P penalised, A mask
    if min(k, m, p, a) < 0 or len(body) != off + 4 * n:
        raise WireError(f"request body has {len(body)} bytes, its sampler extras say {off + 4 * n} (B={b}, K={k}, "
                        f"M={m}, P={p}, A={a})")
    # one int32 and one float32 view of the section, then slices in wire order (`_EXTRAS`, then the mask)
    i32, f32 = np.frombuffer(body, _I32, n, off), np.frombuffer(body, _F32, n, off)
    e1, e2, e3, e4 = 4 * b, 4 * b + b * k, 4 * b + 2 * b * k, 4 * b + b * (2 * k + m)
    e5 = e4 + b * p
    e6 = e5 + b * p
    return SamplerExtras(f32[:b], f32[b:e1].reshape(b, 3), i32[e1:e2].reshape(b, k), f32[e2:e3].reshape(b, k),
                         i32[e3:e4].reshape(b, m), i32[e4:e5].reshape(b, p), i32[e5:e6].reshape(b, p),
                         num_logprobs, i32[e6:n].reshape(b, a) if a else None)


def encode_disarm() -> bytes:
    """The disarm frame (no step, no reply)."""
    return _FRAME_HEAD.pack(_HEAD.size, _DECODE_FLAG[None], DISARM, 0, 0, -1, 1)


def request_control(body: memoryview | bytes) -> int:
    """The request's ARM_NEXT / DISARM flags (0 for a frame too short to have them: `decode_request` says why)."""
    return body[1] & (ARM_NEXT | DISARM) if len(body) >= _HEAD.size else 0


def decode_request(body: memoryview | bytes) -> Optional[tuple[RankArgs, Optional[int], int]]:
    """`(args, static_tokens, num_steps)` with args the `RankArgs` `(batch, hints)` of `StepPlan.rank_args`
    (batch None: an idle rank's dummy step), or None when this rank has nothing to run this step."""
    if len(body) < _HEAD.size:
        raise WireError(f"request of {len(body)} bytes is shorter than its header")
    flag, has, batch_bucket, token_bucket, static, num_steps = _HEAD.unpack_from(body, 0)
    if not has & 2:
        return None
    batch = None
    if has & 1:
        b, t, w = _SHAPE.unpack_from(body, _HEAD.size)
        off = _HEAD.size + _SHAPE.size
        n = 5 * b + b * w  # q_seqlens, num_history, block_tables, temperature, top_k, top_p: 4-byte items
        need = off + 8 * t + 4 * n + 8 * b
        if min(b, t, w) < 0 or need > len(body) or (need != len(body) and not has & (EXTRAS | PROMPT_LP)):
            raise WireError(f"request body has {len(body)} bytes, its header says {need} (B={b}, T={t}, W={w})")
        # four buffer views (positional arguments: keywords cost twice as much), then slices: the 4-byte fields
        # lie back to back, seen through one int32 and one float32 view
        ids = np.frombuffer(body, _I64, t, off)
        off += 8 * t
        i32, f32 = np.frombuffer(body, _I32, n, off), np.frombuffer(body, _F32, n, off)
        seeds = np.frombuffer(body, _I64, b, off + 4 * n)
        e = 2 * b + b * w  # end of block_tables
        batch = StepBatch(ids, i32[:b], i32[b:2 * b], i32[2 * b:e].reshape(b, w), f32[e:e + b], i32[e + b:e + 2 * b],
                          f32[e + 2 * b:e + 3 * b], seeds)
        if has & PROMPT_LP:
            batch.prompt_lp, need = decode_ask(body, need)
        if has & EXTRAS:
            batch.extras = decode_extras(body, need, b)
        elif need != len(body):
            raise WireError(f"request body has {len(body) - need} bytes after its batch and no sampler extras")
    key = (flag, batch_bucket, token_bucket)
    hints = _HINTS_OF.get(key)
    if hints is None:
        if len(_HINTS_OF) >= _MAX_HINTS:
            _HINTS_OF.clear()
        hints = _HINTS_OF[key] = step_hints(_FLAG_DECODE[flag], batch_bucket, token_bucket)
    return (batch, hints), (None if static < 0 else static), num_steps


def encode_reply(status: int, seconds: float, payload: bytes = b"") -> bytes:
    return _FRAME_REPLY.pack(_REPLY.size + len(payload), status, seconds) + payload


def encode_tokens(tokens: Optional[np.ndarray | SampledTokens], seconds: float) -> bytes:
    if tokens is None:
        return encode_reply(REPLY_NONE, seconds)
    if isinstance(tokens, SampledTokens):
        toks, lp, prompt = tokens
        b = int(toks.shape[0])
        n = -1 if lp is None else int(lp.top_ids.shape[1])
        m, k = (-1, 0) if prompt is None else (int(prompt.chosen.shape[0]), int(prompt.top_ids.shape[1]))
        parts = [_LP_HEAD.pack(b, n, m, k), np.ascontiguousarray(toks, dtype=_I64).tobytes()]
        if lp is not None:
            parts += [np.ascontiguousarray(lp.chosen, dtype=_F32).tobytes(),
                      np.ascontiguousarray(lp.top_ids, dtype=_I32).tobytes(),
                      np.ascontiguousarray(lp.top_logprobs, dtype=_F32).tobytes()]
        if prompt is not None:
            parts += [np.ascontiguousarray(a, dtype=d).tobytes() for a, d in zip(prompt, (_F32, _I32, _I32, _F32))]
        raw = b"".join(parts)
        return _FRAME_REPLY.pack(_REPLY.size + len(raw), REPLY_LOGPROBS, seconds) + raw
    raw = np.ascontiguousarray(tokens, dtype=_I64).tobytes()
    return _FRAME_REPLY.pack(_REPLY.size + len(raw), REPLY_OK, seconds) + raw


def decode_reply(body: bytes) -> tuple[int, float, object]:
    """(status, in-rank seconds, tokens int64 `[B]` | `SampledTokens` | None | error text); a logprobs reply
    decodes as status OK with `SampledTokens`."""
    if len(body) < _REPLY.size:
        raise WireError(f"reply of {len(body)} bytes is shorter than its header")
    status, seconds = _REPLY.unpack_from(body, 0)
    if status == REPLY_OK:
        return status, seconds, np.frombuffer(body, _I64, -1, _REPLY.size).copy()
    if status == REPLY_NONE:
        return status, seconds, None
    if status == REPLY_LOGPROBS:
        b, n, m, k = _LP_HEAD.unpack_from(body, _REPLY.size)
        off = _REPLY.size + _LP_HEAD.size
        toks = np.frombuffer(body, _I64, b, off).copy()
        off += 8 * b
        # the rest: 4-byte items back to back, one copy, seen through int32 / float32 views
        i32 = np.frombuffer(body, _I32, -1, off).copy()
        f32 = i32.view(_F32)
        lp = prompt = None
        e = 0
        if n >= 0:  # chosen, top ids, top logprobs
            e = b + b * n
            lp = StepLogprobs(f32[:b], i32[b:e].reshape(b, n), f32[e:e + b * n].reshape(b, n))
            e += b * n
        if m >= 0:  # the prompt's chosen, ranks, top ids, top logprobs
            prompt = PromptLogprobs(f32[e:e + m], i32[e + m:e + 2 * m], i32[e + 2 * m:e + 2 * m + m * k].reshape(m, k),
                                    f32[e + 2 * m + m * k:e + 2 * m + 2 * m * k].reshape(m, k))
        return REPLY_OK, seconds, SampledTokens(toks, lp, prompt)
    return status, seconds, bytes(body[_REPLY.size:]).decode("utf-8", "replace")
