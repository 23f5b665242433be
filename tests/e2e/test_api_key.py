"""The API key on a real `graphline serve` (local executor, qwen3-tiny, on 0.0.0.0 with an admin token; every request
goes to 127.0.0.1): the official `openai` client works with the key and raises `AuthenticationError` without it or
with another; `/health`, `/metrics` and `/status` stay open; `graphline bench --api-key` measures it; bad key
options stop the command before anything starts; off loopback without a key the server warns."""
from __future__ import annotations

import asyncio
import json
import re
import subprocess

import aiohttp
import pytest

from e2e_support import REPO, TINY_ARGS, assert_serve_refuses, clean_env, graphline, loopback_url, start_server

openai = pytest.importorskip("openai")

KEY = "sk-test-" + "5e1f" * 6
ADMIN = "adm-" + "77c1" * 6
LOCAL = [*TINY_ARGS, "--executor", "local", "--port", "0"]
PROMPT = [17, 4, 250, 31, 8]


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory):
    d = tmp_path_factory.mktemp("keys")
    (d / "key").write_text(KEY + "\n")
    (d / "admin").write_text(ADMIN + "\n")
    srv = start_server(graphline("serve", *LOCAL, "--host", "0.0.0.0", "--api-key-file", str(d / "key"),
                                 "--admin-token-file", str(d / "admin")), env=clean_env())
    srv.url = loopback_url(srv.url)
    yield srv
    srv.stop()


def _client(url: str, key: str) -> "openai.OpenAI":
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)


def test_the_openai_client_needs_the_key(keyed_server):
    url = keyed_server.url
    r = _client(url, KEY).completions.create(model="qwen3-tiny", prompt=PROMPT, max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason == "length" and len(r.choices[0].model_extra["token_ids"]) == 4
    assert [m.id for m in _client(url, KEY).models.list()] == ["qwen3-tiny"]
    for key in ("wrong", KEY + "x", KEY.upper()):
        with pytest.raises(openai.AuthenticationError) as err:
            _client(url, key).completions.create(model="qwen3-tiny", prompt=PROMPT, max_tokens=4)
        assert err.value.status_code == 401 and err.value.code == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            _client(url, key).models.list()
    assert "warning" not in keyed_server.output()  # a key is configured: no warning off loopback


def test_without_the_key_only_v1_is_closed(keyed_server):
    url = keyed_server.url

    async def main():
        out = {}
        async with aiohttp.ClientSession() as s:
            for name, method, path, kw in [
                ("completions", "post", "/v1/completions", {"json": {"prompt": PROMPT, "max_tokens": 2}}),
                ("chat", "post", "/v1/chat/completions", {"json": {"messages": [{"role": "user", "content": "x"}]}}),
                ("models", "get", "/v1/models", {}), ("model", "get", "/v1/models/qwen3-tiny", {}),
                ("health", "get", "/health", {}), ("metrics", "get", "/metrics", {}), ("status", "get", "/status", {}),
            ]:
                async with getattr(s, method)(url + path, **kw) as r:
                    text = await r.text()
                    out[name] = (r.status, json.loads(text) if name == "status" or r.status == 401 else text)
        return out

    out = asyncio.run(asyncio.wait_for(main(), 120))
    for name in ("completions", "chat", "models", "model"):
        status, body = out[name]
        assert status == 401 and body["error"]["code"] == "invalid_api_key", (name, out[name])
    assert out["health"][0] == 200 and out["metrics"][0] == 200
    assert re.search(r'graphline_http_requests_total\{endpoint="/v1/completions",status="401"\} [1-9]',
                     out["metrics"][1])  # the refusals are counted
    status = out["status"][1]
    assert out["status"][0] == 200 and status["api_auth"] is True and status["admin_auth"] is True
    assert KEY not in json.dumps(status)


def test_bench_with_the_key(keyed_server, tmp_path):
    base = ["bench", "--url", keyed_server.url, "--concurrency", "1", "--requests-per-client", "2",
            "--prompt-len", "8", "--max-tokens", "4"]
    ok = subprocess.run(graphline(*base, "--api-key", KEY, "--out", str(tmp_path / "ok.json")), cwd=REPO,
                        capture_output=True, text=True, timeout=180, env=clean_env())
    assert ok.returncode == 0, ok.stdout + ok.stderr
    result = json.loads((tmp_path / "ok.json").read_text())
    assert result["levels"][0]["requests"] == 2 and result["levels"][0]["output_tokens"] == 8
    assert KEY not in (tmp_path / "ok.json").read_text()  # the key is not written into the results
    from_env = subprocess.run(graphline(*base, "--out", str(tmp_path / "env.json")), cwd=REPO, capture_output=True,
                              text=True, timeout=180, env=clean_env(GRAPHLINE_API_KEY=KEY))
    assert from_env.returncode == 0, from_env.stdout + from_env.stderr
    bad = subprocess.run(graphline(*base, "--out", str(tmp_path / "bad.json")), cwd=REPO, capture_output=True,
                         text=True, timeout=180, env=clean_env())
    assert bad.returncode == 2 and "HTTP 401" in bad.stderr and "--api-key" in bad.stderr, bad.stderr


@pytest.mark.parametrize("extra, needle", [
    (["--api-key", "a", "--api-key-file", "/dev/null"], "give --api-key or --api-key-file, not both"),
    (["--api-key-file", "/nonexistent/key"], "cannot read --api-key-file /nonexistent/key"),
    (["--api-key-file", "EMPTY"], "the API key from --api-key-file"),
])
def test_serve_refuses_bad_key_options(tmp_path, extra, needle):
    assert_serve_refuses(LOCAL, extra, needle, tmp_path / "empty")


def test_off_loopback_without_a_key_warns(tmp_path):
    srv = start_server(graphline("serve", *LOCAL, "--host", "0.0.0.0"), env=clean_env(GRAPHLINE_ADMIN_TOKEN=ADMIN))
    try:
        url = loopback_url(srv.url)
        r = _client(url, "anything").completions.create(model="qwen3-tiny", prompt=PROMPT, max_tokens=2)
        assert len(r.choices[0].model_extra["token_ids"]) == 2  # no key configured: open
    finally:
        srv.stop()
    warn = [ln for ln in srv.output().splitlines() if "warning" in ln]
    assert len(warn) == 1 and "--host 0.0.0.0 is not a loopback address and no API key is configured" in warn[0]
