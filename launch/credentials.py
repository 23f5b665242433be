"""Secrets the server checks: the admin token (`launch.admin`) and the API key of the OpenAI endpoints.

Each comes from a file option (`--admin-token-file` / `--api-key-file`: the file's content, surrounding whitespace
dropped), else the value option (`--admin-token` / `--api-key`, visible in `ps`), else an environment variable
(`GRAPHLINE_ADMIN_TOKEN` / `GRAPHLINE_API_KEY`); resolved once on the driver before anything starts. Requests carry
it as `Authorization: Bearer SECRET`, compared in constant time (`hmac.compare_digest`).

With an API key, every request under `/v1/` (completions, chat completions, models) and to `/tokenize` and
`/detokenize` needs it: 401 otherwise, with OpenAI's error body (`code: invalid_api_key`), which the official
client raises as `AuthenticationError`.
`/health`, `/status`, `/metrics` and the dashboard stay open, as in vLLM; `/admin/*` has its own token.
"""
from __future__ import annotations

import hmac
from pathlib import Path
from typing import Callable, Mapping, Optional

from actors.environment import ADMIN_TOKEN_ENV, API_KEY_ENV, admin_token, api_key
from launch.protocol import ApiError


class CredentialError(ValueError):
    """The secret's options are contradictory or name an unusable secret."""


class Secret:
    """How one secret is configured: its name in messages, its two options and its environment variable."""

    def __init__(self, what: str, flag: str, env: str, from_environ: Callable[[], Optional[str]]):
        self.what, self.flag, self.env, self._from_environ = what, flag, env, from_environ

    def resolve(self, value: Optional[str], value_file: Optional[str],
                environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
        """The secret from `<flag>-file`, `<flag>` or the environment variable (in that order; giving both options
        is an error), or None when none is set (an empty variable counts as unset). Surrounding whitespace of a
        file is dropped; an empty secret or one of several lines is an error."""
        if value is not None and value_file is not None:
            raise CredentialError(f"give {self.flag} or {self.flag}-file, not both")
        if value_file is not None:
            try:
                value = Path(value_file).read_text(encoding="utf-8").strip()
            except (OSError, UnicodeDecodeError) as exc:
                raise CredentialError(f"cannot read {self.flag}-file {value_file}: {exc.__class__.__name__}") from None
            source = f"{self.flag}-file {value_file}"
        elif value is not None:
            source = self.flag
        else:
            value = (self._from_environ() if environ is None else environ.get(self.env)) or None
            source = self.env
        if value is not None and not value.strip():
            raise CredentialError(f"the {self.what} from {source} is empty")
        if value is not None and any(c in value for c in "\r\n"):
            raise CredentialError(f"the {self.what} from {source} spans several lines")
        return value


ADMIN_TOKEN = Secret("admin token", "--admin-token", ADMIN_TOKEN_ENV, admin_token)
API_KEY = Secret("API key", "--api-key", API_KEY_ENV, api_key)


KEYED_PATHS = ("/tokenize", "/detokenize")  # besides /v1/*


def bearer_matches(headers: Mapping[str, str], secret: str) -> bool:
    """Whether the request's `Authorization` header is exactly `Bearer <secret>` (constant-time comparison)."""
    auth = headers.get("Authorization", "")
    return hmac.compare_digest(auth.encode("utf-8", "surrogateescape"), f"Bearer {secret}".encode())


def check_api_key(path: str, method: str, headers: Mapping[str, str], key: Optional[str]) -> None:
    """Raise `ApiError` 401 (`invalid_api_key`) for a request under `/v1/` or to `/tokenize` / `/detokenize`
    without the API key, when one is set. OPTIONS requests pass (no credentials in a CORS preflight)."""
    if key is None or method == "OPTIONS" or not (path == "/v1" or path.startswith("/v1/") or path in KEYED_PATHS):
        return
    if not bearer_matches(headers, key):
        raise ApiError(401, "this server needs an API key: send 'Authorization: Bearer <API key>'", None,
                       "invalid_api_key")
