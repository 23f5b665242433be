"""End-to-end helpers: `graphline serve` as a real subprocess on 127.0.0.1 (port chosen by the OS,
read from the start-up line), stopped by signalling its own process group."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / "artifacts"
# Small CPU deployment: qwen3-tiny, few buckets, a KV cache small enough that 32 concurrent clients preempt.
TINY_ARGS = ["--model", "qwen3-tiny", "--device", "cpu", "--max-model-len", "128", "--block-size", "16",
             "--num-kv-blocks", "16", "--max-decode-batch", "8", "--pcg-max-tokens", "32", "--pcg-token-stride", "32",
             "--max-num-seqs", "16", "--no-progress"]


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    log: list[str] = field(default_factory=list)
    startup_s: float = 0.0
    kind: str = ""

    def output(self) -> str:
        return "".join(self.log)

    def stop(self, timeout: float = 60.0) -> Optional[int]:
        """SIGTERM to the leader (it shuts down in order: server, ranks, Ray head), then to its process group
        (its own session: start_new_session), then SIGKILL."""
        t0 = time.monotonic()
        for sig, target, wait_s in ((signal.SIGTERM, "leader", timeout), (signal.SIGTERM, "group", 20),
                                    (signal.SIGKILL, "group", 10)):
            if self.proc.poll() is not None:
                break
            try:
                if target == "leader":
                    self.proc.send_signal(sig)
                else:
                    os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(wait_s)
            except subprocess.TimeoutExpired:
                self.log.append(f"[e2e] no exit {wait_s} s after {sig.name} to the {target}\n")
        self.log.append(f"[e2e] stopped in {time.monotonic() - t0:.1f} s, exit code {self.proc.returncode}\n")
        return self.proc.returncode


def start_server(cmd: list[str], timeout: float = 240.0, env: Optional[dict] = None) -> Server:
    inherited = {k: v for k, v in os.environ.items() if k != "GRAPHLINE_API_KEY"}  # only a test's own key
    env = {**inherited, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
           **(env or {})}
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    srv = Server(proc, "")
    found = threading.Event()

    def reader() -> None:
        for line in proc.stdout:
            srv.log.append(line)
            m = re.search(r"graphline: serving \S+ on (http://\S+)", line)
            if m and not found.is_set():
                srv.url = m.group(1)
                found.set()
        found.set()

    threading.Thread(target=reader, daemon=True).start()
    found.wait(timeout)
    srv.startup_s = time.monotonic() - t0
    if not srv.url:
        srv.stop(10)
        raise RuntimeError(f"graphline serve did not start within {timeout} s:\n{srv.output()[-5000:]}")
    return srv


def graphline(*args: str) -> list[str]:
    return [sys.executable, "-m", "launch", *args]


def serve_checkpoint(directory, *extra: str, max_model_len: int = 128, max_decode_batch: int = 4) -> Server:
    """`graphline serve` of a checkpoint directory on one CPU rank in the server process (no Ray), decode buckets up
    to `max_decode_batch`, no piecewise plans, any free port; `extra` options appended."""
    return start_server(graphline("serve", "--model", str(directory), "--executor", "local", "--device", "cpu",
                                  "--max-model-len", str(max_model_len), "--max-decode-batch", str(max_decode_batch),
                                  "--pcg-max-tokens", "0", "--no-progress", "--port", "0", *extra))


SECRET_VARIABLES = ("GRAPHLINE_ADMIN_TOKEN", "GRAPHLINE_API_KEY")


def clean_env(**extra: str) -> dict:
    """This process's environment without the server's secrets (a test sets its own), no Ray usage reporting, one
    OpenMP thread; `extra` on top."""
    env = {k: v for k, v in os.environ.items() if k not in SECRET_VARIABLES}
    return {**env, "RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": "1", **extra}


def loopback_url(url: str) -> str:
    """`http://HOST:PORT` of a server bound to any address -> `http://127.0.0.1:PORT` (tests talk to loopback only)."""
    return re.sub(r"^http://[^/]+:(\d+)$", r"http://127.0.0.1:\1", url)


def assert_serve_refuses(serve_args: list[str], extra: list[str], needle: str, empty_file) -> None:
    """`graphline serve *serve_args *extra` (an `EMPTY` in `extra`: the path `empty_file`, written blank) stops before
    serving: exit code 2 and one stderr line `graphline serve: error: ...` holding `needle`."""
    empty_file.write_text("  \n")
    args = [str(empty_file) if a == "EMPTY" else a for a in extra]
    out = subprocess.run(graphline("serve", *serve_args, *args), cwd=REPO, capture_output=True, text=True,
                         timeout=120, env=clean_env())
    assert out.returncode == 2, out.stdout + out.stderr
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("graphline serve: error: ") and needle in lines[0], out.stderr
    assert "serving" not in out.stdout


def http_json(url: str, method: str = "POST", body: Optional[dict] = None, timeout: float = 60) -> tuple[int, dict]:
    """One request to `url` (a loopback address) with a JSON `body`: (status, the JSON answer)."""
    import asyncio

    import aiohttp

    async def main():
        async with aiohttp.ClientSession() as s:
            async with s.request(method, url, json=body) as r:
                return r.status, await r.json()

    return asyncio.run(asyncio.wait_for(main(), timeout))


def metric_counts(url: str, family: str, label: str) -> dict[str, float]:
    """The server's `/metrics` samples of counter `family` (`..._total`) by the value of `label`."""
    import urllib.request

    text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    pattern = rf'^{re.escape(family)}_total\{{{re.escape(label)}="(\w+)"\}} (\S+)$'
    return {k: float(v) for k, v in re.findall(pattern, text, re.M)}


def openai_client(srv: Server):
    """The official `openai` client of `srv` (no retries: a failure shows as it is)."""
    import openai

    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
