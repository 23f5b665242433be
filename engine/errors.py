"""`RequestError`: the one exception a bad request raises anywhere in the engine (and in the sampling
parameters it carries). Its own module so `engine.request` and `engine.sampling_params` can both raise it
without importing each other."""
from __future__ import annotations

from typing import Optional


class RequestError(ValueError):
    """A request is malformed or can never be served (raised before it is scheduled).

    `param` names the offending field (OpenAI-style), `code` is a short machine-readable tag."""

    def __init__(self, message: str, param: Optional[str] = None, code: str = "invalid_request"):
        super().__init__(message)
        self.param = param
        self.code = code
