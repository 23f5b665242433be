"""A real headless Chromium driven over the Chrome DevTools Protocol (`--remote-debugging-port`, aiohttp's
websocket client), for the tests that need a browser: the dashboard, cross-origin requests. Debian: `apt-get
install -y chromium`; the tests skip without it."""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any, AsyncIterator, Optional

import aiohttp

CHROMIUM = shutil.which("chromium") or ("/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)


class DevTools:
    """A minimal Chrome DevTools Protocol client over one page target (flattened session)."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse):
        self.ws = ws
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}
        self.dialogs: list[dict] = []
        self.answers: list[tuple[bool, str]] = []  # what to do with the next dialogs, in order
        self.session: Optional[str] = None
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        async for msg in self.ws:
            doc = json.loads(msg.data)
            if "id" in doc and doc["id"] in self._pending:
                self._pending.pop(doc["id"]).set_result(doc)
            elif doc.get("method") == "Page.javascriptDialogOpening":
                self.dialogs.append(doc["params"])
                accept, text = self.answers.pop(0) if self.answers else (False, "")
                asyncio.create_task(self.send("Page.handleJavaScriptDialog", {"accept": accept, "promptText": text},
                                              wait=False))

    async def send(self, method: str, params: Optional[dict] = None, wait: bool = True, session: bool = True) -> Any:
        i = next(self._ids)
        msg: dict[str, Any] = {"id": i, "method": method, "params": params or {}}
        if session and self.session:
            msg["sessionId"] = self.session
        fut = asyncio.get_running_loop().create_future()
        self._pending[i] = fut
        await self.ws.send_str(json.dumps(msg))
        if not wait:
            return None
        doc = await asyncio.wait_for(fut, 30)
        assert "error" not in doc, doc
        return doc.get("result")

    async def open_page(self) -> None:
        """A new blank page target, attached (flattened session), with page and runtime events on."""
        target = (await self.send("Target.createTarget", {"url": "about:blank"}, session=False))["targetId"]
        self.session = (await self.send("Target.attachToTarget", {"targetId": target, "flatten": True},
                                        session=False))["sessionId"]
        await self.send("Page.enable")
        await self.send("Runtime.enable")

    async def eval(self, expr: str) -> Any:
        res = await self.send("Runtime.evaluate", {"expression": expr, "returnByValue": True, "awaitPromise": True})
        return res["result"].get("value")

    async def until(self, expr: str, timeout: float = 20.0) -> Any:
        for _ in range(int(timeout / 0.1)):
            v = await self.eval(expr)
            if v:
                return v
            await asyncio.sleep(0.1)
        raise AssertionError(f"timed out waiting for {expr}")

    async def click(self, element_id: str) -> None:
        """Click without waiting: the handler opens dialogs that block the page's script until answered."""
        await self.send("Runtime.evaluate", {"expression": f"document.getElementById({element_id!r}).click()"},
                        wait=False)


async def chromium() -> tuple[subprocess.Popen, str, str]:
    """A headless Chromium with its DevTools endpoint on 127.0.0.1: (process, websocket URL, profile dir to remove)."""
    profile = tempfile.mkdtemp(prefix="gl-cdp-")
    proc = subprocess.Popen([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                             "--no-first-run", "--disable-background-networking", "--disable-component-update",
                             "--disable-sync", "--disable-dev-shm-usage", "--remote-debugging-address=127.0.0.1",
                             "--remote-debugging-port=0", f"--user-data-dir={profile}", "about:blank"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    loop = asyncio.get_running_loop()
    for _ in range(200):
        line = await loop.run_in_executor(None, proc.stderr.readline)
        m = re.search(r"DevTools listening on (ws://\S+)", line)
        if m:
            return proc, m.group(1), profile
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise AssertionError("Chromium did not open its DevTools endpoint")


@contextlib.asynccontextmanager
async def browser_page() -> AsyncIterator[tuple[aiohttp.ClientSession, DevTools]]:
    """A fresh headless Chromium with one blank page attached: (an aiohttp session the test may use too, the page's
    `DevTools`). On exit the event reader stops, the browser is killed and its profile removed."""
    proc, ws_url, profile = await chromium()
    try:
        async with aiohttp.ClientSession() as s, s.ws_connect(ws_url, max_msg_size=0) as ws:
            cdp = DevTools(ws)
            await cdp.open_page()
            try:
                yield s, cdp
            finally:
                cdp._reader.cancel()
    finally:
        proc.kill()
        proc.wait(10)
        shutil.rmtree(profile, ignore_errors=True)
