"""The driver's per-step fast paths agree with the general code they shortcut: the decode-batch checks
(`StepBatch._valid_decode`, `_decode_gap`, `is_decoding`), the plan constructor (`protocol._plan`) and the
request encoder (byte-identical frames for arrays of any dtype and layout)."""
from __future__ import annotations

import dataclasses
import pickle

import numpy as np
import pytest

from actors.batch import BatchError, StepBatch
from actors.protocol import NO_HINTS, StepHints, StepPlan, _plan, plan_step, step_hints, with_arm_next
from actors.wire import _FIELDS, LENGTH, decode_request, encode_request

VOCAB, BS, MAX_BLOCKS, KV = 1000, 4, 6, 50


def _outcome(fn, *args, **kw) -> str:
    try:
        fn(*args, **kw)
    except BatchError as e:
        return f"BatchError: {e}"
    except Exception as e:  # noqa: BLE001 - any other exception must match too
        return f"{type(e).__name__}: {e}"
    return "ok"


def _both(b: StepBatch, prev_rows: int, monkeypatch) -> tuple[tuple[str, str], tuple[str, str]]:
    """(check_runnable, validate) outcomes with the fast path, then with it off."""
    args = (VOCAB, BS, MAX_BLOCKS, KV)
    fast = (_outcome(b.check_runnable, *args, prev_rows=prev_rows), _outcome(b.validate, VOCAB, BS, prev_rows))
    with monkeypatch.context() as m:
        m.setattr(StepBatch, "_valid_decode", lambda self, *a, **k: False)
        full = (_outcome(b.check_runnable, *args, prev_rows=prev_rows), _outcome(b.validate, VOCAB, BS, prev_rows))
    return fast, full


def _decode(n: int, rng: np.random.Generator) -> StepBatch:
    """A valid decode batch of `n` sequences of varied lengths, tables padded with 0 to the widest."""
    hist = rng.integers(0, BS * MAX_BLOCKS - 1, n).astype(np.int32)
    need = (hist + BS) // BS
    width = int(need.max())
    tables = np.zeros((n, width), np.int32)
    for i, k in enumerate(need):
        tables[i, :k] = rng.integers(1, KV, k)
    return StepBatch(rng.integers(0, VOCAB, n), np.ones(n, np.int32), hist, tables, np.zeros(n, np.float32),
                     np.zeros(n, np.int32), np.ones(n, np.float32), np.full(n, -1, np.int64))


def _mutations(b: StepBatch, rng: np.random.Generator) -> list[StepBatch]:
    """Valid and malformed variants of decode batch `b` (edge values of every check)."""
    n, width = b.block_tables.shape
    r = dataclasses.replace
    i = int(rng.integers(0, n))
    out = [b, r(b, block_tables=np.ascontiguousarray(b.block_tables[:, ::-1])), r(b, block_tables=b.block_tables + 1)]
    for v in (VOCAB - 1, VOCAB, -1, -2, -3, 1 << 40):
        ids = b.token_ids.copy()
        ids[i] = v
        out.append(r(b, token_ids=ids))
    for v in (BS * width - 1, BS * width, BS * (width - 1) - 1, BS * (width - 1), 0, -1, -BS - 1, 2**31 - 1, -2**31):
        hist = b.num_history.copy()
        hist[i] = v
        out.append(r(b, num_history=hist))
    for col in range(width):
        for v in (0, -1, KV - 1, KV):
            tables = b.block_tables.copy()
            tables[i, col] = v
            out.append(r(b, block_tables=tables))
    out.append(r(b, num_history=np.full(n, BS * width - 1, np.int32), block_tables=np.full((n, width), 2, np.int32)))
    out.append(r(b, block_tables=np.zeros((n, 0), np.int32), num_history=np.full(n, -1, np.int32)))
    out.append(r(b, block_tables=np.pad(b.block_tables, ((0, 0), (0, MAX_BLOCKS + 1 - width)))))
    q = b.q_seqlens.copy()
    q[i] = 2
    out += [r(b, q_seqlens=q), r(b, q_seqlens=q, token_ids=np.append(b.token_ids, 7))]
    if n > 1:
        q = b.q_seqlens.copy()
        q[0], q[1] = 0, 2
        out.append(r(b, q_seqlens=q))
    out += [r(b, q_seqlens=b.q_seqlens.astype(np.int64)), r(b, num_history=b.num_history.astype(np.int64)),
            r(b, token_ids=b.token_ids.astype(np.float64)), r(b, block_tables=b.block_tables.astype(np.float32)),
            r(b, token_ids=b.token_ids[:, None]), r(b, temperature=np.zeros(n + 1, np.float32)),
            r(b, num_history=b.num_history[:-1]), r(b, block_tables=b.block_tables[:-1]),
            r(b, block_tables=np.asfortranarray(b.block_tables))]
    return out


@pytest.mark.parametrize("n", [1, 3, 40])  # 40: numpy bounds instead of Python lists
def test_fast_decode_checks_match_the_full_checks(n, monkeypatch):
    rng = np.random.default_rng(n)
    seen = set()
    for _ in range(4):
        for b in _mutations(_decode(n, rng), rng):
            for prev_rows in (0, 1, 2):
                fast, full = _both(b, prev_rows, monkeypatch)
                assert fast == full
                seen.update(fast)
    assert "ok" in seen and len(seen) > 5  # the cases reach both outcomes and several messages


def test_fast_decode_checks_accept_the_common_batches():
    rng = np.random.default_rng(0)
    for n in (1, 8, 64):
        b = _decode(n, rng)
        assert b._valid_decode(VOCAB, BS, 0, MAX_BLOCKS, KV)
        assert b._valid_decode(VOCAB, BS, n, MAX_BLOCKS, KV) and not b._valid_decode(VOCAB, BS, 0, MAX_BLOCKS, 1)


def test_decode_gap_matches_table_gap():
    rng = np.random.default_rng(1)
    for _ in range(3000):
        n, width = int(rng.integers(1, 6)), int(rng.integers(1, 5))
        hist = rng.integers(-2 * BS, BS * width + 2, n).astype(np.int32)
        tables = rng.choice(np.array([-1, 0, 1, 2, 3], np.int32), (n, width), p=[0.05, 0.15, 0.3, 0.3, 0.2])
        b = dataclasses.replace(_decode(n, rng), num_history=hist, block_tables=tables)
        for steps in (1, 2, 5):
            want = b._table_gap(hist.astype(np.int64) + steps, BS)
            got = b._decode_gap(steps, BS, int(hist.min()), int(hist.max()), int(tables.min()))
            assert got == want, (hist, tables, steps)


def test_multi_step_messages():
    b = StepBatch.from_sequences([[5], [6]], [3, 2], [[1, 2], [3, 0]])
    b.check_multi_step(2, BS)  # row 1 stores 4 tokens: its first block holds them
    with pytest.raises(BatchError, match="a block table lacks blocks for 3 decode steps"):
        b.check_multi_step(3, BS)
    with pytest.raises(BatchError, match="a block table is too short for 6 decode steps"):
        b.check_multi_step(6, BS)


def test_is_decoding_matches_the_reduction():
    for q in ([1, 1, 1], [1, 2], [0], [], [[1, 1], [1, 1]], [[1, 0]]):
        for dtype in (np.int32, np.int64, np.float32, np.dtype(">i4")):
            arr = np.array(q, dtype=dtype)
            b = dataclasses.replace(StepBatch.from_sequences([[1]], [0], [[1]]), q_seqlens=arr)
            assert b.is_decoding == bool((arr == 1).all()), (q, dtype)


def test_fast_plan_is_a_step_plan():
    b = StepBatch.from_sequences([[1]], [0], [[1]])
    for hints, kw in ((NO_HINTS, {}), (step_hints(True, 4, 0), {"run_idle": True, "static_tokens": 4,
                                                                "phase": "decode", "num_steps": 3}),
                      (step_hints(False, 0, 32), {"run_idle": True, "phase": "mixed"})):
        fast, slow = _plan((b, None), hints, **kw), StepPlan((b, None), hints, **kw)
        assert type(fast) is StepPlan and vars(fast) == vars(slow) and fast == slow
        idle = _plan((None, None), hints, **kw)  # hashable (StepBatch is not), and pickles
        assert hash(idle) == hash(StepPlan((None, None), hints, **kw)) and pickle.loads(pickle.dumps(idle)) == idle
        with pytest.raises(dataclasses.FrozenInstanceError):
            fast.phase = "x"
    assert _plan((b,)) == StepPlan((b,)) and StepPlan((b,)).hints == StepHints()
    armed = with_arm_next(_plan((b, None), StepHints(True, batch_bucket=4)))
    assert armed == StepPlan((b, None), StepHints(True, batch_bucket=4), arm_next=True) and armed.arm_next
    assert plan_step([None, None], cross_dp=False, decode_buckets=[1], token_buckets=[16]) is None
    assert plan_step(iter([b]), cross_dp=False, decode_buckets=[1], token_buckets=[16]).batches == (b,)


def test_fast_hints_are_step_hints():
    for args in ((None, 0, 0), (True, 4, 0), (False, 0, 32)):
        fast, slow = step_hints(*args), StepHints(*args)
        assert type(fast) is StepHints and vars(fast) == vars(slow) and fast == slow and hash(fast) == hash(slow)
        assert pickle.loads(pickle.dumps(fast)) == fast
        with pytest.raises(dataclasses.FrozenInstanceError):
            fast.batch_bucket = 8
    assert NO_HINTS == StepHints(None, 0, 0)


def _reference_frame(plan: StepPlan, dp_rank: int) -> bytes:
    """The request frame as the wire format's docstring lays it out, built the plain way."""
    import struct

    batch = plan.batches[dp_rank]
    run = batch is not None or plan.run_idle
    hints = plan.hints
    body = struct.pack("<BBiiii", {False: 0, True: 1, None: 2}[hints.global_decode],
                       (1 if batch is not None else 0) | (2 if run else 0), hints.batch_bucket, hints.token_bucket,
                       -1 if plan.static_tokens is None else plan.static_tokens, plan.num_steps)
    if batch is not None:
        body += struct.pack("<iii", batch.batch_size, batch.num_tokens, batch.block_tables.shape[1])
        for name, dtype, _ in _FIELDS:
            body += np.ascontiguousarray(getattr(batch, name), dtype=dtype).tobytes()
    return LENGTH.pack(len(body)) + body


def test_request_frames_are_byte_identical_for_any_dtype_and_layout():
    b = StepBatch.from_sequences([[5, 6, 7], [9]], [0, 130], [[3, 0, 0], [4, 8, 11]], temperature=[0.0, 0.7],
                                 top_k=[0, 40], top_p=[1.0, 0.9], seeds=[-1, 1234567890123])
    r = dataclasses.replace
    odd = r(b, q_seqlens=b.q_seqlens.astype(np.int64), num_history=list(b.num_history),
            block_tables=np.asfortranarray(b.block_tables.astype(np.int64)), temperature=b.temperature.astype(">f4"),
            top_k=np.arange(4, dtype=np.int32)[::2] * 20, seeds=b.seeds.astype(np.float64).astype(np.int64))
    for batch in (b, odd):
        for cross_dp in (False, True):
            plan = plan_step([batch, None], cross_dp=cross_dp, decode_buckets=[1, 2], token_buckets=[16])
            for d in (0, 1):
                assert encode_request(plan, d) == _reference_frame(plan, d)
    (got, *_), _, _ = decode_request(encode_request(plan, 0)[LENGTH.size:])
    np.testing.assert_array_equal(got.top_k, [0, 40])
    np.testing.assert_array_equal(got.block_tables, b.block_tables)


@pytest.mark.parametrize("n", [1, 3])
def test_negative_history_and_2d_token_ids_are_rejected_on_both_paths(n, monkeypatch):
    """A negative history would put the new token's K/V at a wrapped-around block-table column: rejected with a
    BatchError (before any rank runs), by the fast decode checks and the full checks alike."""
    b = _decode(n, np.random.default_rng(n))
    hist = b.num_history.copy()
    hist[-1] = -1
    for bad, message in ((dataclasses.replace(b, num_history=hist), "num_history must be >= 0"),
                         (dataclasses.replace(b, token_ids=b.token_ids.reshape(n, 1)), "token_ids has shape")):
        fast, full = _both(bad, 0, monkeypatch)
        assert fast == full
        assert all(o.startswith("BatchError: " + message) for o in fast), fast


def test_history_near_the_int32_limit_does_not_wrap_into_a_valid_batch(monkeypatch):
    """num_history + q_seqlens past 2^31 - 1 must not wrap around to a small length that the tables cover."""
    b = _decode(1, np.random.default_rng(9))
    bad = dataclasses.replace(b, num_history=np.array([np.iinfo(np.int32).max], np.int32))
    fast, full = _both(bad, 0, monkeypatch)
    assert fast == full and all(o == "BatchError: a block table is too short for its sequence" for o in fast), fast
