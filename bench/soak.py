"""Soak: 32 streaming clients against a live `graphline serve` while ranks are killed, the deployment is reset
and bad requests arrive, for a fixed time. Reports what users would see.

    python -m bench.soak --duration-s 180                                   # CPU: qwen3-tiny, DP=2 Ray ranks
    python -m bench.soak --model qwen3-0.6b --device cuda --dp 1 --duration-s 300 --max-tokens 256

Every `--kill-every-s` seconds a random rank process gets SIGKILL; every `--reset-every-s` seconds
`POST /admin/reset`; `--bad-per-s` malformed requests a second (each must get a 4xx). Reported:
- lost requests: well-formed requests that did not complete with every token (goal: 0);
- stall per failure: for each kill, the longest wait between consecutive events of any stream over the kill's
  window (until the next kill), so a failure noticed late is counted too (p50 / p99 / max over the kills);
- bad requests answered 4xx / otherwise;
- resident memory (RSS) of the server process and of its rank processes at the start and at the end.
Only 127.0.0.1 is contacted. Writes JSON (`--out`).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import numpy as np

from launch.bench import one_request


def rss_mb(pid: int) -> Optional[float]:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "launch", "serve", "--model", args.model, "--device", args.device, "--dp",
           str(args.dp), "--tp", str(args.tp), "--max-model-len", str(args.max_model_len), "--step-timeout-s",
           str(args.step_timeout_s), "--host", "127.0.0.1", "--port", "0", "--no-progress", *args.server_arg]
    proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.perf_counter() + args.startup_timeout_s
    for line in proc.stdout:
        sys.stderr.write("  [server] " + line)
        m = re.search(r"serving .* on (http://\S+)", line)
        if m:
            import threading

            threading.Thread(target=lambda: [sys.stderr.write("  [server] " + ln) for ln in proc.stdout],
                             daemon=True).start()
            return proc, m.group(1)
        if time.perf_counter() > deadline:
            break
    proc.kill()
    raise RuntimeError(f"the server did not start (exit code {proc.poll()})")


class Soak:
    def __init__(self, args: argparse.Namespace, url: str, vocab: int):
        self.args, self.url, self.vocab = args, url, vocab
        self.rng = random.Random(args.seed)
        self.stop_at = time.perf_counter() + args.duration_s
        self.done = self.lost = 0
        self.errors: list[str] = []
        self.kills: list[float] = []  # perf_counter times
        self.token_times: list[list[float]] = []  # per finished or lost stream: arrival times of its chunks
        self.resets = self.reset_failures = 0
        self.bad_4xx = self.bad_other = 0

    async def client(self, s, i: int) -> None:
        rng = np.random.default_rng(self.args.seed + i)
        sampling = {"ignore_eos": True, "temperature": 0.0 if i % 2 == 0 else 1.0, "seed": i}
        while time.perf_counter() < self.stop_at:
            prompt = rng.integers(1, self.vocab, int(rng.integers(4, self.args.prompt_len))).tolist()
            try:
                out = await one_request(s, self.url, None, prompt, self.args.max_tokens, sampling)
                if out["tokens"] != self.args.max_tokens:
                    raise RuntimeError(f"{out['tokens']} of {self.args.max_tokens} tokens")
                self.done += 1
                self.token_times.append(out["arrivals"])
            except Exception as exc:  # noqa: BLE001 - counted and reported
                self.lost += 1
                self.errors.append(f"{type(exc).__name__}: {exc}"[:300])

    async def killer(self, s) -> None:
        while time.perf_counter() + self.args.kill_every_s < self.stop_at:
            await asyncio.sleep(self.args.kill_every_s)
            async with s.get(self.url + "/status") as r:
                ranks = [rk for rk in (await r.json())["ranks"] if rk.get("pid")]
            if not ranks:
                continue
            victim = self.rng.choice(ranks)
            try:
                os.kill(int(victim["pid"]), signal.SIGKILL)
                self.kills.append(time.perf_counter())
                print(f"  killed rank {victim['rank']} (pid {victim['pid']})", file=sys.stderr, flush=True)
            except ProcessLookupError:
                pass

    async def resetter(self, s) -> None:
        while time.perf_counter() + self.args.reset_every_s < self.stop_at:
            await asyncio.sleep(self.args.reset_every_s)
            async with s.post(self.url + "/admin/reset", json={}) as r:
                if r.status == 200:
                    self.resets += 1
                else:
                    self.reset_failures += 1

    async def bad(self, s) -> None:
        bodies = [b'{"prompt": [1, 2, 3], "max_tokens": 4, "temperature": NaN}', b'{"prompt": "x"',
                  b'{"prompt": [1, 2, 3], "seed": 18446744073709551615}', b'{"prompt": [99999999]}',
                  b'[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]]]]]]]]]]'
                  b']]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]', b'{"prompt": [1], "top_k": 1099511627776}']
        while time.perf_counter() < self.stop_at:
            await asyncio.sleep(1.0 / self.args.bad_per_s)
            async with s.post(self.url + "/v1/completions", data=self.rng.choice(bodies),
                              headers={"Content-Type": "application/json"}) as r:
                if 400 <= r.status < 500:
                    self.bad_4xx += 1
                else:
                    self.bad_other += 1

    def stalls(self) -> list[dict]:
        """Per kill at time k: the longest gap between consecutive events (request start, tokens) of any stream
        over the kill's window [k, next kill or the end), so a failure noticed late still shows; how many streams
        had such a gap, and the longest gap straddling k itself."""
        out = []
        ends = self.kills[1:] + [float("inf")]
        for k, end in zip(self.kills, ends):
            worst, straddle, streams = 0.0, 0.0, 0
            for times in self.token_times:
                gaps = [(a, b) for a, b in zip(times, times[1:]) if b > k and a < end]
                if not gaps:
                    continue
                streams += 1
                worst = max(worst, max(b - a for a, b in gaps))
                straddle = max([straddle] + [b - a for a, b in gaps if a <= k < b])
            out.append({"stall_s": worst, "straddling_gap_s": straddle, "streams": streams})
        return out


async def run_soak(args: argparse.Namespace, url: str, server_pid: int) -> dict:
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=args.duration_s + 600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=args.clients + 8)) as s:
        async with s.get(url + "/status") as r:
            st = await r.json()
        vocab = st["engine"]["limits"]["vocab_size"]
        rank_pids = [int(rk["pid"]) for rk in st["ranks"] if rk.get("pid")]
        mem0 = {"server_mb": rss_mb(server_pid), "ranks_mb": [rss_mb(p) for p in rank_pids]}
        soak = Soak(args, url, vocab)
        t0 = time.perf_counter()
        await asyncio.gather(*[soak.client(s, i) for i in range(args.clients)], soak.killer(s), soak.resetter(s),
                             soak.bad(s))
        wall = time.perf_counter() - t0
        async with s.get(url + "/status") as r:
            st = await r.json()
        rank_pids = [int(rk["pid"]) for rk in st["ranks"] if rk.get("pid")]
        mem1 = {"server_mb": rss_mb(server_pid), "ranks_mb": [rss_mb(p) for p in rank_pids]}
    per_kill = soak.stalls()
    stalls = [k["stall_s"] for k in per_kill]
    return {"config": {k: v for k, v in vars(args).items()}, "wall_s": wall, "completed": soak.done,
            "lost": soak.lost, "errors": soak.errors[:20], "kills": len(soak.kills),
            "stall_s": {"p50": float(np.percentile(stalls, 50)) if stalls else None,
                        "p99": float(np.percentile(stalls, 99)) if stalls else None,
                        "max": max(stalls) if stalls else None},
            "per_kill": per_kill,
            "resets": soak.resets, "reset_failures": soak.reset_failures, "bad_4xx": soak.bad_4xx,
            "bad_other": soak.bad_other, "memory_start": mem0, "memory_end": mem1,
            "engine_end": st["engine"], "failures_seen": st.get("num_failures")}


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3-tiny")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--step-timeout-s", type=float, default=12.0)
    p.add_argument("--server-arg", action="append", default=[], help="extra `graphline serve` argument")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--duration-s", type=float, default=180.0)
    p.add_argument("--kill-every-s", type=float, default=30.0)
    p.add_argument("--reset-every-s", type=float, default=45.0)
    p.add_argument("--bad-per-s", type=float, default=5.0)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--startup-timeout-s", type=float, default=600.0)
    p.add_argument("--out", default=str(Path("artifacts") / "soak.json"))
    args = p.parse_args(argv)
    proc, url = start_server(args)
    try:
        result = asyncio.run(run_soak(args, url, proc.pid))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str))
    m0, m1 = result["memory_start"], result["memory_end"]
    print(f"soak {result['wall_s']:.0f} s, {args.clients} clients: {result['completed']} requests completed, "
          f"{result['lost']} lost; {result['kills']} ranks killed, stall per kill p50 {result['stall_s']['p50']} s "
          f"p99 {result['stall_s']['p99']} s max {result['stall_s']['max']} s; {result['resets']} resets "
          f"({result['reset_failures']} failed); bad requests {result['bad_4xx']} 4xx, {result['bad_other']} other; "
          f"RSS server {m0['server_mb']} -> {m1['server_mb']} MB, ranks {m0['ranks_mb']} -> {m1['ranks_mb']} MB")
    print(f"wrote {out}")
    return 0 if result["lost"] == 0 and result["bad_other"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
