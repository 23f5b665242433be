"""SIGTERM drains a real `graphline serve` (local executor, qwen3-tiny, 127.0.0.1): requests in flight when the signal
arrives finish (every token, then `[DONE]`), a new connection is refused once the listener closed, and the process
exits 0, as a rolling update needs."""
from __future__ import annotations

import json
import signal
import threading
import time
import urllib.request

from e2e_support import TINY_ARGS, graphline, start_server

MAX_TOKENS = 400


def _stream(url: str, out: dict, key: int, started: threading.Event) -> None:
    body = json.dumps({"prompt": [1, 2, 3 + key], "max_tokens": MAX_TOKENS, "stream": True, "temperature": 0,
                       "ignore_eos": True}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    events = []
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            for line in r:
                if line.startswith(b"data: "):
                    events.append(line[6:].strip())
                    started.set()
    except Exception as exc:  # noqa: BLE001 - reported by the assertions
        out[key, "error"] = repr(exc)
    finally:
        started.set()
        out[key] = events


def test_sigterm_lets_the_requests_in_flight_finish():
    srv = start_server(graphline("serve", *TINY_ARGS, "--executor", "local", "--port", "0", "--max-model-len", "512",
                                 "--num-kv-blocks", "80"))
    out: dict = {}
    started = [threading.Event(), threading.Event()]
    threads = [threading.Thread(target=_stream, args=(srv.url, out, i, started[i])) for i in range(2)]
    try:
        for t in threads:
            t.start()
        for e in started:
            assert e.wait(60)
        srv.proc.send_signal(signal.SIGTERM)
        for _ in range(1000):  # printed when the signal is taken, before the listener closes
            if "graphline: shutting down" in srv.output():
                break
            time.sleep(0.01)
        in_flight = sum(t.is_alive() for t in threads)
        refused = None
        for _ in range(200):  # the listener closes first; a new connection is refused, reset or never answered
            try:
                urllib.request.urlopen(srv.url + "/health/live", timeout=2).close()
            except OSError as exc:
                refused = exc
                break
            time.sleep(0.01)
        for t in threads:
            t.join(120)
        code = srv.proc.wait(60)
    finally:
        srv.stop()
    assert refused is not None, "the server still accepted connections after SIGTERM"
    assert in_flight > 0, "the streams ended before the server took the signal: nothing was drained"
    for i in range(2):
        events = out[i]
        assert (i, "error") not in out and events[-1] == b"[DONE]", (out.get((i, "error")), events[-2:])
        tokens = [t for e in events[:-1] for c in json.loads(e)["choices"] for t in c["token_ids"]]
        assert len(tokens) == MAX_TOKENS
    assert code == 0 and "graphline: shutting down" in srv.output()
