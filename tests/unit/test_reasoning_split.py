"""The think-block split of chat choices (`launch.reasoning`, `launch.outputs.ChoiceState` with a splitter), on
the fixture checkpoint's real tokenizer: the same texts and tokens however the tokens arrive; when a choice
reasons (its first token `<think>`, or a prompt ending in an open block) and when it does not (a closed,
pre-filled block: `enable_thinking: false`); stop strings match the content only; the start-up check names what is
missing."""
import numpy as np
import pytest

transformers = pytest.importorskip("transformers")

from launch.outputs import ChoiceState
from launch.reasoning import ReasoningParserError, ThinkSplitter, prompt_opens_thinking, think_tags
from launch.tools import ToolChoice
from tests.fixtures.hf_checkpoints import build_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def tags(tok):
    return think_tags(tok, "qwen3")


def _ids(tok, text):
    return tok.encode(text, add_special_tokens=False)


def _chunks(ids, rng):
    out, i = [], 0
    while i < len(ids):
        k = int(rng.integers(1, 4))
        out.append(ids[i:i + k])
        i += k
    return out


def _run(tok, tags, prompt, ids, chunks, stop=(), eos=False):
    c = ChoiceState(0, len(prompt), tok, stop, think=ThinkSplitter(tags, prompt))
    reasoning, content, tokens = [], [], []
    for j, part in enumerate(chunks):
        last = j == len(chunks) - 1
        text, toks = c.feed(part, last, "stop" if last else None, stop_token=eos and last)
        reasoning.append(c.last_reasoning)
        content.append(text)
        tokens += toks
        if c.done:
            break
    assert "".join(reasoning) == (c.reasoning_text or "") and "".join(content) == c.text
    assert tokens == c.token_ids
    return c


@pytest.mark.parametrize("seed", range(6))
def test_any_chunking_gives_the_same_split(tok, tags, seed):
    r_ids, c_ids = _ids(tok, "\nThe fox is quick, 日本語 too.\n"), _ids(tok, "\n\nIt jumps. ✓")
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    ids = [tags.start, *r_ids, tags.end, *c_ids, im_end]
    rng = np.random.default_rng(seed)
    chunks = [ids] if seed == 0 else _chunks(ids, rng)
    c = _run(tok, tags, [1, 2], ids, chunks, eos=True)
    assert c.reasoning_text == tok.decode(r_ids) and c.text == tok.decode(c_ids)
    assert c.token_ids == ids and c.reasoning_tokens == len(r_ids) + 2 and c.finish_reason == "stop"


def test_a_prompt_ending_in_an_open_block_reasons_from_the_first_token(tok, tags):
    r_ids, c_ids = _ids(tok, "thinking"), _ids(tok, " answer")
    prompt = [tags.turn_start, *_ids(tok, "assistant\n"), tags.start, *_ids(tok, "\n")]
    assert prompt_opens_thinking(prompt, tags)
    c = _run(tok, tags, prompt, r_ids + [tags.end] + c_ids, [r_ids + [tags.end] + c_ids])
    assert (c.reasoning_text, c.text) == ("thinking", " answer")


def test_a_closed_prefilled_block_or_no_tag_means_content_only(tok, tags):
    closed = [tags.turn_start, *_ids(tok, "assistant\n"), tags.start, *_ids(tok, "\n\n"), tags.end,
              *_ids(tok, "\n\n")]
    assert not prompt_opens_thinking(closed, tags)
    assert not prompt_opens_thinking([tags.start, 5, tags.turn_start, 6], tags)  # an earlier turn's block
    ids = _ids(tok, "plain answer")
    for prompt in (closed, [1, 2]):
        c = _run(tok, tags, prompt, ids, _chunks(ids, np.random.default_rng(1)))
        assert c.reasoning_text is None and c.text == "plain answer" and c.reasoning_tokens == 0
    late = ids + [tags.start] + ids  # a tag after content is content (its special-token text is dropped)
    c = _run(tok, tags, [1], late, [late])
    assert c.reasoning_text is None and c.text == tok.decode(late, skip_special_tokens=True)


def test_stop_strings_match_the_content_not_the_reasoning(tok, tags):
    r_ids, c_ids = _ids(tok, "the fox. the end"), _ids(tok, " so: the end is near")
    ids = [tags.start, *r_ids, tags.end, *c_ids]
    c = _run(tok, tags, [1], ids, _chunks(ids, np.random.default_rng(2)), stop=("the end",))
    assert c.reasoning_text == "the fox. the end"
    assert c.text == " so: " and c.finish_reason == "stop" and c.stopped_early


def test_a_choice_ended_inside_the_block_has_no_content(tok, tags):
    r_ids = _ids(tok, "still thinking")
    c = _run(tok, tags, [1], [tags.start, *r_ids], [[tags.start], r_ids])
    assert (c.reasoning_text, c.text, c.reasoning_tokens) == ("still thinking", "", len(r_ids) + 1)


def test_the_start_up_check_names_what_is_missing(tok):
    with pytest.raises(ReasoningParserError, match="needs a checkpoint with a tokenizer"):
        think_tags(None, "qwen3")
    with pytest.raises(ReasoningParserError, match="the parsers are qwen3"):
        think_tags(tok, "deepseek")

    class NoTags:
        def get_vocab(self):
            return {"a": 0, "</think>": 1}

    with pytest.raises(ReasoningParserError, match="no <think> token"):
        think_tags(NoTags(), "qwen3")


@pytest.mark.parametrize("seed", range(4))
def test_reasoning_and_tool_calls_stream_as_they_answer_whole(tok, tags, seed):
    """Both parsers on one chat choice (`launch.generation.Shape`): the streamed deltas join to the whole answer's
    reasoning, content and calls; a stop with calls is finish_reason tool_calls."""
    from launch.generation import Shape

    text = ("Let me look.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n"
            "</tool_call>")
    ids = [tags.start, *_ids(tok, "\nthe user wants weather\n"), tags.end, *_ids(tok, "\n\n" + text),
           tok.convert_tokens_to_ids("<|im_end|>")]
    rng = np.random.default_rng(seed)
    whole = ChoiceState(0, 2, tok, think=ThinkSplitter(tags, [1, 2]))
    whole.feed(ids, True, "stop", stop_token=True)
    answer = Shape(True, tok, tags, ToolChoice("auto")).response("r", "m", 0, [whole], 1)["choices"][0]
    shape = Shape(True, tok, tags, ToolChoice("auto"))
    c = ChoiceState(0, 2, tok, think=ThinkSplitter(tags, [1, 2]), keep_logprobs=False)
    deltas, chunks = [], _chunks(ids, rng)
    for j, part in enumerate(chunks):
        last = j == len(chunks) - 1
        d = shape.delta(c, *c.feed(part, last, "stop" if last else None, stop_token=last))
        if d is not None:
            deltas.append(d)
    msg = answer["message"]
    assert msg["reasoning_content"] == "\nthe user wants weather\n" and msg["content"] == "Let me look."
    assert [t["function"]["name"] for t in msg["tool_calls"]] == ["get_weather"] and answer["finish_reason"] == \
        "tool_calls"
    assert "".join(d["delta"].get("reasoning_content", "") for d in deltas) == msg["reasoning_content"]
    assert "".join(d["delta"].get("content", "") for d in deltas) == msg["content"]
    streamed_calls = [t for d in deltas for t in d["delta"].get("tool_calls", [])]
    assert [(t["index"], t["function"]) for t in streamed_calls] == [(0, msg["tool_calls"][0]["function"])]
    assert [d["finish_reason"] for d in deltas if d["finish_reason"]] == ["tool_calls"]
