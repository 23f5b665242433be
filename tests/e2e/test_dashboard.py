"""The operator dashboard rendered by headless Chromium against a live server: after its JavaScript has
polled /status, the DOM shows every rank and live counters; a screenshot is saved under artifacts/."""
from __future__ import annotations

import asyncio
import shutil
import subprocess
import tempfile
from html.parser import HTMLParser
from pathlib import Path

import aiohttp
import pytest

CHROMIUM = shutil.which("chromium") or ("/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium is not installed "
                                                         "(Debian: apt-get install -y chromium)")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--virtual-time-budget=5000"]


def chromium(url: str, *extra: str) -> str:
    with tempfile.TemporaryDirectory(prefix="gl-chromium-") as profile:
        out = subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={profile}", *extra, url], capture_output=True,
                             text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


class _Dom(HTMLParser):
    """Text per element id, and rank rows with the text of their classed cells."""

    def __init__(self) -> None:
        super().__init__()
        self.by_id: dict[str, str] = {}
        self.rows: list[dict[str, str]] = []
        self.body_attrs: dict[str, str] = {}
        self._open: list[tuple[str, str | None, str | None]] = []  # (tag, id, class)
        self._texts: dict[int, list[str]] = {}

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "body":
            self.body_attrs = {k: v or "" for k, v in a.items()}
        if tag == "tr" and "rank" in (a.get("class") or "").split():
            self.rows.append({"data-rank": a.get("data-rank", "")})
        if tag in ("meta", "link", "input", "br", "img"):
            return
        self._open.append((tag, a.get("id"), a.get("class")))
        self._texts[len(self._open)] = []

    def handle_endtag(self, tag):
        if not self._open or tag in ("meta", "link", "input", "br", "img"):
            return
        depth = len(self._open)
        _, ident, cls = self._open.pop()
        text = "".join(self._texts.pop(depth, [])).strip()
        if self._open:
            self._texts.setdefault(len(self._open), []).append(text + " ")
        if ident:
            self.by_id[ident] = text
        if cls and self.rows and tag in ("td", "span"):
            for c in cls.split():
                self.rows[-1].setdefault(c, text)

    def handle_data(self, data):
        if self._open:
            self._texts.setdefault(len(self._open), []).append(data)


def _traffic(url: str) -> None:
    async def main():
        async with aiohttp.ClientSession() as s:
            for _ in range(2):
                async with s.post(url + "/v1/completions", json={"prompt": [[5, 6, 7], [8, 9]], "max_tokens": 4,
                                                                  "temperature": 0}) as r:
                    assert r.status == 200
                async with s.post(url + "/v1/completions", json={"prompt": list(range(100, 140)), "max_tokens": 2,
                                                                  "temperature": 0}) as r:
                    assert r.status == 200  # the second time, its two full blocks come from the prefix cache

    asyncio.run(main())


def test_dashboard_shows_ranks_and_counters(server, artifacts):
    _traffic(server.url)
    dom = _Dom()
    dom.feed(chromium(server.url + "/dashboard", "--dump-dom"))
    nranks = 1 if server.kind == "local" else 2
    assert dom.body_attrs.get("data-loaded") == "1", "the dashboard script never rendered /status"
    assert dom.body_attrs.get("data-ranks") == str(nranks)
    assert sorted(r["data-rank"] for r in dom.rows) == [str(i) for i in range(nranks)]
    assert dom.by_id["health"] == "healthy"
    assert dom.by_id["model"] == "model qwen3-tiny"
    assert f"dp {nranks}" in dom.by_id["topology"]
    assert int(dom.by_id["steps-total"].replace(",", "")) > 0
    assert int(dom.by_id["generated"].replace(",", "")) > 0
    held, bound = (int(x.replace(",", "")) for x in dom.by_id["in-flight"].split(" / "))
    assert held >= 0 and bound >= 256  # --max-concurrent-requests' default
    for row in dom.rows:
        assert int(row["steps-eager"].replace(",", "")) > 0  # CPU: eager steps
        assert "no_cuda" in row["eager-reasons"]
        assert row["padding-waste"].endswith("%")
        assert row["lane-armed"] == "0 / off"  # CPU ranks: no decode graphs, so no lane, and they never arm
        assert "/" in row["capture-s"] and "B" in row["graph-memory"]
        assert row["up"] if "up" in row else True
    assert "rank 0 decode 8" in dom.by_id["capture-detail"]  # per-bucket capture times
    hit_rate = dom.by_id["prefix-hit-rate"]
    assert hit_rate.endswith("%") and float(hit_rate.rstrip(" %")) > 0
    cached, shared = (int(x.replace(",", "")) for x in dom.by_id["prefix-blocks"].split(" / "))
    assert cached >= 2 and shared >= 0 and "evictions" in dom.by_id["prefix-evictions"]
    assert "prompt tokens" in dom.by_id["prefix-tokens"] and dom.by_id["chunk-mode"]
    shot = artifacts / f"dashboard-{server.kind}.png"
    shot.unlink(missing_ok=True)
    chromium(server.url + "/dashboard", f"--screenshot={shot}", "--window-size=1280,900")
    assert shot.exists() and shot.stat().st_size > 10_000
    if server.kind == "dp2" or not (artifacts / "dashboard.png").exists():
        shutil.copy(shot, artifacts / "dashboard.png")


def test_dashboard_assets_are_local(server):
    async def main():
        async with aiohttp.ClientSession() as s:
            async with s.get(server.url + "/dashboard") as r:
                html = await r.text()
            async with s.get(server.url + "/static/dashboard.js") as r:
                js = (r.status, await r.text())
            async with s.get(server.url + "/") as r:
                root = (r.status, str(r.url))
        return html, js, root

    html, js, root = asyncio.run(main())
    assert "http://" not in html and "https://" not in html  # no CDN
    assert js[0] == 200 and "fetch(\"/status\"" in js[1]
    assert root[0] == 200 and root[1].endswith("/dashboard")
