"""Cross-origin requests on a real `graphline serve --allowed-origins` (local executor, qwen3-tiny, an API key), from
pages of two other origins (each a small HTTP server on 127.0.0.1) in a real headless Chromium: the allowed origin's
`fetch` with the key and JSON (a preflighted request) reads completions, streamed and not, and the 401 of a wrong
key; the other origin's `fetch` is blocked, as is `/admin/reset` from any page. Raw requests check the headers.
Every request goes to 127.0.0.1."""
from __future__ import annotations

import asyncio
import http.server
import json
import threading

import aiohttp
import pytest

from cdp import CHROMIUM, browser_page
from e2e_support import TINY_ARGS, graphline, start_server

KEY = "sk-cors-" + "9d2e" * 4


class _Page(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - the stdlib's name
        body = b"<!doctype html><title>client</title><p>client page</p>"
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def pages():
    servers = [http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Page) for _ in range(2)]
    for s in servers:
        threading.Thread(target=s.serve_forever, daemon=True).start()
    yield [f"http://127.0.0.1:{s.server_address[1]}" for s in servers]
    for s in servers:
        s.shutdown()
        s.server_close()


@pytest.fixture(scope="module")
def srv(pages):
    s = start_server(graphline("serve", *TINY_ARGS, "--executor", "local", "--port", "0", "--api-key", KEY,
                               "--allowed-origins", pages[0]))
    yield s
    s.stop()


def test_cors_headers_on_raw_requests(srv, pages):
    allowed, other = pages
    ask = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}

    async def main():
        out = {}
        async with aiohttp.ClientSession() as s:
            async with s.options(srv.url + "/v1/completions", headers={"Origin": allowed, **ask}) as r:
                out["preflight"] = (r.status, dict(r.headers))
            async with s.options(srv.url + "/v1/completions", headers={"Origin": other, **ask}) as r:
                out["preflight other"] = (r.status, dict(r.headers), await r.json())
            body = {"prompt": [1, 2, 3], "max_tokens": 2}
            auth = {"Authorization": f"Bearer {KEY}"}
            async with s.post(srv.url + "/v1/completions", json=body, headers={"Origin": allowed, **auth}) as r:
                out["post"] = (r.status, dict(r.headers))
            async with s.post(srv.url + "/v1/completions", json=body, headers={"Origin": allowed}) as r:
                out["post 401"] = (r.status, dict(r.headers))
            async with s.post(srv.url + "/v1/completions", json=body, headers={"Origin": other, **auth}) as r:
                out["post other"] = (r.status, dict(r.headers))
            async with s.get(srv.url + "/status", headers={"Origin": allowed}) as r:
                out["status"] = (r.status, dict(r.headers))
        return out

    out = asyncio.run(asyncio.wait_for(main(), 120))
    status, h = out["preflight"]
    assert status == 204 and h["Access-Control-Allow-Origin"] == allowed and "POST" in h["Access-Control-Allow-Methods"]
    assert h["Access-Control-Allow-Headers"] == "authorization,content-type" and h["Vary"] == "Origin"
    status, h, body = out["preflight other"]
    assert status == 403 and body["error"]["code"] == "forbidden_origin" and "Access-Control-Allow-Origin" not in h
    for name in ("post", "post 401"):
        assert out[name][1]["Access-Control-Allow-Origin"] == allowed, name
    assert out["post"][0] == 200 and out["post 401"][0] == 401
    assert out["post other"][0] == 200 and "Access-Control-Allow-Origin" not in out["post other"][1]
    assert "Access-Control-Allow-Origin" not in out["status"][1]


FETCH = """(async () => {
  try {
    const r = await fetch(%(url)s, {method: "POST", headers: %(headers)s, body: JSON.stringify(%(body)s)});
    const text = await r.text();
    return JSON.stringify({status: r.status, text: text});
  } catch (e) { return JSON.stringify({error: String(e)}); }
})()"""


@pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium is not installed (Debian: apt-get install -y chromium)")
def test_a_browser_page_of_the_allowed_origin_reads_the_api(srv, pages):
    allowed, other = pages
    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}

    def fetch(path: str, headers: dict, body: dict) -> str:
        return FETCH % {"url": json.dumps(srv.url + path), "headers": json.dumps(headers), "body": json.dumps(body)}

    async def main():
        async with browser_page() as (_session, cdp):
            got = {}
            for origin in (allowed, other):
                await cdp.send("Page.navigate", {"url": origin + "/"})
                await cdp.until("document.readyState === 'complete' && document.title === 'client'")
                got[origin, "plain"] = await cdp.eval(fetch("/v1/completions", auth,
                                                            {"prompt": [1, 2, 3], "max_tokens": 3}))
                got[origin, "stream"] = await cdp.eval(fetch("/v1/completions", auth, {
                    "prompt": [1, 2, 3], "max_tokens": 3, "stream": True}))
                got[origin, "wrong key"] = await cdp.eval(fetch(
                    "/v1/completions", {**auth, "Authorization": "Bearer wrong"}, {"prompt": [1], "max_tokens": 1}))
                got[origin, "admin"] = await cdp.eval(fetch("/admin/reset", {"Content-Type": "application/json"},
                                                            {}))
        return {k: json.loads(v) for k, v in got.items()}

    got = asyncio.run(asyncio.wait_for(main(), 180))
    plain = got[allowed, "plain"]
    assert plain["status"] == 200 and len(json.loads(plain["text"])["choices"][0]["token_ids"]) == 3
    stream = got[allowed, "stream"]
    events = [ln[6:] for ln in stream["text"].splitlines() if ln.startswith("data: ")]
    assert stream["status"] == 200 and events[-1] == "[DONE]"
    assert sum(len(c["token_ids"]) for e in events[:-1] for c in json.loads(e)["choices"]) == 3
    wrong = got[allowed, "wrong key"]
    assert wrong["status"] == 401 and json.loads(wrong["text"])["error"]["code"] == "invalid_api_key"
    for what in ("plain", "stream", "wrong key", "admin"):  # the browser blocks what the server does not allow
        assert "Failed to fetch" in got[other, what].get("error", ""), (what, got[other, what])
    assert "Failed to fetch" in got[allowed, "admin"].get("error", ""), got[allowed, "admin"]
