"""Incremental detokenisation (real byte-level BPE tokenizer, multi-byte characters split across tokens), stop
strings against a brute-force reference, and `ChoiceState` token accounting."""
from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
pytest.importorskip("tokenizers")
pytest.importorskip("transformers")

from chat_fixture import build_tokenizer  # noqa: E402

from launch.detokenizer import REPLACEMENT, IncrementalDetokenizer  # noqa: E402
from launch.outputs import ChoiceState  # noqa: E402
from launch.stop_strings import StopStringMatcher  # noqa: E402

TEXTS = [
    "Café, naïve, résumé",
    "中文字符 and 🙂🚀 mixed with ASCII",
    "🙂",
    "plain ascii words only",
    "émoji at the end 🚀",
]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def _split_chars(tok, ids):
    """Whether some character is split across tokens (each token alone decodes to U+FFFD somewhere)."""
    return any(REPLACEMENT in tok.decode([i]) for i in ids)


@pytest.mark.parametrize("text", TEXTS)
def test_one_token_at_a_time_never_emits_a_broken_character(tok, text):
    ids = tok.encode(text)
    d = IncrementalDetokenizer(tok)
    deltas = [d.push([i]) for i in ids]
    deltas.append(d.flush())
    assert all(REPLACEMENT not in x for x in deltas), deltas
    assert "".join(deltas) == tok.decode(ids) == text
    if any(ord(c) > 127 for c in text):
        assert _split_chars(tok, ids), "the fixture should split multi-byte characters across tokens"


def test_random_groupings_give_the_same_text(tok):
    rng = random.Random(5)
    for text in TEXTS:
        ids = tok.encode(text)
        for _ in range(20):
            d, out, i = IncrementalDetokenizer(tok), [], 0
            while i < len(ids):
                n = rng.randint(1, 4)
                out.append(d.push(ids[i:i + n]))
                i += n
            out.append(d.flush())
            assert "".join(out) == text and REPLACEMENT not in "".join(out)


def test_window_stays_bounded_on_long_sequences(tok):
    """O(1) per token: the decoded window never grows with the sequence."""
    ids = tok.encode(" ".join(TEXTS) * 40)
    d = IncrementalDetokenizer(tok)
    widest = 0
    out = []
    for i in ids:
        out.append(d.push([i]))
        widest = max(widest, d.window)
    out.append(d.flush())
    assert "".join(out) == tok.decode(ids)
    assert len(ids) > 1000 and widest <= 8


def test_an_incomplete_tail_at_the_end_comes_out_as_a_full_decode_does(tok):
    cut = next(ids[:-1] for ids in (tok.encode(t) for t in ("ok 🚀", "ok 字", "ok 符", "ok é"))
               if tok.decode(ids[:-1]).endswith(REPLACEMENT))  # the last byte of the character never arrives
    d = IncrementalDetokenizer(tok)
    streamed = "".join(d.push([i]) for i in cut)
    assert REPLACEMENT not in streamed
    assert streamed + d.flush() == tok.decode(cut) and tok.decode(cut).endswith(REPLACEMENT)


def test_invalid_bytes_do_not_stall_the_stream(tok):
    lone = [i for i in range(len(tok)) if tok.decode([i]) == REPLACEMENT][:1]  # one continuation byte
    assert lone
    d = IncrementalDetokenizer(tok)
    emitted = "".join(d.push(lone) for _ in range(IncrementalDetokenizer.MAX_PENDING + 1))
    assert emitted  # held at most MAX_PENDING tokens, then sent as what it is


# ---- stop strings
def _reference(text: str, stops: list[str], upto: int) -> tuple[int, bool]:
    """Brute force: how much of text[:upto] may be sent, and whether a stop string has occurred in it."""
    seen = text[:upto]
    hits = [seen.find(s) for s in stops if s in seen]
    if hits:
        return min(hits), True
    for p in range(len(seen)):  # the earliest position from which the rest could still become a stop string
        if any(s.startswith(seen[p:]) for s in stops):
            return p, False
    return len(seen), False


def _kept(text: str, stops: list[str], upto: int) -> int:
    """`include_stop_str_in_output`: the end of the shortest stop string at the earliest match."""
    seen = text[:upto]
    at = min(seen.find(s) for s in stops if s in seen)
    return at + min(len(s) for s in stops if seen.find(s) == at)


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("seed", range(40))
def test_stop_matcher_equals_the_brute_force_reference(seed, include):
    rng = random.Random(seed)
    alphabet = "ab c"
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 60)))
    stops = list({"".join(rng.choice(alphabet) for _ in range(rng.randint(1, 5))) for _ in range(rng.randint(1, 4))})
    m, sent, pos = StopStringMatcher(stops, include), "", 0
    while pos < len(text):
        n = rng.randint(1, 6)
        out, matched = m.push(text[pos:pos + n])
        pos = min(len(text), pos + n)
        sent += out
        want, want_matched = _reference(text, stops, pos)
        if include and want_matched:
            want = _kept(text, stops, pos)
        assert (len(sent), matched) == (want, want_matched), (text, stops, pos)
        assert sent == text[:len(sent)]
        if matched:
            break
    if not m.matched:
        sent += m.flush()
        assert sent == text


def test_stop_matcher_examples():
    m = StopStringMatcher(["END", "\n\n"])
    assert m.push("hello E") == ("hello ", False)  # "E" could start END
    assert m.push("N") == ("", False)
    assert m.push("Dtrailing") == ("", True)
    assert m.push("more") == ("", True) and m.flush() == ""
    m = StopStringMatcher(["abc"])
    assert m.push("xab") == ("x", False) and m.push("x") == ("abx", False) and m.flush() == ""
    m = StopStringMatcher(["bc", "abcd"])
    assert m.push("abc") == ("a", True)  # the earliest match wins
    m = StopStringMatcher(["bcd", "bc", "x"], include=True)
    assert m.push("abcdx") == ("abc", True)  # kept: the shortest of those at the earliest place
    with pytest.raises(ValueError):
        StopStringMatcher([""])


# ---- choices
def test_choice_counts_tokens_up_to_the_one_completing_the_match(tok):
    text = "one two three four five six"
    ids = tok.encode(text)
    stop = "ee fo"  # spans the tokens of "three" and " four"
    complete = next(j for j in range(1, len(ids) + 1) if stop in tok.decode(ids[:j]))
    assert tok.decode(ids[complete - 1:complete]) != stop and complete < len(ids)
    c = ChoiceState(0, 3, tok, (stop,))
    sent, tokens = c.feed(ids[:2], False, None)
    rest_text, rest_tokens = c.feed(ids[2:], False, None)  # several tokens at once (multi-step decode)
    assert c.done and c.stopped_early and c.finish_reason == "stop"
    assert tokens + rest_tokens == c.token_ids == ids[:complete]
    assert sent + rest_text == c.text == text[:text.index(stop)]
    assert c.feed([5], True, "length") == ("", [])


def test_choice_without_stop_strings_passes_tokens_through(tok):
    ids = tok.encode("Café 🙂 done")
    c = ChoiceState(1, 2, tok)
    parts = [c.feed([i], False, None)[0] for i in ids[:-1]]
    parts.append(c.feed(ids[-1:], True, "length")[0])
    assert c.done and not c.stopped_early and c.finish_reason == "length"
    assert "".join(parts) == c.text == "Café 🙂 done" and c.token_ids == ids


def test_a_match_revealed_by_the_final_flush_is_a_stop(tok):
    ids = tok.encode("abc 中")
    c = ChoiceState(0, 1, tok, ("中",))
    text, _ = c.feed(ids, True, "length")
    assert c.finish_reason == "stop" and text == "abc " and not c.stopped_early


def test_choice_without_tokenizer_has_no_text():
    c = ChoiceState(0, 1, None)
    assert c.feed([1, 2], True, "length") == ("", [1, 2]) and c.text == ""
    with pytest.raises(ValueError):
        ChoiceState(0, 1, None, ("x",))


def test_the_backend_decode_equals_the_tokenizers_decode():
    """`IncrementalDetokenizer` decodes with the fast tokenizer's `tokenizers` backend (`backend_decoder`); random
    streams of ids (special tokens and split multi-byte characters included) give the text of the plain path, every
    decode through `tokenizer.decode`."""
    import numpy as np

    from launch.detokenizer import IncrementalDetokenizer, backend_decoder
    from tests.fixtures.hf_checkpoints import build_tokenizer

    tok = build_tokenizer()
    assert backend_decoder(tok) is not None
    rng = np.random.default_rng(0)
    texts = ["The café 日本語 ✓ → ★", "plain words, and <think> tags </think> too"]
    for seed in range(20):
        ids = tok.encode(texts[seed % 2], add_special_tokens=False) + rng.integers(0, len(tok), 30).tolist()
        fast, plain = IncrementalDetokenizer(tok), IncrementalDetokenizer(tok)
        plain._backend = None
        got, want = [], []
        for t in ids:
            got.append(fast.push([t]))
            want.append(plain.push([t]))
        tail = fast.flush()
        assert got == want and tail == plain.flush()
        assert "".join(got) + tail == tok.decode(ids, skip_special_tokens=True)
