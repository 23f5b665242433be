"""`launch.credentials`: where the API key comes from (and the admin token, through the same `Secret`), and which
requests need it."""
from __future__ import annotations

import pytest

from launch.credentials import API_KEY, CredentialError, bearer_matches, check_api_key
from launch.protocol import ApiError

KEY = "sk-local-" + "ab12" * 6


def test_api_key_sources_and_precedence(tmp_path):
    f = tmp_path / "key"
    f.write_text(f"\n  {KEY}  \n")
    env = {"GRAPHLINE_API_KEY": "from-env"}
    assert API_KEY.resolve(None, str(f), env) == KEY
    assert API_KEY.resolve("from-flag", None, env) == "from-flag"
    assert API_KEY.resolve(None, None, env) == "from-env"
    assert API_KEY.resolve(None, None, {}) is None
    assert API_KEY.resolve(None, None, {"GRAPHLINE_API_KEY": ""}) is None
    assert API_KEY.resolve(None, None, {"GRAPHLINE_ADMIN_TOKEN": "t"}) is None  # the admin token is not the key
    with pytest.raises(CredentialError, match="give --api-key or --api-key-file, not both"):
        API_KEY.resolve("a", str(f), {})
    with pytest.raises(CredentialError, match="cannot read --api-key-file"):
        API_KEY.resolve(None, str(tmp_path / "missing"), {})
    (tmp_path / "empty").write_text(" \n")
    with pytest.raises(CredentialError, match="the API key from --api-key-file .* is empty"):
        API_KEY.resolve(None, str(tmp_path / "empty"), {})
    with pytest.raises(CredentialError, match="the API key from --api-key is empty"):
        API_KEY.resolve("  ", None, {})
    with pytest.raises(CredentialError, match="several lines"):
        API_KEY.resolve(None, None, {"GRAPHLINE_API_KEY": "a\nb"})


@pytest.mark.parametrize("auth, ok", [
    (f"Bearer {KEY}", True), (f"bearer {KEY}", False), (f"Bearer {KEY} ", False), (KEY, False),
    (f"Bearer {KEY[:-1]}", False), ("", False), ("Bearer ", False), (f"Bearer {KEY}\u00e9", False),
])
def test_bearer_matches_only_the_exact_header(auth, ok):
    assert bearer_matches({"Authorization": auth} if auth else {}, KEY) is ok


@pytest.mark.parametrize("path, method, needs", [
    ("/v1/completions", "POST", True), ("/v1/chat/completions", "POST", True), ("/v1/models", "GET", True),
    ("/v1/models/tiny", "GET", True), ("/v1/unknown", "GET", True), ("/v1", "GET", True),
    ("/tokenize", "POST", True), ("/detokenize", "POST", True), ("/tokenizer", "POST", False),
    ("/v1/completions", "OPTIONS", False), ("/health", "GET", False), ("/health/live", "GET", False),
    ("/metrics", "GET", False), ("/status", "GET", False), ("/dashboard", "GET", False), ("/", "GET", False),
    ("/admin/reset", "POST", False), ("/v10/completions", "POST", False), ("/static/app.js", "GET", False),
])
def test_which_requests_need_the_key(path, method, needs):
    check_api_key(path, method, {"Authorization": f"Bearer {KEY}"}, KEY)  # the key always passes
    check_api_key(path, method, {}, None)  # no key configured: nothing is checked
    if not needs:
        check_api_key(path, method, {}, KEY)
        return
    with pytest.raises(ApiError) as err:
        check_api_key(path, method, {"Authorization": "Bearer wrong"}, KEY)
    assert err.value.status == 401
    body = err.value.body()["error"]
    assert body["code"] == "invalid_api_key" and body["type"] == "invalid_request_error"
    assert "Authorization: Bearer" in body["message"] and KEY not in body["message"]
