"""`launch.cors`: `--allowed-origins` parsing, and which requests get which CORS headers."""
from __future__ import annotations

import pytest

from launch.cors import MAX_AGE_S, OriginsError, parse_origins, preflight, response_headers
from launch.protocol import ApiError

APP = "https://app.example.com"


def test_parse_origins():
    assert parse_origins(None) == parse_origins("") == parse_origins(" , ") == ()
    assert parse_origins("*") == parse_origins(" * ") == ("*",)
    assert parse_origins(f"{APP}, http://LOCALHOST:3000,{APP}") == (APP, "http://localhost:3000")
    assert parse_origins("http://127.0.0.1:8080,http://[::1]:5173") == ("http://127.0.0.1:8080", "http://[::1]:5173")
    for bad in ("app.example.com", "https://app.example.com/", "https://app.example.com/path", "ftp://x.org",
                "*,https://a.org", "https://a.org:0", "https://a.org:70000", "https://", "null", "https://a b.org"):
        with pytest.raises(OriginsError, match="--allowed-origins"):
            parse_origins(bad)


@pytest.mark.parametrize("path, origin, allowed, expected", [
    ("/v1/completions", APP, (APP,), APP),
    ("/v1/models", APP, ("*",), "*"),
    ("/tokenize", APP, (APP,), APP),
    ("/v1/completions", "https://evil.example", (APP,), None),
    ("/v1/completions", APP, (), None),
    ("/v1/completions", None, (APP,), None),
    ("/admin/reset", APP, ("*",), None),
    ("/status", APP, (APP,), None),
    ("/metrics", APP, ("*",), None),
])
def test_response_headers(path, origin, allowed, expected):
    got = response_headers(path, {"Origin": origin} if origin else {}, allowed)
    assert got == ({} if expected is None else {"Access-Control-Allow-Origin": expected, "Vary": "Origin"})


def test_preflight():
    ask = {"Origin": APP, "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization,content-type"}
    assert preflight("/v1/chat/completions", ask, (APP,)) == {
        "Access-Control-Allow-Origin": APP, "Vary": "Origin", "Access-Control-Allow-Methods": "GET, POST",
        "Access-Control-Max-Age": str(MAX_AGE_S), "Access-Control-Allow-Headers": "authorization,content-type"}
    star = preflight("/v1/models", {**ask, "Access-Control-Request-Headers": ""}, ("*",))
    assert star["Access-Control-Allow-Origin"] == "*" and "Access-Control-Allow-Headers" not in star
    assert preflight("/admin/reset", ask, ("*",)) is None  # the router's answer (405): never allowed
    assert preflight("/v1/completions", {"Origin": APP}, (APP,)) is None  # not a preflight
    for allowed in ((), ("https://other.example",)):
        with pytest.raises(ApiError) as err:
            preflight("/v1/completions", ask, allowed)
        assert err.value.status == 403 and err.value.body()["error"]["code"] == "forbidden_origin"
