"""The packed step frames of the pipe step path round-trip every field, and reject truncated frames."""
import numpy as np
import pytest

from actors.batch import StepBatch
from actors.protocol import StepHints, plan_step
from actors.wire import (ARM_NEXT, DISARM, LENGTH, REPLY_ERROR, REPLY_NONE, REPLY_OK, WireError, decode_reply,
                         decode_request, encode_disarm, encode_reply, encode_request, encode_tokens, request_control)


def _body(frame: bytes) -> bytes:
    (n,) = LENGTH.unpack_from(frame, 0)
    assert len(frame) == LENGTH.size + n
    return frame[LENGTH.size:]


def test_request_round_trips_every_field():
    b = StepBatch.from_sequences([[5, 6, 7], [9]], [0, 130], [[3], [4, 8, 11]], temperature=[0.0, 0.7],
                                 top_k=[0, 40], top_p=[1.0, 0.9], seeds=[-1, 1234567890123])
    plan = plan_step([b, None], cross_dp=True, decode_buckets=[1, 2, 4], token_buckets=[16, 32])
    (batch, hints), static, steps = decode_request(_body(encode_request(plan, 0)))
    assert (hints, static, steps) == (plan.hints, plan.static_tokens, 1) and type(hints) is StepHints
    assert plan.hints == StepHints(False, token_bucket=16)  # a global prefill: 4 tokens in the 16 bucket
    assert decode_request(_body(encode_request(plan, 0)))[0][1] is hints  # decoded once per distinct triple
    for name in ("token_ids", "q_seqlens", "num_history", "block_tables", "temperature", "top_k", "top_p", "seeds"):
        got, want = getattr(batch, name), getattr(b, name)
        assert got.dtype == want.dtype and got.shape == want.shape, name
        np.testing.assert_array_equal(got, want)
    # the idle DP rank of a cross-DP step runs a dummy step: no batch, same buckets
    (idle, hints1), _, _ = decode_request(_body(encode_request(plan, 1)))
    assert idle is None and hints1 == hints


def test_idle_rank_without_collectives_runs_nothing():
    b = StepBatch.from_sequences([[1]], [4], [[2]])
    plan = plan_step([b, None], cross_dp=False, decode_buckets=[1], token_buckets=[16])
    assert decode_request(_body(encode_request(plan, 1))) is None
    (batch, hints), static, _ = decode_request(_body(encode_request(plan, 0)))
    assert hints == StepHints() and static is None and batch.batch_size == 1
    multi = plan_step([b, None], cross_dp=False, decode_buckets=[1], token_buckets=[16], num_steps=4)
    assert decode_request(_body(encode_request(multi, 0)))[2] == 4


def test_arm_next_flag_and_disarm_frame():
    """`StepPlan.arm_next` reaches every rank's request (an idle one's too) without changing what it runs; the
    disarm frame carries no step and only the DISARM control flag."""
    import dataclasses

    b = StepBatch.from_sequences([[1], [2]], [4, 5], [[2], [3]])
    plan = plan_step([b, None], cross_dp=True, decode_buckets=[2], token_buckets=[16])
    armed = dataclasses.replace(plan, arm_next=True)
    for d in (0, 1):
        plain, flagged = _body(encode_request(plan, d)), _body(encode_request(armed, d))
        assert request_control(plain) == 0 and request_control(flagged) == ARM_NEXT
        (b0, *rest0), s0, n0 = decode_request(plain)
        (b1, *rest1), s1, n1 = decode_request(flagged)
        assert (rest0, s0, n0) == (rest1, s1, n1) and (b0 is None) == (b1 is None) == (d == 1)
    disarm = _body(encode_disarm())
    assert request_control(disarm) == DISARM
    assert request_control(b"\x00") == 0  # too short: decode_request reports it


def test_truncated_request_is_rejected():
    b = StepBatch.from_sequences([[1, 2]], [0], [[2]])
    body = _body(encode_request(plan_step([b], cross_dp=False, decode_buckets=[1], token_buckets=[16]), 0))
    with pytest.raises(WireError, match="bytes"):
        decode_request(body[:-4])
    with pytest.raises(WireError, match="shorter than its header"):
        decode_request(body[:3])


def test_replies():
    st, sec, toks = decode_reply(_body(encode_tokens(np.array([3, 1 << 40]), 0.25)))
    assert st == REPLY_OK and sec == 0.25 and toks.tolist() == [3, 1 << 40]
    assert decode_reply(_body(encode_tokens(None, 0.0)))[::2] == (REPLY_NONE, None)
    assert decode_reply(_body(encode_reply(REPLY_ERROR, 0.0, "rank 1: boom".encode())))[2] == "rank 1: boom"


def test_frames_larger_than_the_pipe_buffer_cross_a_real_pipe():
    """A 4k-token prefill of 32 sequences (~350 KB) exceeds a pipe's default 64 KiB: the writer blocks until the
    reader drains it, and the frame arrives whole; end-of-file after the writer closes reads as None."""
    import os
    import threading

    from actors.pipes import read_frame, write_all

    toks = [list(range(1, 129))] * 32
    b = StepBatch.from_sequences(toks, [0] * 32, [list(range(1 + 3 * i, 4 + 3 * i)) for i in range(32)])
    b = StepBatch(np.arange(4096 * 10, dtype=np.int64) % 1000, np.full(32, 1280, np.int32), b.num_history,
                  np.tile(np.arange(1, 21, dtype=np.int32), (32, 1)), b.temperature, b.top_k, b.top_p, b.seeds)
    frame = encode_request(plan_step([b], cross_dp=False, decode_buckets=[1], token_buckets=[16]), 0)
    assert len(frame) > 300_000
    r, w = os.pipe()
    writer = threading.Thread(target=lambda: (write_all(w, frame), write_all(w, frame), os.close(w)))
    writer.start()
    for _ in range(2):
        (got, *_), _, _ = decode_request(read_frame(r))
        np.testing.assert_array_equal(got.token_ids, b.token_ids)
        np.testing.assert_array_equal(got.block_tables, b.block_tables)
    assert read_frame(r) is None
    writer.join()
    os.close(r)
