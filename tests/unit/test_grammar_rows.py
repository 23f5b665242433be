"""The driver's side of structured outputs: `response_format` parsing and compiling (`launch.structured`), the step's
allowed-token bitmask (`engine.sampling_rows.build_extras`) and the scheduler ending a sequence when its grammar is
complete or broken (`engine.scheduler`). The grammars are compiled by llguidance over a real byte-level BPE tokenizer
(`tests.e2e.chat_fixture.build_tokenizer`); the expected masks come from llguidance itself."""
from __future__ import annotations

import json

import numpy as np
import pytest

from engine.errors import RequestError
from engine.grammar import GrammarViolation, mask_words
from engine.request import FinishReason, Request
from engine.sampling_params import SamplingParams
from engine.sampling_rows import build_extras
from engine.scheduler import Scheduler, SchedulerConfig
from engine.sequence import Sequence

llguidance = pytest.importorskip("llguidance")
pytest.importorskip("transformers")
from launch.structured import GrammarCompiler, parse_response_format  # noqa: E402
from tests.e2e.chat_fixture import build_tokenizer  # noqa: E402

VOCAB = 520  # the model's ids: the tokenizer's 512 and 8 more that no grammar may allow
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
          "required": ["answer"], "additionalProperties": False, "x-guidance": {"whitespace_flexible": False}}
FORMAT = {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}}


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def compiler(tok):
    return GrammarCompiler(tok, VOCAB, [tok.eos_token_id])


def _allowed(row: np.ndarray) -> set[int]:
    return {i for i in range(32 * row.size) if (int(row[i // 32]) >> (i % 32)) & 1}


def test_response_formats(compiler):
    assert parse_response_format({}, compiler) is None
    assert parse_response_format({"response_format": {"type": "text"}}, compiler) is None
    g = parse_response_format({"response_format": {"type": "json_object"}}, compiler)
    assert g.kind == "json_object" and g.words == mask_words(VOCAB) == 17
    assert parse_response_format(FORMAT, compiler).kind == "json_schema"
    with pytest.raises(RequestError) as e:
        parse_response_format({"response_format": {"type": "json_object"}}, None)
    assert (e.value.param, e.value.code) == ("response_format", "no_tokenizer")
    bad = {"type": "json_schema", "json_schema": {"schema": {"type": "object", "required": 3}}}
    with pytest.raises(RequestError) as e:
        parse_response_format({"response_format": bad}, compiler)
    assert e.value.param == "response_format.json_schema.schema" and e.value.code == "invalid_schema"


def test_the_step_carries_each_constrained_rows_mask(compiler, tok):
    grammar = parse_response_format(FORMAT, compiler)
    free = Sequence(Request.make([1, 2, 3], SamplingParams(temperature=1.0)))
    plain_only = build_extras([free])
    assert plain_only is None  # nothing changes for steps without a grammar
    seqs = [free, Sequence(Request.make([4, 5], grammar=grammar)), Sequence(Request.make([6], grammar=grammar))]
    for t in tok.encode('{"ans', add_special_tokens=False):
        assert not seqs[2].grammar.advance(t)
    ex = build_extras(seqs)
    assert ex is not None and ex.processed and ex.allow_bits.shape == (3, 17) and ex.allow_bits.dtype == np.int32
    assert (ex.allow_bits[0] == -1).all()
    assert _allowed(ex.allow_bits[1]) == {tok.encode("{", add_special_tokens=False)[0]}
    ref = grammar.matcher.deep_copy()
    ref.consume_tokens(tok.encode('{"ans', add_special_tokens=False))
    want = np.zeros(17, np.int32)
    ref.unsafe_compute_mask_ptr(want.ctypes.data, want.nbytes)
    assert (ex.allow_bits[2] == want).all() and _allowed(want) and max(_allowed(want)) < 512
    assert grammar.matcher.deep_copy().consume_token(tok.encode("{", add_special_tokens=False)[0])  # template unmoved
    ex.validate(3, VOCAB)


def _run(sched: Scheduler, seq: Sequence, tokens: list[int]) -> None:
    for t in tokens:
        batch = sched.schedule()
        assert batch is not None and batch.seqs == [seq]
        sched.update(batch, np.array([t], np.int64))
        if seq.is_finished:
            return


def test_the_scheduler_ends_a_complete_or_broken_grammar(compiler, tok):
    grammar = parse_response_format(FORMAT, compiler)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_model_len=128), 32, 8)
    text = '{"answer":"no"}'
    ids = tok.encode(text, add_special_tokens=False)
    done = Sequence(Request.make([7, 8, 9], max_tokens=100, grammar=grammar))
    sched.add(done)
    _run(sched, done, ids + [ids[0]])
    assert done.finish_reason is FinishReason.STOP and not done.stopped_on_token
    assert tok.decode(done.output_token_ids) == text and json.loads(text) == {"answer": "no"}
    broken = Sequence(Request.make([7, 8, 9], max_tokens=100, grammar=grammar))
    sched.add(broken)
    _run(sched, broken, [ids[0], ids[0]])  # a second "{" is outside the grammar
    assert broken.finish_reason is FinishReason.ERROR and "outside the grammar" in broken.error
    with pytest.raises(GrammarViolation):
        grammar.start().advance(tok.encode("}", add_special_tokens=False)[0])


def test_a_grammar_for_another_vocabulary_is_refused(compiler):
    from engine.request import ModelLimits, validate_request

    req = Request.make([1, 2], grammar=parse_response_format(FORMAT, compiler))
    validate_request(req, ModelLimits(VOCAB, 64, 8, 16))
    with pytest.raises(RequestError) as e:
        validate_request(req, ModelLimits(1024, 64, 8, 16))
    assert e.value.param == "response_format"


def test_the_thread_pool_fills_the_same_masks(compiler, tok):
    from engine.grammar import fill_masks

    grammar = parse_response_format(FORMAT, compiler)
    states = [grammar.start() for _ in range(5)]
    for k, st in enumerate(states):
        for t in tok.encode('{"answer":"yes"}'[:2 * k], add_special_tokens=False):
            st.advance(t)
    serial = np.zeros((6, 17), np.int32)
    pooled = np.zeros((6, 17), np.int32)
    rows = [(i + 1, st) for i, st in enumerate(states)]
    fill_masks(serial, rows)
    fill_masks(pooled, rows, llguidance.LLExecutor(2))
    assert (serial == pooled).all() and (serial[0] == 0).all() and len({serial[i].tobytes() for i in range(1, 6)}) > 2


@pytest.mark.parametrize("pool", [False, True])
def test_a_reasoning_gate_frees_the_think_block(compiler, tok, pool):
    import dataclasses

    from engine.grammar import ThinkGate, fill_masks

    grammar = parse_response_format(FORMAT, compiler)
    start, end = 500, 511  # stand-in tag ids, above what the grammar allows
    brace = tok.encode("{", add_special_tokens=False)[0]
    first = dataclasses.replace(grammar, think=ThinkGate(start, end, open=False)).start()
    opened = dataclasses.replace(grammar, think=ThinkGate(start, end, open=True)).start()
    plain = grammar.start()
    mask = np.zeros((3, 17), np.int32)
    fill_masks(mask, [(0, first), (1, opened), (2, plain)], llguidance.LLExecutor(2) if pool else None)
    assert _allowed(mask[0]) == {brace, start} and (mask[1] == -1).all() and _allowed(mask[2]) == {brace}
    assert not first.advance(start) and not first.advance(7) and not first.advance(start)  # free inside the block
    assert not first.advance(end)
    with pytest.raises(GrammarViolation):
        first.advance(end)  # after the block the grammar rules
    assert not opened.advance(end) and not opened.advance(brace)
    skip = dataclasses.replace(grammar, think=ThinkGate(start, end, open=False)).start()
    assert not skip.advance(brace)  # no think block: the first token is the grammar's
    row = np.zeros(17, np.int32)
    skip.fill(row)
    assert start not in _allowed(row)


def test_allowed_token_ids_and_a_grammar_meet_in_one_mask(compiler, tok):
    """A row with `allowed_token_ids` allows exactly those ids; with a grammar too, the ids both allow; the other
    rows every id. Through the scheduler, whose width comes from the vocabulary."""
    grammar = parse_response_format(FORMAT, compiler)
    brace = tok.encode("{", add_special_tokens=False)[0]
    only = Sequence(Request.make([1, 2], SamplingParams(allowed_token_ids=[5, 517, 33, 5])))
    both = Sequence(Request.make([3], SamplingParams(allowed_token_ids=[brace, 40]), grammar=grammar))
    none = Sequence(Request.make([3], SamplingParams(allowed_token_ids=[40]), grammar=grammar))
    free = Sequence(Request.make([4], SamplingParams(temperature=1.0)))
    ex = build_extras([only, both, none, free], mask_words(VOCAB))
    assert ex.allow_bits.shape == (4, 17) and ex.processed
    assert [_allowed(r) for r in ex.allow_bits[:3]] == [{5, 33, 517}, {brace}, set()]
    assert (ex.allow_bits[3] == -1).all()
    ex.validate(4, VOCAB)
    with pytest.raises(ValueError, match="mask width"):
        build_extras([only])  # no grammar row and no width given
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_model_len=128), 32, 8, vocab_size=VOCAB)
    sched.add(Sequence(Request.make([7, 8], SamplingParams(allowed_token_ids=[519]), max_tokens=4)))
    batch = sched.schedule()
    assert [_allowed(r) for r in batch.batch.extras.allow_bits] == [{519}]
