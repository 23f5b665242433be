"""`/admin/*` protection and the admin token.

A state-changing admin request (`POST /admin/*`) must
- carry `Content-Type: application/json` (415 otherwise: an HTML form or a `text/plain` cross-site
  POST, which browsers send without a CORS preflight, never reaches the handler);
- come from no `Origin` or the server's own origin (403 otherwise);
- when no admin token is configured (loopback-only serving), name a loopback host in `Host` (403
  otherwise: a DNS-rebound page cannot reach it under its own name);
- when a token is configured, send `Authorization: Bearer TOKEN` (401 otherwise; compared with
  `hmac.compare_digest`).

`graphline serve` refuses a non-loopback `--host` without a token (`require_token_off_loopback`);
the token comes from `--admin-token-file PATH`, `GRAPHLINE_ADMIN_TOKEN` or `--admin-token` (the
last is visible in `ps`).
"""
from __future__ import annotations

import hmac
import ipaddress
from typing import Mapping, Optional

from actors.environment import ADMIN_TOKEN_ENV as TOKEN_ENV
from launch.credentials import ADMIN_TOKEN, CredentialError, bearer_matches
from launch.protocol import ApiError
_LOOPBACK_NAMES = ("localhost", "localhost.", "ip6-localhost")


AdminTokenError = CredentialError  # the admin token's options are contradictory or name an unusable token


def is_loopback(host: str) -> bool:
    """Whether `host` (an address or name, without port) only reaches this machine."""
    h = host.strip().strip("[]").lower()
    if h in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(h.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


def _host_of(host_header: str) -> str:
    """The host part of a Host header value (`name`, `name:port`, `[v6]:port`)."""
    h = host_header.strip()
    if h.startswith("["):
        return h[1:h.find("]")] if "]" in h else h
    return h.rsplit(":", 1)[0] if h.count(":") == 1 else h


def resolve_admin_token(token: Optional[str], token_file: Optional[str],
                        environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The admin token from `--admin-token-file`, `--admin-token` or `GRAPHLINE_ADMIN_TOKEN` (`Secret.resolve`)."""
    return ADMIN_TOKEN.resolve(token, token_file, environ)


def require_token_off_loopback(host: str, token: Optional[str]) -> None:
    """Raise `AdminTokenError` when serving beyond this machine without an admin token."""
    if token is None and not is_loopback(host):
        raise AdminTokenError(
            f"--host {host} is not a loopback address and no admin token is configured: pass --admin-token-file "
            f"PATH (or set {TOKEN_ENV}) so that /admin/* is protected, or serve on --host 127.0.0.1")


def check_admin_request(method: str, headers: Mapping[str, str], scheme: str, token: Optional[str]) -> None:
    """Raise `ApiError` (401 / 403 / 415) unless this admin request may proceed."""
    host_header = headers.get("Host", "")
    if method not in ("GET", "HEAD", "OPTIONS"):
        origin = headers.get("Origin")
        if origin is not None and not hmac.compare_digest(origin.lower().encode(),
                                                          f"{scheme}://{host_header}".lower().encode()):
            raise ApiError(403, "cross-origin admin requests are refused", None, "forbidden_origin")
        mime = headers.get("Content-Type", "").split(";", 1)[0].strip().lower()
        if mime != "application/json":
            raise ApiError(415, "admin requests must be sent with 'Content-Type: application/json'", None,
                           "unsupported_media_type")
    if token is None:
        if not is_loopback(_host_of(host_header)):
            raise ApiError(403, "without an admin token, admin requests are only accepted under a loopback host "
                                "name", None, "forbidden_host")
        return
    if not bearer_matches(headers, token):
        raise ApiError(401, "admin endpoints need 'Authorization: Bearer <admin token>'", None, "unauthorized")
