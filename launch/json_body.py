"""The HTTP request's JSON document, read before any field is parsed (`launch.protocol`): size, UTF-8, JSON syntax,
nesting depth, finite numbers and the declared content type; every problem is an `ApiError` (400, 413 or 415)."""
from __future__ import annotations

import json
import math
from typing import Any

from launch.protocol import ApiError, ProtocolLimits

_JSON_TYPES = ("application/json",)


def parse_json_body(raw: bytes, content_type: str, limits: ProtocolLimits) -> Any:
    """The request's JSON document. Empty, oversized, non-UTF-8, malformed, too deeply nested, non-JSON
    numbers (NaN, Infinity) -> 400; a body that is JSON but not declared as such -> 415."""
    if not raw:
        raise ApiError(400, "the request body is empty; send a JSON object", None, "invalid_json")
    if len(raw) > limits.max_body_bytes:
        raise ApiError(413, f"the request body exceeds {limits.max_body_bytes} bytes", None, "body_too_large")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ApiError(400, "the request body is not valid UTF-8", None, "invalid_json") from None
    try:
        doc = json.loads(text, parse_constant=_no_constant, parse_float=_finite_float)
    except RecursionError:
        raise ApiError(400, f"the JSON document is nested deeper than {limits.max_json_depth} levels", None,
                       "invalid_json") from None
    except ValueError as exc:
        raise ApiError(400, f"malformed JSON: {_json_error(exc)}", None, "invalid_json") from None
    if raw.count(b"[") + raw.count(b"{") > limits.max_json_depth:  # fewer openers cannot nest deeper
        _check_depth(doc, limits.max_json_depth)
    mime = content_type.split(";", 1)[0].strip().lower()
    if mime not in _JSON_TYPES and not mime.endswith("+json"):
        raise ApiError(415, "send the request body with 'Content-Type: application/json'", None,
                       "unsupported_media_type")
    return doc


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _finite_float(s: str) -> float:
    f = float(s)
    if math.isinf(f):  # 1e400: Python's json would read it as infinity
        raise ValueError("a number is too large for a double")
    return f


def _json_error(exc: ValueError) -> str:
    if isinstance(exc, json.JSONDecodeError):
        return f"{exc.msg} at line {exc.lineno} column {exc.colno}"
    return str(exc).split("\n", 1)[0][:200]  # e.g. an integer of more than 4300 digits


def _check_depth(doc: Any, max_depth: int) -> None:
    stack = [(doc, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        if depth > max_depth:
            raise ApiError(400, f"the JSON document is nested deeper than {max_depth} levels", None, "invalid_json")
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
