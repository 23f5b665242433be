"""Cross-origin requests to the API (`graphline serve --allowed-origins`): off by default, so a web page of another
origin cannot read the API's answers (the browser's same-origin rule).

`--allowed-origins ORIGIN[,ORIGIN...]` (each `scheme://host[:port]`, as a browser sends it in `Origin`) or `*` lets
pages of those origins call the API: the OpenAI endpoints under `/v1/`, `/tokenize` and `/detokenize`.
- a preflight (`OPTIONS` with `Access-Control-Request-Method`) from an allowed origin is answered 204 with the
  methods (GET, POST), the headers it asked for (e.g. `Authorization`, `Content-Type`) and a 10-minute max age;
  from another origin 403 (`forbidden_origin`);
- every API response to an allowed origin (errors and server-sent event streams included) carries
  `Access-Control-Allow-Origin` (the origin itself, or `*` under `*`) and `Vary: Origin`.
No credentials mode (cookies are never used; the API key is a header), and never for `/admin/*`, which refuses
cross-origin requests itself (`launch.admin`), or the operator endpoints.
"""
from __future__ import annotations

import re
from typing import Mapping, Optional

from launch.credentials import KEYED_PATHS
from launch.protocol import ApiError

_ORIGIN = re.compile(r"(https?)://([A-Za-z0-9.-]+|\[[0-9A-Fa-f:.]+\])(:[0-9]{1,5})?")
MAX_AGE_S = 600


class OriginsError(ValueError):
    """`--allowed-origins` is not a list of origins."""


def parse_origins(text: Optional[str]) -> tuple[str, ...]:
    """`--allowed-origins`: "" / None -> () (no cross-origin access), "*" -> ("*",), else the comma-separated origins
    (scheme and host lower-cased, as browsers send them)."""
    if text is None or not text.strip():
        return ()
    items = [t.strip() for t in text.split(",") if t.strip()]
    if items == ["*"]:
        return ("*",)
    out = []
    for item in items:
        m = _ORIGIN.fullmatch(item)
        if item == "*" or m is None or (m.group(3) and not 0 < int(m.group(3)[1:]) < 65536):
            raise OriginsError(f"--allowed-origins: {item!r} is not an origin like https://app.example.com or "
                               f"http://localhost:3000 ('*' alone allows every origin)")
        out.append(f"{m.group(1).lower()}://{m.group(2).lower()}{m.group(3) or ''}")
    return tuple(dict.fromkeys(out))


def in_scope(path: str) -> bool:
    """Whether `path` is an API endpoint cross-origin requests may reach."""
    return path == "/v1" or path.startswith("/v1/") or path in KEYED_PATHS


def allow_origin(origin: Optional[str], allowed: tuple[str, ...]) -> Optional[str]:
    """The `Access-Control-Allow-Origin` value for a request from `origin`, or None when it is not allowed."""
    if origin is None or not allowed:
        return None
    if allowed == ("*",):
        return "*"
    return origin if origin in allowed else None


def response_headers(path: str, headers: Mapping[str, str], allowed: tuple[str, ...]) -> dict[str, str]:
    """CORS headers for an API response to a request with these headers (none out of scope or origin)."""
    value = allow_origin(headers.get("Origin"), allowed) if in_scope(path) else None
    return {} if value is None else {"Access-Control-Allow-Origin": value, "Vary": "Origin"}


def preflight(path: str, headers: Mapping[str, str], allowed: tuple[str, ...]) -> Optional[dict[str, str]]:
    """For a CORS preflight to an API path: the 204's headers; `ApiError` 403 from an origin not allowed; None for
    any other OPTIONS request (the router answers it)."""
    if not in_scope(path) or "Access-Control-Request-Method" not in headers or "Origin" not in headers:
        return None
    value = allow_origin(headers["Origin"], allowed)
    if value is None:
        raise ApiError(403, "cross-origin requests from this origin are not allowed (see --allowed-origins)", None,
                       "forbidden_origin")
    out = {"Access-Control-Allow-Origin": value, "Vary": "Origin", "Access-Control-Allow-Methods": "GET, POST",
           "Access-Control-Max-Age": str(MAX_AGE_S)}
    asked = headers.get("Access-Control-Request-Headers")
    if asked:
        out["Access-Control-Allow-Headers"] = asked
    return out
