"""Secure defaults for `/admin/*` on a real `graphline serve`: off loopback a token is required (the command refuses
to start without one), the token comes from a file or the environment, cross-site posts (foreign Origin, text/plain,
forms) never reset, and the dashboard's reset button works with the token in a real headless Chromium driven over
the Chrome DevTools Protocol (`--remote-debugging-port`, aiohttp's websocket client). The servers bind 0.0.0.0 where
the test needs it, but every request goes to 127.0.0.1."""
from __future__ import annotations

import asyncio

import aiohttp
import pytest

from cdp import CHROMIUM, browser_page
from e2e_support import TINY_ARGS, assert_serve_refuses, clean_env, graphline, loopback_url, start_server

TOKEN = "tok-" + "7f3a9c" * 4
LOCAL = [*TINY_ARGS, "--executor", "local", "--port", "0"]


@pytest.mark.parametrize("extra, needle", [
    (["--host", "0.0.0.0"], "--host 0.0.0.0 is not a loopback address and no admin token is configured"),
    (["--host", "::"], "not a loopback address"),
    (["--host", "192.0.2.7"], "--admin-token-file PATH"),
    (["--host", "0.0.0.0", "--admin-token-file", "/nonexistent/token"], "cannot read --admin-token-file"),
    (["--host", "0.0.0.0", "--admin-token", "a", "--admin-token-file", "/dev/null"], "not both"),
    (["--admin-token-file", "EMPTY"], "is empty"),
])
def test_serve_refuses_insecure_admin_configurations(tmp_path, extra, needle):
    assert_serve_refuses(LOCAL, extra, needle, tmp_path / "empty")


def test_a_token_from_the_environment_is_enough_offloopback_url():
    srv = start_server(graphline("serve", *LOCAL, "--host", "0.0.0.0"), env=clean_env(GRAPHLINE_ADMIN_TOKEN=TOKEN))
    try:
        url = loopback_url(srv.url)
        assert srv.url.startswith("http://0.0.0.0:") and url.startswith("http://127.0.0.1:")

        async def main():
            async with aiohttp.ClientSession() as s:
                async with s.post(url + "/admin/reset", json={}) as r:
                    without = r.status
                async with s.post(url + "/admin/reset", json={}, headers={"Authorization": f"Bearer {TOKEN}"}) as r:
                    return without, r.status

        assert asyncio.run(main()) == (401, 200)
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def token_server(tmp_path_factory):
    f = tmp_path_factory.mktemp("admin") / "token"
    f.write_text(TOKEN + "\n")
    f.chmod(0o600)
    srv = start_server(graphline("serve", *LOCAL, "--host", "0.0.0.0", "--admin-token-file", str(f)), env=clean_env())
    srv.url = loopback_url(srv.url)
    yield srv
    srv.stop()


async def _resets(s: aiohttp.ClientSession, url: str) -> int:
    async with s.get(url + "/status") as r:
        return (await r.json())["num_resets"]


def test_cross_site_posts_never_reset(token_server):
    url = token_server.url
    auth = {"Authorization": f"Bearer {TOKEN}"}

    async def main():
        async with aiohttp.ClientSession() as s:
            before = await _resets(s, url)
            statuses = {}
            for name, kw in {
                "text/plain with token": {"data": "{}", "headers": {**auth, "Content-Type": "text/plain"}},
                "form with token": {"data": {"recapture": "true"}, "headers": auth},
                "foreign origin": {"json": {}, "headers": {**auth, "Origin": "http://evil.example"}},
                "no token": {"json": {}},
                "wrong token": {"json": {}, "headers": {"Authorization": "Bearer wrong"}},
                "text/plain simple request": {"data": "{}", "headers": {"Content-Type": "text/plain",
                                                                        "Origin": "http://evil.example"}},
            }.items():
                async with s.post(url + "/admin/reset", **kw) as r:
                    statuses[name] = (r.status, (await r.json())["error"]["code"])
            mid = await _resets(s, url)
            async with s.post(url + "/admin/reset", json={}, headers={**auth, "Origin": url}) as r:
                ok = r.status
            after = await _resets(s, url)
        return before, statuses, mid, ok, after

    before, statuses, mid, ok, after = asyncio.run(main())
    assert statuses["text/plain with token"] == statuses["form with token"] == (415, "unsupported_media_type")
    assert statuses["foreign origin"] == (403, "forbidden_origin")
    assert statuses["text/plain simple request"][0] == 403
    assert statuses["no token"] == statuses["wrong token"] == (401, "unauthorized")
    assert mid == before and ok == 200 and after == before + 1


# ---- the dashboard in a real browser
@pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium is not installed (Debian: apt-get install -y chromium)")
def test_dashboard_reset_button_with_the_token_in_chromium(token_server):
    url = token_server.url

    async def main():
        async with browser_page() as (s, cdp):
            await cdp.send("Page.navigate", {"url": url + "/dashboard"})
            await cdp.until("document.body && document.body.dataset.loaded === '1'")
            start = await _resets(s, url)
            msg = "document.getElementById('reset-msg').textContent"

            async def press(answers, done):
                """Clear the message, click reset with these dialog answers, wait until `done` (JS on the message):
                (the message, the dialogs' kinds, the stored token, the server's reset count)."""
                cdp.dialogs.clear()
                cdp.answers = answers
                await cdp.eval("document.getElementById('reset-msg').textContent = ''")
                await cdp.click("reset-btn")
                text = await cdp.until(f"{msg}.{done} && {msg}")
                kinds = [d["type"] for d in cdp.dialogs]
                return text, kinds, await cdp.eval("sessionStorage.getItem('graphline.adminToken')"), \
                    await _resets(s, url)

            # 1. a wrong token: the page asks once, gets 401, asks again (cancelled) and says so
            first, kinds1, stored1, after1 = await press([(True, ""), (True, "wrong-token"), (False, "")],
                                                         "includes('401')")
            # 2. the right token: reset done, the token kept in sessionStorage
            second, kinds2, stored2, after2 = await press([(True, ""), (True, TOKEN)], "startsWith('reset done')")
            # 3. again: only the confirmation, no token prompt (the stored token is sent)
            _, kinds3, _, after3 = await press([(True, "")], "startsWith('reset done')")
            await cdp.until(f"document.getElementById('resets-count').textContent === '{after3}'")
        return start, first, kinds1, stored1, after1, second, kinds2, stored2, after2, kinds3, after3

    start, first, kinds1, stored1, after1, second, kinds2, stored2, after2, kinds3, after3 = \
        asyncio.run(asyncio.wait_for(main(), 180))
    assert kinds1 == ["confirm", "prompt", "prompt"] and "401" in first and "token" in first
    assert stored1 is None and after1 == start
    assert kinds2 == ["confirm", "prompt"] and stored2 == TOKEN and after2 == start + 1
    assert kinds3 == ["confirm"] and after3 == start + 2
