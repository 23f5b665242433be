"""The HTTP request parser (`launch.protocol`, `launch.chat`): every field, every failure class, with a real
byte-level BPE tokenizer and chat template (tests/e2e/chat_fixture.py)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
pytest.importorskip("tokenizers")
pytest.importorskip("transformers")

from chat_fixture import build_tokenizer  # noqa: E402

from engine.errors import RequestError  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from launch.chat import parse_chat_request  # noqa: E402
from launch.defaults import GenerationDefaults, GenerationDefaultsError  # noqa: E402
from launch.json_body import parse_json_body  # noqa: E402
from launch.completions import parse_completion_request  # noqa: E402
from launch.protocol import ApiError, ParseContext, ProtocolLimits  # noqa: E402

LIMITS = ProtocolLimits(max_body_bytes=4096)
MSG = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def ctx(tok):
    return ParseContext(("tiny", "alias"), tok, 512, 128, 240, GenerationDefaults(), (2,), LIMITS)


@pytest.fixture(scope="module")
def bare():  # no tokenizer (a preset model)
    return ParseContext(("tiny",), None, 512, 128, 240)


def _outcome(fn, body, ctx):
    """(status, param, code, message) of a failure; 200 and the parsed request otherwise."""
    try:
        return 200, fn(body, ctx)
    except ApiError as exc:
        return exc.status, (exc.param, exc.code, exc.message)
    except RequestError as exc:
        return 400, (exc.param, exc.code, str(exc))


CMPL = parse_completion_request
CHAT = parse_chat_request
BIG = [2**70, 18446744073709551615, 2**63, -(2**63) - 1]

FAILURES = [
    # (name, parser, body, status, param, code)
    ("body not an object", CMPL, [1, 2], 400, None, "invalid_json"),
    ("model wrong type", CMPL, {"model": 5, "prompt": [1]}, 400, "model", "invalid_type"),
    ("unknown model", CMPL, {"model": "gpt-5", "prompt": [1]}, 404, "model", "model_not_found"),
    ("unknown model, chat", CHAT, {"model": "gpt-5", "messages": MSG}, 404, "model", "model_not_found"),
    ("n > 16", CMPL, {"prompt": [1], "n": 17}, 400, "n", "invalid_value"),
    ("best_of > 1", CMPL, {"prompt": [1], "best_of": 3}, 400, "best_of", "unsupported"),
    ("n = 0", CMPL, {"prompt": [1], "n": 0}, 400, "n", "invalid_value"),
    ("n huge", CMPL, {"prompt": [1], "n": 2**70}, 400, "n", "invalid_value"),
    ("n bool", CMPL, {"prompt": [1], "n": True}, 400, "n", "invalid_type"),
    ("n chat > 16", CHAT, {"messages": MSG, "n": 17}, 400, "n", "invalid_value"),
    ("best_of chat", CHAT, {"messages": MSG, "best_of": 2}, 400, "best_of", "unsupported"),
    ("echo on chat not a bool", CHAT, {"messages": MSG, "echo": "yes"}, 400, "echo", "invalid_type"),
    ("echo not a bool", CMPL, {"prompt": [1], "echo": 1}, 400, "echo", "invalid_type"),
    ("prompt_logprobs > 20", CMPL, {"prompt": [1], "prompt_logprobs": 21}, 400, "prompt_logprobs", "invalid_value"),
    ("prompt_logprobs streamed chat", CHAT, {"messages": MSG, "prompt_logprobs": 0, "stream": True}, 400,
     "prompt_logprobs", "invalid_value"),
    ("suffix", CMPL, {"prompt": [1], "suffix": "x"}, 400, "suffix", "unsupported"),
    ("missing prompt", CMPL, {}, 400, "prompt", "missing"),
    ("empty prompt", CMPL, {"prompt": []}, 400, "prompt", "empty_prompt"),
    ("prompt object", CMPL, {"prompt": {"a": 1}}, 400, "prompt", "invalid_type"),
    ("float token", CMPL, {"prompt": [1.5, 2]}, 400, "prompt", "invalid_type"),
    ("bool token", CMPL, {"prompt": [1, True]}, 400, "prompt", "invalid_type"),
    ("mixed prompt", CMPL, {"prompt": [1, "a"]}, 400, "prompt", "invalid_type"),
    ("empty inner list", CMPL, {"prompt": [[1], []]}, 400, "prompt", "invalid_type"),
    ("nested too deep prompt", CMPL, {"prompt": [[[1]]]}, 400, "prompt", "invalid_type"),
    ("too many tokens", CMPL, {"prompt": [1] * 128}, 400, "prompt", "context_length_exceeded"),
    ("too many tokens inner", CMPL, {"prompt": [[1], [1] * 200]}, 400, "prompt", "context_length_exceeded"),
    ("too many prompts", CMPL, {"prompt": [[1]] * 257}, 400, "prompt", "invalid_value"),
    ("too many text prompts", CMPL, {"prompt": ["a"] * 257}, 400, "prompt", "invalid_value"),
    ("text prompt too long", CMPL, {"prompt": "a" * 1_000_001}, 400, "prompt", "invalid_value"),
    ("max_tokens str", CMPL, {"prompt": [1], "max_tokens": "10"}, 400, "max_tokens", "invalid_type"),
    ("max_tokens float", CMPL, {"prompt": [1], "max_tokens": 10.0}, 400, "max_tokens", "invalid_type"),
    ("max_tokens zero", CMPL, {"prompt": [1], "max_tokens": 0}, 400, "max_tokens", "invalid_value"),
    ("max_tokens negative", CMPL, {"prompt": [1], "max_tokens": -5}, 400, "max_tokens", "invalid_value"),
    ("max_completion_tokens huge", CHAT, {"messages": MSG, "max_completion_tokens": 2**70}, 400,
     "max_completion_tokens", "invalid_value"),
    ("temperature NaN", CMPL, {"prompt": [1], "temperature": float("nan")}, 400, "temperature", "invalid_value"),
    ("temperature inf", CMPL, {"prompt": [1], "temperature": float("inf")}, 400, "temperature", "invalid_value"),
    ("temperature str", CHAT, {"messages": MSG, "temperature": "hot"}, 400, "temperature", "invalid_type"),
    ("top_p 0", CMPL, {"prompt": [1], "top_p": 0}, 400, "top_p", "invalid_value"),
    ("top_k float", CMPL, {"prompt": [1], "top_k": 4.0}, 400, "top_k", "invalid_type"),
    ("seed negative", CMPL, {"prompt": [1], "seed": -1}, 400, "seed", "invalid_value"),
    ("seed bool", CHAT, {"messages": MSG, "seed": False}, 400, "seed", "invalid_type"),
    ("presence out of range", CMPL, {"prompt": [1], "presence_penalty": 3}, 400, "presence_penalty", "invalid_value"),
    ("repetition 0", CMPL, {"prompt": [1], "repetition_penalty": 0}, 400, "repetition_penalty", "invalid_value"),
    ("min_p out of range", CMPL, {"prompt": [1], "min_p": 2}, 400, "min_p", "invalid_value"),
    ("min_tokens negative", CMPL, {"prompt": [1], "min_tokens": -1}, 400, "min_tokens", "invalid_value"),
    ("logit_bias too many", CMPL, {"prompt": [1], "logit_bias": {str(i): 1 for i in range(301)}}, 400, "logit_bias",
     "invalid_value"),
    ("logit_bias value", CMPL, {"prompt": [1], "logit_bias": {"1": 500}}, 400, "logit_bias", "invalid_value"),
    ("logit_bias key", CMPL, {"prompt": [1], "logit_bias": {"x": 1}}, 400, "logit_bias", "invalid_type"),
    ("logit_bias list", CMPL, {"prompt": [1], "logit_bias": [1, 2]}, 400, "logit_bias", "invalid_type"),
    ("ignore_eos int", CMPL, {"prompt": [1], "ignore_eos": 1}, 400, "ignore_eos", "invalid_type"),
    ("logprobs 21", CMPL, {"prompt": [1], "logprobs": 21}, 400, "logprobs", "invalid_value"),
    ("logprobs bool (completions)", CMPL, {"prompt": [1], "logprobs": True}, 400, "logprobs", "invalid_type"),
    ("logprobs int (chat)", CHAT, {"messages": MSG, "logprobs": 3}, 400, "logprobs", "invalid_type"),
    ("top_logprobs 21", CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs",
     "invalid_value"),
    ("top_logprobs without logprobs", CHAT, {"messages": MSG, "top_logprobs": 2}, 400, "top_logprobs",
     "invalid_value"),
    ("stop int", CMPL, {"prompt": [1], "stop": 5}, 400, "stop", "invalid_type"),
    ("stop list of ints", CMPL, {"prompt": [1], "stop": [1, 2]}, 400, "stop", "invalid_type"),
    ("stop empty string", CMPL, {"prompt": [1], "stop": ""}, 400, "stop", "invalid_value"),
    ("stop too many", CHAT, {"messages": MSG, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", "invalid_value"),
    ("stop too long", CMPL, {"prompt": [1], "stop": ["x" * 257]}, 400, "stop", "invalid_value"),
    ("stop_token_ids not a list", CMPL, {"prompt": [1], "stop_token_ids": 5}, 400, "stop_token_ids", "invalid_type"),
    ("stop_token_ids str", CMPL, {"prompt": [1], "stop_token_ids": [1, "x"]}, 400, "stop_token_ids", "invalid_type"),
    ("stop_token_ids too many", CMPL, {"prompt": [1], "stop_token_ids": [1] * 257}, 400, "stop_token_ids",
     "invalid_value"),
    ("stop_token_ids out of vocab", CMPL, {"prompt": [1], "stop_token_ids": [512]}, 400, "stop_token_ids",
     "invalid_value"),
    ("stream str", CMPL, {"prompt": [1], "stream": "yes"}, 400, "stream", "invalid_type"),
    ("stream_options not object", CMPL, {"prompt": [1], "stream": True, "stream_options": [1]}, 400,
     "stream_options", "invalid_type"),
    ("stream_options without stream", CMPL, {"prompt": [1], "stream_options": {"include_usage": True}}, 400,
     "stream_options", "invalid_value"),
    ("include_usage str", CHAT, {"messages": MSG, "stream": True, "stream_options": {"include_usage": "y"}}, 400,
     "stream_options.include_usage", "invalid_type"),
    ("messages missing", CHAT, {}, 400, "messages", "missing"),
    ("messages empty", CHAT, {"messages": []}, 400, "messages", "invalid_type"),
    ("messages str", CHAT, {"messages": "hi"}, 400, "messages", "invalid_type"),
    ("message not object", CHAT, {"messages": ["hi"]}, 400, "messages", "invalid_type"),
    ("bad role", CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages", "invalid_value"),
    ("unknown role", CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages", "invalid_value"),
    ("content int", CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages", "invalid_type"),
    ("content missing (user)", CHAT, {"messages": [{"role": "user"}]}, 400, "messages", "missing"),
    ("image part", CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     400, "messages", "unsupported"),
    ("part without text", CHAT, {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, 400, "messages",
     "invalid_type"),
    ("part not object", CHAT, {"messages": [{"role": "user", "content": ["x"]}]}, 400, "messages", "invalid_type"),
    ("too many messages", CHAT, {"messages": MSG * 1025}, 400, "messages", "invalid_value"),
    ("messages too long", CHAT, {"messages": [{"role": "user", "content": "a" * 600_000}] * 2}, 400, "messages",
     "invalid_value"),
    ("template raises", CHAT, {"messages": [{"role": "assistant", "content": "hi"}]}, 400, "messages",
     "template_error"),
    ("kwargs not object", CHAT, {"messages": MSG, "chat_template_kwargs": [1]}, 400, "chat_template_kwargs",
     "invalid_type"),
    ("kwargs reserved", CHAT, {"messages": MSG, "chat_template_kwargs": {"tokenize": False}}, 400,
     "chat_template_kwargs", "invalid_value"),
    ("kwargs messages", CHAT, {"messages": MSG, "chat_template_kwargs": {"messages": []}}, 400,
     "chat_template_kwargs", "invalid_value"),
    ("kwargs not identifier", CHAT, {"messages": MSG, "chat_template_kwargs": {"a-b": 1}}, 400,
     "chat_template_kwargs", "invalid_value"),
    ("kwargs nested", CHAT, {"messages": MSG, "chat_template_kwargs": {"x": {"y": 1}}}, 400, "chat_template_kwargs",
     "invalid_type"),
    ("kwargs too many", CHAT, {"messages": MSG, "chat_template_kwargs": {f"k{i}": 1 for i in range(17)}}, 400,
     "chat_template_kwargs", "invalid_value"),
    ("add_generation_prompt str", CHAT, {"messages": MSG, "add_generation_prompt": "no"}, 400,
     "add_generation_prompt", "invalid_type"),
    ("continue with generation prompt", CHAT, {"messages": MSG, "continue_final_message": True}, 400,
     "continue_final_message", "invalid_value"),
    ("tools no function", CHAT, {"messages": MSG, "tools": [{"type": "function"}]}, 400, "tools", "invalid_type"),
    ("tools not list", CHAT, {"messages": MSG, "tools": {"type": "function"}}, 400, "tools", "invalid_type"),
    ("tools bad name", CHAT, {"messages": MSG, "tools": [{"type": "function", "function": {"name": "a b"}}]}, 400,
     "tools", "invalid_value"),
    ("tools bad parameters", CHAT, {"messages": MSG, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": "x"}}]}, 400, "tools", "invalid_type"),
    ("tools without a parser", CHAT, {"messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}}]},
     400, "tool_choice", "unsupported"),
    ("functions", CHAT, {"messages": MSG, "functions": [{"name": "f"}]}, 400, "functions", "unsupported"),
    ("developer role is system, its content still checked", CHAT, {"messages": [{"role": "developer"}]}, 400,
     "messages", "missing"),
    ("tool message without id", CHAT, {"messages": [{"role": "tool", "content": "x"}]}, 400, "messages", "missing"),
    ("tool_calls on a user", CHAT, {"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, 400,
     "messages", "invalid_type"),
    ("tool_calls arguments not string", CHAT, {"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": {}}}]}]}, 400, "messages", "invalid_type"),
    ("tool_choice required without tools", CHAT, {"messages": MSG, "tool_choice": "required"}, 400, "tool_choice",
     "invalid_value"),
    ("tool_choice unknown function", CHAT, {"messages": MSG, "tools": [{"type": "function", "function": {
        "name": "f"}}], "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, "tool_choice",
     "invalid_value"),
    ("parallel_tool_calls str", CHAT, {"messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}}],
                                       "tool_choice": "none", "parallel_tool_calls": "no"}, 400,
     "parallel_tool_calls", "invalid_type"),
    ("response_format xml", CHAT, {"messages": MSG, "response_format": {"type": "xml"}}, 400,
     "response_format.type", "unsupported"),
    ("response_format not object", CMPL, {"prompt": [1], "response_format": "json"}, 400, "response_format",
     "invalid_type"),
    ("lone surrogate prompt", CMPL, {"prompt": "a\ud800b"}, 400, "prompt", "invalid_value"),
    ("lone surrogate message", CHAT, {"messages": [{"role": "user", "content": "\udfff"}]}, 400, "messages",
     "invalid_value"),
    ("lone surrogate stop", CMPL, {"prompt": [1], "stop": ["\ud83d"]}, 400, "stop", "invalid_value"),
    ("lone surrogate kwarg", CHAT, {"messages": MSG, "chat_template_kwargs": {"x": "\ud800"}}, 400,
     "chat_template_kwargs", "invalid_value"),
    ("chat prompt too long", CHAT, {"messages": [{"role": "user", "content": "one two " * 200}]}, 400, "messages",
     "context_length_exceeded"),
]
FAILURES += [(f"huge {f} {v}", CMPL, {"prompt": [1], f: v}, 400, f, "invalid_value")
             for f in ("seed", "top_k", "max_tokens", "min_tokens") for v in BIG]
FAILURES += [(f"huge stop token id {v}", CMPL, {"prompt": [1], "stop_token_ids": [v]}, 400, "stop_token_ids",
              "invalid_value") for v in BIG]
FAILURES += [(f"huge logit_bias id {v}", CMPL, {"prompt": [1], "logit_bias": {str(v): 1}}, 400, "logit_bias", None)
             for v in BIG if v > 0]


@pytest.mark.parametrize("name, fn, body, status, param, code", FAILURES, ids=[f[0] for f in FAILURES])
def test_failures_name_the_field(ctx, name, fn, body, status, param, code):
    got, detail = _outcome(fn, body, ctx)
    assert got == status, (name, detail)
    assert detail[0] == param, (name, detail)
    if code is not None:
        assert detail[1] == code, (name, detail)
    assert detail[2] and len(detail[2]) < 320 and "Traceback" not in detail[2], detail


def test_tokenizer_needed(bare):
    for fn, body, param in [(CMPL, {"prompt": "hello"}, "prompt"), (CMPL, {"prompt": [1], "stop": "x"}, "stop"),
                            (CHAT, {"messages": MSG}, "messages"),
                            (CMPL, {"prompt": [1], "response_format": {"type": "json_object"}}, "response_format")]:
        status, (p, code, msg) = _outcome(fn, body, bare)
        assert (status, p, code) == (400, param, "no_tokenizer") and "tokenizer" in msg


def test_tokenizer_without_template(tok):
    plain = build_tokenizer()
    plain.chat_template = None
    c = ParseContext(("tiny",), plain, 512, 128)
    status, (p, code, _) = _outcome(CHAT, {"messages": MSG}, c)
    assert (status, p, code) == (400, "messages", "no_chat_template")


def test_model_null_means_the_default_and_unknown_fields_are_ignored(ctx):
    for body in ({"model": None, "prompt": [1, 2]}, {"prompt": [1, 2], "user": "u", "frobnicate": {"x": [1]}},
                 {"model": "alias", "prompt": [1, 2], "n": 1, "best_of": 1, "echo": False, "suffix": None}):
        status, req = _outcome(CMPL, body, ctx)
        assert status == 200, req
        assert req.model == (body.get("model") or "tiny")
    assert CHAT({"model": None, "messages": MSG, "metadata": {"a": "b"}}, ctx).model == "tiny"


def test_n_is_carried_and_max_tokens_given_is_recorded(ctx):
    req = CMPL({"prompt": [[1, 2], [3]], "n": 4, "max_tokens": 5}, ctx)
    assert req.n == 4 and req.max_tokens == [5, 5] and req.max_tokens_given
    assert CMPL({"prompt": [1], "n": 16, "best_of": 1}, ctx).n == 16
    assert not CMPL({"prompt": [1]}, ctx).max_tokens_given and CMPL({"prompt": [1]}, ctx).n == 1
    chat = CHAT({"messages": MSG, "n": 3, "max_completion_tokens": 4}, ctx)
    assert chat.n == 3 and chat.max_tokens_given and not CHAT({"messages": MSG, "n": 3}, ctx).max_tokens_given


def test_completion_fields_are_carried(ctx, tok):
    req = CMPL({"prompt": [[1, 2], [3]], "max_tokens": 7, "temperature": 0.5, "top_k": -1, "top_p": 0.9, "seed": 9,
                "stop": ["a", "a", "bc"], "stop_token_ids": [5, 2], "stream": True,
                "stream_options": {"include_usage": True}, "logprobs": 3, "min_p": 0, "presence_penalty": 0,
                "logit_bias": {}, "ignore_eos": False}, ctx)
    assert req.prompts == [[1, 2], [3]] and req.max_tokens == [7, 7]
    assert req.sampling == SamplingParams(temperature=0.5, top_k=0, top_p=0.9, seed=9, logprobs=3)
    assert req.stop == ("a", "bc") and req.stop_token_ids == [5, 2] and req.stream and req.include_usage
    text = CMPL({"prompt": ["Café 中文", "hello"]}, ctx)
    assert text.prompts == [tok.encode("Café 中文"), tok.encode("hello")]


def test_openai_defaults_and_eos(ctx):
    req = CMPL({"prompt": [1, 2, 3]}, ctx)
    assert req.max_tokens == [16] and req.sampling.temperature == 1.0 and req.stop_token_ids == [2]  # EOS added
    assert CMPL({"prompt": [1], "ignore_eos": True}, ctx).stop_token_ids == []
    assert CMPL({"prompt": [1] * 120}, ctx).max_tokens == [8]  # the default is capped by the context left
    chat = CHAT({"messages": MSG}, ctx)
    assert chat.max_tokens == [128 - len(chat.prompts[0])] and chat.sampling.logprobs is None


def test_generation_defaults_apply_when_omitted_and_yield_to_explicit_values(tok):
    d = GenerationDefaults({"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_new_tokens": 5,
                            "repetition_penalty": 1.1, "eos_token_id": [2, 0], "do_sample": True, "bos_token_id": 1})
    assert d.in_force() == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.1, "max_tokens": 5,
                            "eos_token_id": [2, 0]}
    assert d.ignored == {"do_sample": True, "bos_token_id": 1}
    c = ParseContext(("tiny",), tok, 512, 128, 0, d, d.eos_token_ids)
    req = CMPL({"prompt": [1]}, c)
    assert (req.sampling.temperature, req.sampling.top_p, req.sampling.top_k, req.max_tokens) == (0.6, 0.95, 20, [5])
    assert req.sampling.repetition_penalty == 1.1  # applied by the sampler: in force
    req = CMPL({"prompt": [1], "temperature": 0, "top_k": 0, "top_p": None, "max_tokens": 9}, c)
    assert (req.sampling.temperature, req.sampling.top_p, req.sampling.top_k, req.max_tokens) == (0.0, 0.95, 0, [9])
    assert CHAT({"messages": MSG}, c).max_tokens == [5]
    for bad in ({"temperature": -1}, {"top_k": 1.5}, {"max_tokens": 0}, {"eos_token_id": ["x"]}):
        with pytest.raises(GenerationDefaultsError):
            GenerationDefaults(bad)


def test_chat_goes_through_the_template(ctx, tok):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": [
        {"type": "text", "text": "hello"}, {"type": "text", "text": "world"}]},
        {"role": "assistant", "content": None}, {"role": "user", "content": "again"}]
    req = CHAT({"messages": msgs, "max_completion_tokens": 4, "max_tokens": 99, "logprobs": True, "top_logprobs": 2,
                "seed": 3, "stop": "x"}, ctx)
    plain = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello\nworld"},
             {"role": "assistant", "content": ""}, {"role": "user", "content": "again"}]
    assert req.prompts == [tok.apply_chat_template(plain, add_generation_prompt=True, tokenize=True,
                                                   return_dict=False)]
    assert req.max_tokens == [4] and req.sampling.logprobs == 2 and req.sampling.seed == 3 and req.stop == ("x",)
    think = CHAT({"messages": MSG, "chat_template_kwargs": {"enable_thinking": False}}, ctx).prompts[0]
    assert tok.decode(think).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert CHAT({"messages": MSG, "logprobs": True}, ctx).sampling.logprobs == 0
    cont = CHAT({"messages": MSG + [{"role": "assistant", "content": "Hel"}], "add_generation_prompt": False,
                 "continue_final_message": True}, ctx).prompts[0]
    assert tok.decode(cont).endswith("assistant\nHel")


# ---- the body
J = "application/json"


@pytest.mark.parametrize("raw, ctype, status, needle", [
    (b"", J, 400, "empty"),
    (b"\xff\xfe{}", J, 400, "UTF-8"),
    (b'{"prompt": [1], "seed": NaN}', J, 400, "NaN"),
    (b'{"temperature": Infinity}', J, 400, "Infinity"),
    (b'{"temperature": -Infinity}', J, 400, "Infinity"),
    (b'{"temperature": 1e400}', J, 400, "too large"),
    (b'{"prompt": [1, 2,', J, 400, "malformed JSON"),
    (b'{"seed": ' + b"9" * 5000 + b"}", J, 400, "malformed JSON"),  # beyond Python's int-string limit
    (b"[" * 100_000 + b"]" * 100_000, J, 400, "nested"),  # RecursionError territory
    (b"[" * 40 + b"]" * 40, J, 400, "nested"),  # parses, but deeper than the limit
    (b'{"a": ' * 40 + b"1" + b"}" * 40, J, 400, "nested"),
    (b"{" + b'"k": 1, ' * 1000 + b'"z": 2}', J, 413, "exceeds"),
    (b'{"prompt": [1]}', "text/plain", 415, "application/json"),
    (b'{"prompt": [1]}', "", 415, "application/json"),
    (b'{"prompt": [1]}', "application/x-www-form-urlencoded", 415, "application/json"),
])
def test_bad_bodies(raw, ctype, status, needle):
    limits = LIMITS if status == 413 else ProtocolLimits()  # the size limit of LIMITS is small on purpose
    with pytest.raises(ApiError) as err:
        parse_json_body(raw, ctype, limits)
    assert err.value.status == status and needle.lower() in err.value.message.lower(), err.value.message


def test_good_bodies():
    assert parse_json_body(b'{"a": [1, [2]]}', "application/json; charset=utf-8", LIMITS) == {"a": [1, [2]]}
    assert parse_json_body(b'{"a": 1}', "application/vnd.api+json", LIMITS) == {"a": 1}
    deep = json.dumps([[[[[[1]]]]]]).encode()
    assert parse_json_body(deep, J, LIMITS) == [[[[[[1]]]]]]
    assert parse_json_body('{"t": "Café 🙂"}'.encode(), J, LIMITS) == {"t": "Café 🙂"}


@pytest.mark.parametrize("field, value", [("presence_penalty", 0.5), ("frequency_penalty", -1),
                                          ("repetition_penalty", 1.2), ("logit_bias", {"1": 5}), ("min_p", 0.1),
                                          ("min_tokens", 3)])
def test_every_sampling_field_is_accepted_and_carried(ctx, field, value):
    req = CMPL({"prompt": [1], field: value, "max_tokens": 4}, ctx)
    got = getattr(req.sampling, field)
    assert got == ((1, 5.0),) if field == "logit_bias" else got == value
