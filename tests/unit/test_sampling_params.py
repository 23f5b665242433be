"""`engine.sampling_params.SamplingParams`: every field's type and range, normalisation, the legacy class,
and that the module (and `engine.request`) import no torch."""
from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

from engine.errors import RequestError
from engine.sampling_params import (DEFAULTS, ENGINE_APPLIES, FIELDS, INT32_MAX, SEED_MAX, SamplingParams,
                                    check_int, check_number)

REPO = Path(__file__).resolve().parents[2]

GOOD = [
    ("temperature", 0), ("temperature", 0.7), ("temperature", 100), ("temperature", 2),
    ("top_k", -1), ("top_k", 0), ("top_k", 1), ("top_k", INT32_MAX),
    ("top_p", 1), ("top_p", 1e-6), ("top_p", 0.5),
    ("min_p", 0), ("min_p", 1), ("min_p", 0.05),
    ("seed", None), ("seed", 0), ("seed", SEED_MAX), ("seed", 12345),
    ("presence_penalty", -2), ("presence_penalty", 2), ("frequency_penalty", 0.5), ("frequency_penalty", -2.0),
    ("repetition_penalty", 2), ("repetition_penalty", 1e-3), ("repetition_penalty", 1.1),
    ("logit_bias", {"5": 1.5, "0": -100, "511": 100}), ("logit_bias", [(3, 2.0)]), ("logit_bias", None),
    ("logit_bias", {str(i): 1 for i in range(300)}),
    ("min_tokens", 0), ("min_tokens", INT32_MAX), ("ignore_eos", True), ("ignore_eos", False),
    ("logprobs", None), ("logprobs", 0), ("logprobs", 20),
    ("bad_words", ()), ("bad_words", [[5], [1, 2, 3]]), ("bad_words", [[INT32_MAX] * 32] * 128),
    ("allowed_token_ids", None), ("allowed_token_ids", [0]), ("allowed_token_ids", (9, 3, 9, INT32_MAX)),
    ("prompt_logprobs", None), ("prompt_logprobs", 0), ("prompt_logprobs", 20),
]


@pytest.mark.parametrize("name, value", GOOD)
def test_in_range_values_are_accepted(name, value):
    sp = SamplingParams(**{name: value})
    hash(sp)  # frozen and hashable, logit_bias included


BAD = [
    # (field, value, code)
    ("temperature", -0.1, "invalid_value"), ("temperature", 100.5, "invalid_value"),
    ("temperature", math.nan, "invalid_value"), ("temperature", math.inf, "invalid_value"),
    ("temperature", float("1e400"), "invalid_value"), ("temperature", -math.inf, "invalid_value"),
    ("temperature", True, "invalid_type"), ("temperature", "0.5", "invalid_type"),
    ("temperature", None, "invalid_type"),
    ("temperature", 10**400, "invalid_value"),
    ("top_k", -2, "invalid_value"), ("top_k", INT32_MAX + 1, "invalid_value"), ("top_k", 2**70, "invalid_value"),
    ("top_k", 18446744073709551615, "invalid_value"), ("top_k", 5.0, "invalid_type"), ("top_k", False, "invalid_type"),
    ("top_k", "5", "invalid_type"),
    ("top_p", 0, "invalid_value"), ("top_p", 1.0000001, "invalid_value"), ("top_p", -1, "invalid_value"),
    ("top_p", 1e-50, "invalid_value"), ("top_p", math.nan, "invalid_value"), ("top_p", True, "invalid_type"),
    ("min_p", -0.01, "invalid_value"), ("min_p", 1.5, "invalid_value"), ("min_p", math.inf, "invalid_value"),
    ("seed", -1, "invalid_value"), ("seed", -(2**63), "invalid_value"), ("seed", SEED_MAX + 1, "invalid_value"),
    ("seed", 2**70, "invalid_value"), ("seed", 18446744073709551615, "invalid_value"), ("seed", 1.0, "invalid_type"),
    ("seed", True, "invalid_type"), ("seed", "7", "invalid_type"),
    ("presence_penalty", 2.01, "invalid_value"), ("presence_penalty", -2.5, "invalid_value"),
    ("frequency_penalty", math.nan, "invalid_value"), ("frequency_penalty", "0", "invalid_type"),
    ("repetition_penalty", 0, "invalid_value"), ("repetition_penalty", 2.5, "invalid_value"),
    ("repetition_penalty", -1, "invalid_value"),
    ("logit_bias", {"5": 101}, "invalid_value"), ("logit_bias", {"5": math.nan}, "invalid_value"),
    ("logit_bias", {"-1": 1}, "invalid_type"), ("logit_bias", {"abc": 1}, "invalid_type"),
    ("logit_bias", {"1e3": 1}, "invalid_type"), ("logit_bias", {str(2**70): 1}, "invalid_type"),
    ("logit_bias", {"2147483648": 1}, "invalid_value"), ("logit_bias", {"5": True}, "invalid_type"),
    ("logit_bias", {"5": "1"}, "invalid_type"), ("logit_bias", {str(i): 1 for i in range(301)}, "invalid_value"),
    ("logit_bias", {"5": 1, "05": 2}, "invalid_value"), ("logit_bias", "5:1", "invalid_type"),
    ("logit_bias", [(1, 2, 3)], "invalid_type"), ("logit_bias", 7, "invalid_type"),
    ("min_tokens", -1, "invalid_value"), ("min_tokens", 2**31, "invalid_value"), ("min_tokens", 1.5, "invalid_type"),
    ("ignore_eos", 1, "invalid_type"), ("ignore_eos", "true", "invalid_type"), ("ignore_eos", None, "invalid_type"),
    ("logprobs", -1, "invalid_value"), ("logprobs", 21, "invalid_value"), ("logprobs", True, "invalid_type"),
    ("logprobs", 2.0, "invalid_type"),
    ("bad_words", [[1]] * 129, "invalid_type"), ("bad_words", "x", "invalid_type"),
    ("bad_words", None, "invalid_type"), ("bad_words", [[]], "invalid_value"),
    ("bad_words", [[1] * 33], "invalid_value"),
    ("bad_words", [5], "invalid_value"), ("bad_words", [[-1]], "invalid_value"), ("bad_words", [[1.0]], "invalid_type"),
    ("bad_words", [[True]], "invalid_type"),
    ("allowed_token_ids", [], "invalid_value"), ("allowed_token_ids", "5", "invalid_type"),
    ("allowed_token_ids", 5, "invalid_type"), ("allowed_token_ids", [-1], "invalid_value"),
    ("allowed_token_ids", [1.0], "invalid_type"), ("allowed_token_ids", [True], "invalid_type"),
    ("allowed_token_ids", [INT32_MAX + 1], "invalid_value"),
    ("prompt_logprobs", -1, "invalid_value"), ("prompt_logprobs", 21, "invalid_value"),
    ("prompt_logprobs", True, "invalid_type"), ("prompt_logprobs", 1.0, "invalid_type"),
]


@pytest.mark.parametrize("name, value, code", BAD)
def test_out_of_range_values_raise_a_request_error_naming_the_field(name, value, code):
    with pytest.raises(RequestError) as err:
        SamplingParams(**{name: value})
    assert err.value.param == name and err.value.code == code
    msg = str(err.value)
    assert name in msg and len(msg) < 200  # huge values are not spelt out


def test_every_field_has_good_and_bad_cases():
    assert {n for n, _ in GOOD} == set(FIELDS) == {n for n, _, _ in BAD}


def test_normalisation():
    assert SamplingParams(top_k=-1).top_k == 0  # vLLM's "off"
    assert SamplingParams(temperature=1e-5).temperature == 0.01  # raised as vLLM does
    assert SamplingParams(temperature=1).temperature == 1.0 and isinstance(SamplingParams(temperature=1).temperature,
                                                                            float)
    sp = SamplingParams(logit_bias={"9": 1, "3": -2.5})
    assert sp.logit_bias == ((3, -2.5), (9, 1.0))
    assert SamplingParams(logit_bias=[(9, 1), (3, -2.5)]) == sp
    assert SamplingParams().greedy and not SamplingParams(temperature=0.5).greedy
    assert SamplingParams(allowed_token_ids=[9, 3, 9]).allowed_token_ids == (3, 9)  # sorted, distinct


def test_replace_validates_again():
    sp = SamplingParams(temperature=0.5, seed=3)
    assert sp.replace(seed=4).seed == 4 and sp.replace(seed=4).temperature == 0.5
    with pytest.raises(RequestError):
        sp.replace(seed=-4)


def test_the_sampler_applies_every_field():
    assert SamplingParams(temperature=0.3, top_k=3, top_p=0.9, seed=1, logprobs=5, ignore_eos=True).unapplied() == ()
    sp = SamplingParams(presence_penalty=0.5, min_p=0.1, logit_bias={"1": 2}, min_tokens=3, repetition_penalty=1.5,
                        frequency_penalty=-0.5)
    assert sp.unapplied() == ()
    assert ENGINE_APPLIES | {"ignore_eos", "logprobs", "prompt_logprobs"} == set(FIELDS) and DEFAULTS["repetition_penalty"] == 1.0


def test_an_object_with_the_fields_is_coerced():
    from types import SimpleNamespace

    sp = SamplingParams.coerce(SimpleNamespace(temperature=0.8, top_k=40, top_p=0.9, seed=1234))
    assert sp == SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=1234)
    assert SamplingParams.coerce(sp) is sp
    with pytest.raises(RequestError):
        SamplingParams.coerce(object())


def test_request_make_uses_the_new_class_and_bounds_its_fields():
    from engine.request import Request

    r = Request.make([1, 2], max_tokens=4)
    assert type(r.sampling) is SamplingParams
    with pytest.raises(RequestError, match="max_tokens") as err:
        Request.make([1], max_tokens=2**31)
    assert err.value.param == "max_tokens"
    with pytest.raises(RequestError) as err:
        Request.make([1], stop_token_ids=list(range(1025)))
    assert err.value.param == "stop_token_ids"


def test_checkers():
    assert check_int("x", 5, 0, 5) == 5
    assert check_number("x", 1, 0, 1) == 1.0
    with pytest.raises(RequestError, match=r"\(0, 1\]"):
        check_number("x", 0, 0, 1, lo_open=True)


def test_modules_import_no_torch():
    """engine.sampling_params and engine.request load without torch (the package __init__ is bypassed: it pulls
    in the executor side)."""
    code = (
        "import sys, types\n"
        f"pkg = types.ModuleType('engine'); pkg.__path__ = [{str(REPO / 'engine')!r}]; sys.modules['engine'] = pkg\n"
        "import engine.sampling_params, engine.request\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'modeling', 'actors', 'ray')]\n"
        "assert not bad, bad\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
