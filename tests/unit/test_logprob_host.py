"""The host fast paths of logprob steps equal the plain code they replace (kept here as the references):
the engine's per-sequence extras flags and step rows, its logprob entries (kept as tuples, handed out as lists),
the sampler extras' byte-level checks, the wire's logprob reply, the captured heads' cached rows and position-only
staging, and the server's per-tokenizer token strings."""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from actors.batch import (
    BatchError,
    SampledTokens,
    SamplerExtras,
    StepBatch,
    StepLogprobs,
)
from actors.decode_state import unpack_logprobs
from actors.step_sampler import StepSampler
from actors.wire import LENGTH, decode_reply, encode_tokens
from engine import LLMEngine, Request, SamplingParams
from engine.llm_engine import EngineConfig
from engine.sampling_rows import _banned, build_extras, needs_extras
from engine.sequence import Sequence
from engine.step_batch import build_batch
from launch import logprobs as lpmod
from launch.outputs import ChoiceState

V = 500
_GREEDY_ROW = (0.0, 0, 1.0, -1)


# ---- references: the code before the fast paths
def _needs_extras_ref(seq) -> bool:
    sp = seq.request.sampling
    return (sp.min_p > 0 or sp.presence_penalty != 0 or sp.frequency_penalty != 0 or sp.repetition_penalty != 1
            or bool(sp.logit_bias) or sp.logprobs is not None or _banned(seq) is not None)


def _build_batch_ref(seqs, hist, q) -> StepBatch:
    n = len(seqs)
    width = max(len(s.block_table) for s in seqs)
    tables = np.zeros((n, width), dtype=np.int32)
    for i, s in enumerate(seqs):
        tables[i, :len(s.block_table)] = s.block_table
    tokens = [t for s, h, k in zip(seqs, hist, q) for t in s.token_ids[h:h + k]]
    rows = [s.sampling_row for s in seqs]
    greedy = all(r == _GREEDY_ROW for r in rows) and not any(_needs_extras_ref(s) for s in seqs)
    return StepBatch(
        token_ids=np.array(tokens, dtype=np.int64), q_seqlens=np.array(q, dtype=np.int32),
        num_history=np.array(hist, dtype=np.int32), block_tables=tables,
        temperature=np.zeros(n, np.float32) if greedy else np.array([r[0] for r in rows], dtype=np.float32),
        top_k=np.zeros(n, np.int32) if greedy else np.array([r[1] for r in rows], dtype=np.int32),
        top_p=np.ones(n, np.float32) if greedy else np.array([r[2] for r in rows], dtype=np.float32),
        seeds=np.full(n, -1, np.int64) if greedy else np.array([r[3] for r in rows], dtype=np.int64),
        extras=None if greedy else build_extras(seqs))


def _token_text_ref(tokenizer, token_id: int) -> str:
    return f"token_id:{token_id}" if tokenizer is None else tokenizer.decode([token_id], skip_special_tokens=False)


def _completion_ref(tokenizer, token_ids, entries, text_start: int) -> dict:
    toks, offsets, offset = [], [], text_start
    for t in token_ids:
        s = _token_text_ref(tokenizer, t)
        toks.append(s)
        offsets.append(offset)
        offset += len(s)
    tops = []
    for e in entries:
        out: dict = {}
        for i, lp in zip(e[1], e[2]):
            out.setdefault(_token_text_ref(tokenizer, i), lp)
        tops.append(out)
    return {"tokens": toks, "token_logprobs": [e[0] for e in entries], "top_logprobs": tops, "text_offset": offsets}


def _chat_ref(tokenizer, token_ids, entries) -> dict:
    def item(t, lp):
        s = _token_text_ref(tokenizer, t)
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

    return {"content": [{**item(t, e[0]), "top_logprobs": [item(i, lp) for i, lp in zip(e[1], e[2])]}
                        for t, e in zip(token_ids, entries)]}


def _same_arrays(a: np.ndarray, w: np.ndarray) -> bool:
    return a.dtype == w.dtype and a.shape == w.shape and a.tobytes() == w.tobytes()


def _random_sampling(rng) -> SamplingParams:
    kind = int(rng.integers(0, 8))
    kw: dict = {}
    if kind in (1, 7):
        kw["logprobs"] = int(rng.integers(0, 21)) if kind == 1 else 5
    elif kind == 2:
        kw.update(min_p=0.05, logprobs=5)
    elif kind == 3:
        kw.update(presence_penalty=0.7, logprobs=2)
    elif kind == 4:
        kw["logit_bias"] = {3: 1.5, 40: -2.0}
    elif kind == 5:
        kw["min_tokens"] = int(rng.integers(1, 6))
    return SamplingParams(temperature=float(rng.choice([0.0, 0.0, 0.8])), top_k=int(rng.choice([0, 20])), **kw)


def _seqs(rng, b: int, sampling=None) -> list[Sequence]:
    out = []
    for _ in range(b):
        stop = tuple(int(x) for x in rng.choice(V, int(rng.integers(0, 3)), replace=False))
        req = Request.make(rng.integers(1, V, 6).tolist(), sampling or _random_sampling(rng), max_tokens=50,
                           stop_token_ids=stop)
        seq = Sequence(req)
        seq.stop_ids = req.stop_token_ids
        seq.token_ids += rng.integers(1, V, int(rng.integers(0, 8))).tolist()
        seq.block_table = rng.integers(1, 99, 1 + len(seq.token_ids) // 4).tolist()
        out.append(seq)
    return out


# ---- engine: extras flags and step rows
@pytest.mark.parametrize("seed", range(6))
def test_needs_extras_and_build_batch_equal_the_plain_construction(seed):
    rng = np.random.default_rng(seed)
    for b in (1, 3, 64):
        for sampling in (None, SamplingParams(logprobs=5), SamplingParams(), SamplingParams(min_tokens=3)):
            seqs = _seqs(rng, b, sampling)
            assert [needs_extras(s) for s in seqs] == [_needs_extras_ref(s) for s in seqs]
            hist, q = [s.num_tokens - 1 for s in seqs], [1] * b
            got, want = build_batch(seqs, hist, q), _build_batch_ref(seqs, hist, q)
            for f in dataclasses.fields(StepBatch):
                if f.name not in ("extras", "prompt_lp"):
                    assert _same_arrays(getattr(got, f.name), getattr(want, f.name)), f.name
            assert (got.extras is None) == (want.extras is None)
            if got.extras is not None:  # build_extras itself: tests/unit/test_sampling_rows.py
                assert got.extras.num_logprobs == max(
                    (s.request.sampling.logprobs for s in seqs if s.request.sampling.logprobs is not None), default=-1)


def test_logprobs_only_extras_share_read_only_off_arrays():
    seqs = _seqs(np.random.default_rng(0), 8, SamplingParams(logprobs=3))
    a, b = build_extras(seqs), build_extras(seqs)
    assert a.min_p is b.min_p and not a.min_p.flags.writeable and a.num_logprobs == 3
    with pytest.raises(ValueError):
        a.bias_ids[0, 0] = 5


class _LogprobExecutor:
    """Tokens and logprobs of each step drawn at random, kept for the comparison."""

    def __init__(self):
        from engine.testing import ToyModelConfig

        self.model_config = ToyModelConfig(V, 4096)
        self.max_model_len, self.num_kv_blocks, self.block_size, self.dp_size = 4096, 512, 4, 1
        self.rng = np.random.default_rng(1)
        self.sent: list[tuple[list[int], SampledTokens]] = []  # per step: the rows' max_tokens-free ids, result

    def step(self, batches, num_steps: int = 1):
        b = batches[0]
        n = b.extras.num_logprobs
        toks = self.rng.integers(1, V, b.batch_size)
        lps = np.sort(-self.rng.random((b.batch_size, n), dtype=np.float32), axis=1)[:, ::-1]
        out = SampledTokens(toks, StepLogprobs(-self.rng.random(b.batch_size, dtype=np.float32),
                                               self.rng.integers(0, V, (b.batch_size, n)).astype(np.int32), lps))
        self.sent.append((b.token_ids.tolist(), out))
        return [out]


def test_engine_logprob_entries_are_the_steps_values_as_lists():
    """new_logprobs per step and logprobs at the end: (float, list[int], list[float]) per token, the step's values
    (its first n entries for a request asking n), whatever other rows of the step ask."""
    ex = _LogprobExecutor()
    eng = LLMEngine(ex, EngineConfig(max_num_seqs=8, enable_prefix_caching=False))
    counts = (5, 0, 2, None, 5, 20)
    ids = [eng.add_request(eng.make_request([1 + i, 2, 3], SamplingParams(logprobs=n), max_tokens=7))
           for i, n in enumerate(counts)]
    streamed: dict[str, list] = {i: [] for i in ids}
    final = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.new_logprobs is not None:
                streamed[o.request_id].extend(o.new_logprobs)
            if o.finished:
                final[o.request_id] = o
    rows = {i: r for r, i in enumerate(ids)}  # every step runs every request, in order
    for rid, n in zip(ids, counts):
        o = final[rid]
        if n is None:
            assert o.logprobs is None and not streamed[rid]
            continue
        want = []
        for _, st in ex.sent[:len(o.token_ids)]:
            lp, r = st.logprobs, rows[rid]
            want.append((lp.chosen[r].item(), lp.top_ids[r, :n].tolist(), lp.top_logprobs[r, :n].tolist()))
        for got in (o.logprobs, streamed[rid]):
            assert got == want
            assert all(type(c) is float and type(a) is list and type(b) is list for c, a, b in got)
        assert o.logprobs is not o.new_logprobs


def test_a_step_with_fewer_top_logprobs_than_asked_is_refused():
    from engine.scheduler import SchedulerError

    class Short(_LogprobExecutor):
        def step(self, batches, num_steps: int = 1):
            (out,) = super().step(batches, num_steps)
            lp = out.logprobs
            return [SampledTokens(out.tokens, StepLogprobs(lp.chosen, lp.top_ids[:, :2], lp.top_logprobs[:, :2]))]

    eng = LLMEngine(Short(), EngineConfig(max_num_seqs=8))
    eng.add_request(eng.make_request([1, 2, 3], SamplingParams(logprobs=3), max_tokens=4))
    with pytest.raises(SchedulerError, match="logprobs of shape"):
        eng.step()


def test_kept_logprob_rows_give_back_the_entries_bit_for_bit():
    """`engine.logprob_rows`: a step's rows, each request's prefix of n, turn back into the entries `step_entries`
    gives (bits of every float: NaN payloads, -0.0, infinities), whatever the step's width and dtypes."""
    from engine.logprob_rows import entries, step_entries, step_rows

    rng = np.random.default_rng(8)
    special = np.array([np.nan, -0.0, -np.inf, 0.0, -1e-45, -3.4e38], np.float32)
    for b, width in ((1, 0), (3, 5), (64, 20)):
        steps = []
        for _ in range(4):
            lps = (-rng.random((b, width))).astype(np.float32)
            lps.flat[:min(lps.size, len(special))] = special[:lps.size]
            steps.append(StepLogprobs(-rng.random(b, dtype=np.float32), rng.integers(0, 2**31 - 1, (b, width),
                                                                                    dtype=np.int64).astype(np.int32),
                                      np.asfortranarray(lps)))
        for row in range(b):
            for n in range(width + 1):
                kept = []
                for lp in steps:
                    raw, size = step_rows(lp)
                    kept.append(raw[row * size: row * size + 4 + 8 * n])
                want = [(e[0], e[1][:n], e[2][:n]) for e in (step_entries(lp)[row] for lp in steps)]
                got = entries(kept, n)
                assert np.array([g[0] for g in got], np.float32).tobytes() == \
                    np.array([w[0] for w in want], np.float32).tobytes()
                assert [g[1] for g in got] == [w[1] for w in want]
                assert np.array([g[2] for g in got], np.float32).tobytes() == \
                    np.array([w[2] for w in want], np.float32).tobytes()
                assert all(type(g[1]) is list and type(g[2]) is list for g in got)
    assert entries([], 5) == []


# ---- sampler extras: byte-level checks
def _extras(n: int, rng, lists: str, pen: str) -> SamplerExtras:
    def ids(w):
        if lists == "unused":
            return np.full((n, w), -1, np.int32)
        if lists == "bad":
            return np.full((n, w), -2, np.int32)
        if lists == "too_big":
            return np.full((n, w), V, np.int32)
        return rng.integers(-1, V, (n, w), dtype=np.int32)

    p = np.tile(np.float32([0, 0, 1]), (n, 1))
    if pen == "neg_zero":
        p[:, 0] = -0.0
    elif pen == "on":
        p[n // 2, 2] = 1.2
    return SamplerExtras(np.zeros(n, np.float32), p, ids(2), np.zeros((n, 2), np.float32), ids(1), ids(3),
                         np.zeros((n, 3), np.int32), 5)


def _validate_ref(ex: SamplerExtras, b: int, vocab: int) -> str:
    for name in ("bias_ids", "ban_ids", "pen_ids"):
        a = getattr(ex, name)
        if a.size and (a.min() < -1 or a.max() >= vocab):
            return f"sampler extras: {name} must be token ids in [0, {vocab}) or -1"
    return "ok"


@pytest.mark.parametrize("lists", ["unused", "random", "bad", "too_big"])
@pytest.mark.parametrize("pen", ["off", "neg_zero", "on"])
def test_processed_and_validate_decide_as_the_reductions(lists, pen):
    rng = np.random.default_rng(3)
    for n in (1, 7, 64):
        ex = _extras(n, rng, lists, pen)
        p = ex.penalties
        assert ex.processed == bool((ex.bias_ids >= 0).any() or (ex.ban_ids >= 0).any() or (p[:, 0] != 0).any()
                                    or (p[:, 1] != 0).any() or (p[:, 2] != 1).any())
        try:
            ex.validate(n, V)
            got = "ok"
        except BatchError as e:
            got = str(e)
        assert got == _validate_ref(ex, n, V)
    with pytest.raises(BatchError, match="bias_ids must be int32"):
        dataclasses.replace(_extras(3, rng, "unused", "off"), bias_ids=np.full((3, 2), -1, np.int64)).validate(3, V)


def test_logprobs_only_extras_validate_and_travel_as_their_head_alone():
    """`SamplerExtras.off` (a logprobs-only step's extras): validated, processed and decoded as equal arrays are
    (copies of them take the general paths); on the wire it is its head alone and decodes to `off`'s arrays."""
    from actors.protocol import plan_step
    from actors.wire import WireError, decode_request, encode_request

    for n in (1, 5, 64):
        off = SamplerExtras.off(n, 5)
        copies = dataclasses.replace(off, **{f.name: getattr(off, f.name).copy()
                                             for f in dataclasses.fields(SamplerExtras)
                                             if f.name not in ("num_logprobs", "allow_bits")})
        assert off.logprobs_only and not copies.logprobs_only and SamplerExtras.off(n, 0).min_p is off.min_p
        assert off.processed is False and copies.processed is False
        off.validate(n, V)
        copies.validate(n, V)
        for bad in (dataclasses.replace(off, num_logprobs=21), dataclasses.replace(copies, num_logprobs=21)):
            with pytest.raises(BatchError, match="num_logprobs"):
                bad.validate(n, V)
        with pytest.raises(BatchError, match="rows"):
            off.validate(n + 1, V)
        frames = []
        for ex in (off, copies):
            b = StepBatch.from_sequences([[5 + i] for i in range(n)], [10] * n, [[1 + i] for i in range(n)])
            plan = plan_step([dataclasses.replace(b, extras=ex)], cross_dp=False, decode_buckets=[64],
                             token_buckets=[64])
            frames.append(encode_request(plan, 0))
        assert len(frames[0]) == len(frames[1]) - 4 * n * (4 + 2 + 1 + 2)
        got, want = (decode_request(memoryview(f)[LENGTH.size:])[0][0].extras for f in frames)
        assert got.logprobs_only and not got.min_p.flags.writeable and got.num_logprobs == want.num_logprobs == 5
        assert got.allow_bits is want.allow_bits is None
        for f in dataclasses.fields(SamplerExtras):
            if f.name not in ("num_logprobs", "allow_bits"):
                assert _same_arrays(getattr(got, f.name), getattr(want, f.name)), f.name
        with pytest.raises(WireError, match="extras"):
            decode_request(memoryview(frames[0] + b"\0" * 4)[LENGTH.size:])


# ---- the wire's logprob reply
def test_logprob_reply_of_strided_views_equals_that_of_contiguous_copies():
    packed = np.random.default_rng(5).integers(-2**31, 2**31 - 1, (9, 2 + 2 * 5), dtype=np.int64).astype(np.int32)
    views = unpack_logprobs(packed.copy(), 3)
    copies = SampledTokens(views.tokens.copy(), StepLogprobs(*(np.ascontiguousarray(a) for a in views.logprobs)))
    frame = encode_tokens(views, 0.25)
    assert frame == encode_tokens(copies, 0.25)
    as_other = SampledTokens(views.tokens.astype(np.int32), StepLogprobs(*views.logprobs))
    assert encode_tokens(as_other, 0.25) == frame  # any dtype: cast as before
    _, seconds, got = decode_reply(memoryview(frame)[LENGTH.size:])
    assert seconds == 0.25
    for a, w in zip((got.tokens, *got.logprobs), (copies.tokens, *copies.logprobs)):
        assert _same_arrays(a, w)
    got.logprobs.top_ids[0, 0] = 7  # the driver's own copy
    assert frame == encode_tokens(copies, 0.25)


# ---- captured heads: cached rows and variant, position-only staging
def _sampled(n: int, step: int, temperature: float = 1.0, lp: int = 5) -> StepBatch:
    b = StepBatch.from_sequences([[5 + i] for i in range(n)], [10 + i + step for i in range(n)],
                                 [[1 + i] for i in range(n)], temperature=[temperature] * n, top_p=[0.9] * n,
                                 seeds=[7 + i for i in range(n)])
    if lp < 0:
        return b
    none_i = np.full((n, 1), -1, np.int32)
    return dataclasses.replace(b, extras=SamplerExtras(np.zeros(n, np.float32), np.tile(np.float32([0, 0, 1]), (n, 1)),
                                                       none_i, np.zeros((n, 1), np.float32), none_i.copy(),
                                                       none_i.copy(), np.zeros((n, 1), np.int32), lp))


def test_staged_rows_of_a_decode_loop_equal_a_full_staging_every_step():
    """`stage_graph_rows` over a decode loop (positions moving on, then other rows, other sizes, an arm's upload in
    between) leaves every mirror and the device block as a sampler that stages each step from scratch does."""
    s = StepSampler(torch.device("cpu"), V, 256)
    list(s.graph_heads(lambda h, b: h, max_rows=16))
    steps = [_sampled(4, k) for k in range(7)] + [_sampled(4, 7, temperature=0.5), _sampled(3, 8), _sampled(3, 9),
                                                  _sampled(4, 10, lp=-1), _sampled(4, 11, lp=-1)]
    steps += [_sampled(4, 12 + k) for k in range(6)]
    for k, batch in enumerate(steps):
        if k == 14:
            s.graph_params.arm_upload(8)  # an arm's upload in between (it keeps the mirror's rows)
        assert s.stage_graph_rows(batch, 8, lambda b, name: ()) is not None
        fresh = StepSampler(torch.device("cpu"), V, 256)
        list(fresh.graph_heads(lambda h, b: h, max_rows=16))
        fresh.graph_params.stage(fresh._graph_rows(batch)[0])
        fresh.graph_params.upload(8, lists=False)
        assert torch.equal(s.graph_params.scalars[:8], fresh.graph_params.scalars[:8]), k
        variant = s._graph_rows(batch)[1]
        assert variant == fresh._graph_rows(batch)[0].variant()


# ---- the server's token strings
@pytest.fixture(scope="module")
def tok():
    pytest.importorskip("tokenizers")
    pytest.importorskip("transformers")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
    from chat_fixture import build_tokenizer

    return build_tokenizer()


class _Unreferenceable:
    """A tokenizer that cannot be weakly referenced (no cache kept for it)."""

    __slots__ = ("inner",)

    def __init__(self, inner):
        self.inner = inner

    def decode(self, ids, skip_special_tokens=False):
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


def test_openai_logprobs_equal_the_uncached_conversion(tok):
    """Both shapes, every id of the vocabulary (special tokens, bytes of split characters), repeated ids and ids
    whose strings coincide, twice (cold and warm cache), with the real tokenizer, none, and one without weakrefs."""
    rng = np.random.default_rng(6)
    size = len(tok)
    ids = list(range(size)) + rng.integers(0, size, 64).tolist()
    entries = [(float(-rng.random()), [i, (i + 1) % size, i, 0, size - 1], sorted((-rng.random(5)).tolist())[::-1])
               for i in ids]
    for tokenizer in (tok, None, _Unreferenceable(tok)):
        for _ in range(2):
            for start in (0, 17):
                assert lpmod.completion_logprobs(tokenizer, ids, entries, start) == \
                    _completion_ref(tokenizer, ids, entries, start)
            assert lpmod.chat_logprobs(tokenizer, ids, entries) == _chat_ref(tokenizer, ids, entries)
            tuples = [(c, tuple(a), tuple(b)) for c, a, b in entries]  # as `ChoiceState.logprobs` holds them
            assert lpmod.completion_logprobs(tokenizer, ids, tuples, 3) == _completion_ref(tokenizer, ids, entries, 3)
            assert lpmod.chat_logprobs(tokenizer, ids, tuples) == _chat_ref(tokenizer, ids, entries)


def test_choice_state_keeps_the_entries_of_its_tokens(tok):
    c = ChoiceState(0, 3, tok, stop=())
    fed = []
    for k in range(4):
        new = [(float(-k), [k, k + 1], [-0.5, -1.5])]
        fed += new
        c.feed([10 + k], k == 3, "length" if k == 3 else None, new_logprobs=new)
        assert c.last_logprobs == new
    assert [(e[0], list(e[1]), list(e[2])) for e in c.logprobs] == fed
    assert lpmod.completion_logprobs(tok, c.token_ids, c.logprobs, 0) == _completion_ref(tok, c.token_ids, fed, 0)
    streamed = ChoiceState(0, 3, tok, stop=(), keep_logprobs=False)  # a stream sends each feed's entries
    for k, e in enumerate(fed):
        streamed.feed([10 + k], k == 3, "length" if k == 3 else None, new_logprobs=[e])
        assert streamed.last_logprobs == [e] and streamed.logprobs == []
