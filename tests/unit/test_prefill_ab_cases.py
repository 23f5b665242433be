"""`bench.prefill_ab`'s case syntax: `T` is one sequence of T tokens, `SxT` S sequences of T tokens; anything else,
or a count below 1, stops the bench with a message naming the case."""
import pytest

from bench.prefill_ab import parse_case


def test_cases_parse():
    assert parse_case("512") == (1, 512)
    assert parse_case(" 8x256 ") == (8, 256)
    assert parse_case("1x4096") == (1, 4096)


@pytest.mark.parametrize("text", ["x256", "8x", "8y256", "0x512", "4x0", "-3"])
def test_bad_cases_name_the_case(text):
    with pytest.raises(SystemExit, match=repr(text.strip()).strip("'")):
        parse_case(text)
