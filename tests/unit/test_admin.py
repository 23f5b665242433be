"""`launch.admin`: loopback detection, token sources and their precedence, and the admin request checks."""
from __future__ import annotations

import pytest

from launch.admin import (TOKEN_ENV, AdminTokenError, check_admin_request, is_loopback, require_token_off_loopback,
                          resolve_admin_token)
from launch.protocol import ApiError


@pytest.mark.parametrize("host, loop", [
    ("127.0.0.1", True), ("127.8.9.10", True), ("::1", True), ("[::1]", True), ("localhost", True),
    ("LOCALHOST", True), ("0.0.0.0", False), ("::", False), ("", False), ("192.168.1.5", False),
    ("example.com", False), ("localhost.evil.example", False), ("127.0.0.1.nip.io", False), ("::ffff:10.0.0.1", False),
])
def test_is_loopback(host, loop):
    assert is_loopback(host) is loop


def test_token_sources_and_precedence(tmp_path):
    f = tmp_path / "token"
    f.write_text("  from-file \n")
    env = {TOKEN_ENV: "from-env"}
    assert resolve_admin_token(None, str(f), env) == "from-file"
    assert resolve_admin_token("from-flag", None, env) == "from-flag"
    assert resolve_admin_token(None, None, env) == "from-env"
    assert resolve_admin_token(None, None, {}) is None
    assert resolve_admin_token(None, None, {TOKEN_ENV: ""}) is None
    with pytest.raises(AdminTokenError, match="not both"):
        resolve_admin_token("a", str(f), {})
    with pytest.raises(AdminTokenError, match="cannot read"):
        resolve_admin_token(None, str(tmp_path / "missing"), {})
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(AdminTokenError, match="empty"):
        resolve_admin_token(None, str(tmp_path / "empty"), {})
    (tmp_path / "two").write_text("a\nb\n")
    with pytest.raises(AdminTokenError, match="several lines"):
        resolve_admin_token(None, str(tmp_path / "two"), {})


def test_off_loopback_needs_a_token():
    require_token_off_loopback("127.0.0.1", None)
    require_token_off_loopback("0.0.0.0", "t")
    with pytest.raises(AdminTokenError, match="--admin-token-file PATH"):
        require_token_off_loopback("0.0.0.0", None)


J = {"Content-Type": "application/json", "Host": "127.0.0.1:8000"}


@pytest.mark.parametrize("headers, token, status", [
    (J, None, None),
    ({**J, "Content-Type": "application/json; charset=utf-8"}, None, None),
    ({**J, "Origin": "http://127.0.0.1:8000"}, None, None),
    ({**J, "Origin": "http://127.0.0.1:8001"}, None, 403),
    ({**J, "Origin": "https://127.0.0.1:8000"}, None, 403),
    ({**J, "Origin": "null"}, None, 403),
    ({**J, "Content-Type": "text/plain"}, None, 415),
    ({"Host": "127.0.0.1:8000"}, None, 415),
    ({**J, "Host": "evil.example:8000"}, None, 403),
    ({**J, "Host": "evil.example:8000", "Authorization": "Bearer t"}, "t", None),
    ({**J, "Authorization": "Bearer t"}, "t", None),
    ({**J, "Authorization": "Bearer T"}, "t", 401),
    ({**J, "Authorization": "bearer t"}, "t", 401),
    ({**J, "Authorization": "Bearer t "}, "t", 401),
    (J, "t", 401),
    ({**J, "Authorization": "Bearer t", "Content-Type": "text/plain"}, "t", 415),
    ({**J, "Authorization": "Bearer t", "Origin": "http://evil.example"}, "t", 403),
])
def test_check_admin_request(headers, token, status):
    if status is None:
        check_admin_request("POST", headers, "http", token)
    else:
        with pytest.raises(ApiError) as err:
            check_admin_request("POST", headers, "http", token)
        assert err.value.status == status
