"""`graphline bench`: the serving benchmark. Throughput, time to first token (TTFT) and time per output token
(TPOT) at 1, 16 and 64 concurrent clients, and start-up to the first answered request.

    graphline bench --model qwen3-0.6b                             # starts `graphline serve --port 0`
    graphline bench --url http://127.0.0.1:8000                    # an already running server
    graphline bench --model qwen3-tiny --executor local --max-tokens 16 --concurrency 1,4
    graphline bench --model qwen3-0.6b --temperature 1.0 --top-p 0.9   # sampled requests (OpenAI's default is 1.0)
    python -m bench.serve_bench ...                                # the same, from a checkout

Every client streams (server-sent events) so the first token and every later token are timed
on arrival. TPOT of a request = (last token time - first token time) / (tokens - 1); "gap" is the
time between consecutive events of a request and "tokens per event" how many tokens each carried
(several with `--server-arg=--decode-steps=8`, multi-step decode). Prints a table and writes JSON
(`--out`, default artifacts/serve_bench.json under the current directory). Requests go to the server's URL only:
use a loopback address.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import numpy as np



def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=None, help="benchmark this server instead of starting one")
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--executor", default="ray", choices=("ray", "local", "auto"))
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--eager", action="store_true")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--server-arg", action="append", default=[], help="extra `graphline serve` argument (repeatable)")
    p.add_argument("--concurrency", default="1,16,64", help="comma-separated client counts")
    p.add_argument("--requests-per-client", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (OpenAI's default is 1.0)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--startup-timeout-s", type=float, default=600.0)
    p.add_argument("--out", default=str(Path("artifacts") / "serve_bench.json"))


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str, float]:
    cmd = [sys.executable, "-m", "launch", "serve", "--model", args.model, "--executor", args.executor,
           "--tp", str(args.tp), "--dp", str(args.dp), "--max-model-len", str(args.max_model_len),
           "--host", "127.0.0.1", "--port", "0", "--no-progress", *args.server_arg]
    if args.eager:
        cmd.append("--eager")
    from actors.environment import child_environ

    env = child_environ(RAY_USAGE_STATS_ENABLED="0", PYTHONUNBUFFERED="1")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    deadline = t0 + args.startup_timeout_s
    for line in proc.stdout:
        sys.stderr.write("  [server] " + line)
        m = re.search(r"serving .* on (http://\S+)", line)
        if m:
            return proc, m.group(1), t0
        if time.perf_counter() > deadline:
            break
    proc.kill()
    raise RuntimeError(f"the server did not start (exit code {proc.poll()})")


def sampling_body(args: argparse.Namespace) -> dict:
    """The sampling fields every benchmark request carries."""
    body = {"temperature": args.temperature, "top_p": args.top_p}
    if args.top_k:
        body["top_k"] = args.top_k
    return body


async def one_request(session, url: str, model: Optional[str], prompt: list[int], max_tokens: int,
                      sampling: dict) -> dict:
    """One streamed completion; raises on an HTTP error or an error event. Returns TTFT, TPOT, token count,
    latency, the gaps between events and `arrivals` (perf_counter of the request's start, then of each event)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, **sampling, "stream": True}
    t0 = time.perf_counter()
    times, ntok = [], 0
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {await resp.text()}")
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            for ch in chunk["choices"]:
                k = len(ch.get("token_ids") or [])
                if k:
                    times.append((time.perf_counter(), k))
                    ntok += k
    t_end = time.perf_counter()
    first = times[0][0] if times else t_end
    tpot = (times[-1][0] - first) / (ntok - 1) if ntok > 1 else None
    gaps = [b[0] - a[0] for a, b in zip(times, times[1:])]
    return {"ttft": first - t0, "tpot": tpot, "tokens": ntok, "latency": t_end - t0, "gaps": gaps,
            "events": len(times), "arrivals": [t0, *(t for t, _ in times)]}


async def run_level(url: str, model: str, clients: int, per_client: int, prompt_len: int, max_tokens: int,
                    vocab: int, sampling: dict) -> dict:
    import aiohttp

    rng = np.random.default_rng(clients)
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=clients + 4)) as s:
        async def client(i: int) -> list[dict]:
            out = []
            for _ in range(per_client):
                prompt = rng.integers(1, vocab, prompt_len).tolist()
                out.append(await one_request(s, url, model, prompt, max_tokens, sampling))
            return out

        t0 = time.perf_counter()
        res = [r for rs in await asyncio.gather(*[client(i) for i in range(clients)]) for r in rs]
        wall = time.perf_counter() - t0
    tpots = np.array([r["tpot"] for r in res if r["tpot"] is not None])
    ttfts = np.array([r["ttft"] for r in res])
    toks = sum(r["tokens"] for r in res)
    gaps = np.array([g for r in res for g in r["gaps"]] or [np.nan])
    return {
        "clients": clients, "requests": len(res), "output_tokens": toks, "wall_s": wall,
        "throughput_tok_s": toks / wall, "requests_per_s": len(res) / wall,
        "tpot_ms_mean": float(tpots.mean() * 1e3) if len(tpots) else None,
        "tpot_ms_median": float(np.median(tpots) * 1e3) if len(tpots) else None,
        "tpot_ms_p99": float(np.percentile(tpots, 99) * 1e3) if len(tpots) else None,
        "ttft_ms_median": float(np.median(ttfts) * 1e3), "ttft_ms_p99": float(np.percentile(ttfts, 99) * 1e3),
        # gaps between consecutive streamed events of a request (several tokens per event with --decode-steps)
        "event_gap_ms_median": float(np.median(gaps) * 1e3), "event_gap_ms_p99": float(np.percentile(gaps, 99) * 1e3),
        "tokens_per_event": toks / max(1, sum(r["events"] for r in res)),
    }


async def _first_answer(url: str, model: Optional[str]) -> tuple[str, int]:
    import aiohttp

    async with aiohttp.ClientSession() as s:
        async with s.get(f"{url}/v1/models") as r:
            info = (await r.json())["data"][0]
        name = model or info["id"]
        async with s.get(f"{url}/status") as r:
            vocab = (await r.json())["engine"]["limits"]["vocab_size"]
        async with s.post(f"{url}/v1/completions", json={"model": name, "prompt": [1, 2, 3], "max_tokens": 1,
                                                          "temperature": 0}) as r:
            if r.status != 200:
                raise RuntimeError(f"first request failed: HTTP {r.status}: {await r.text()}")
    return name, vocab


async def _armed_counts(url: str) -> list:
    """Each rank's armed-decode counters (`actors.armed`) from /status; None for a rank that never arms."""
    import aiohttp

    async with aiohttp.ClientSession() as s:
        async with s.get(f"{url}/status") as r:
            return [rank.get("armed_decode") for rank in (await r.json()).get("ranks", [])]


def run(args: argparse.Namespace) -> int:
    proc, t0 = None, None
    url = args.url
    result: dict = {"model": args.model, "config": {k: v for k, v in vars(args).items() if k != "func"}}
    try:
        if url is None:
            proc, url, t0 = start_server(args)
        name, vocab = asyncio.run(_first_answer(url, None))
        if t0 is not None:
            result["startup_to_first_answer_s"] = time.perf_counter() - t0
        levels = []
        sampling = sampling_body(args)
        asyncio.run(run_level(url, name, 1, 1, args.prompt_len, min(8, args.max_tokens), vocab, sampling))  # warm-up
        for c in [int(x) for x in args.concurrency.split(",") if x]:
            lv = asyncio.run(run_level(url, name, c, args.requests_per_client, args.prompt_len, args.max_tokens,
                                       vocab, sampling))
            lv["armed_decode_after"] = asyncio.run(_armed_counts(url))
            levels.append(lv)
            print(f"  {c:>3} clients: {lv['throughput_tok_s']:.1f} tok/s, TPOT median {lv['tpot_ms_median']:.3f} ms; "
                  f"armed decode so far {lv['armed_decode_after']}", file=sys.stderr, flush=True)
        result["levels"] = levels
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    print_table(result)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return 0


def print_table(result: dict) -> None:
    cfg = result.get("config", {})
    print(f"model {result['model']}, temperature {cfg.get('temperature', 0.0)}, top_p {cfg.get('top_p', 1.0)}, "
          f"top_k {cfg.get('top_k', 0)}" + (f"; start-up to first answered request {result['startup_to_first_answer_s']:.2f} s"
                                        if "startup_to_first_answer_s" in result else ""))
    hdr = f"{'clients':>7} {'requests':>8} {'tok/s':>10} {'req/s':>8} {'TPOT med ms':>12} {'TPOT p99 ms':>12} " \
          f"{'TTFT med ms':>12} {'TTFT p99 ms':>12} {'gap med ms':>11} {'gap p99 ms':>11} {'tok/event':>9}"
    print(hdr)
    print("-" * len(hdr))
    for lv in result.get("levels", []):
        f = lambda v: f"{v:12.3f}" if v is not None else f"{'-':>12}"  # noqa: E731
        print(f"{lv['clients']:>7} {lv['requests']:>8} {lv['throughput_tok_s']:>10.1f} {lv['requests_per_s']:>8.2f} "
              f"{f(lv['tpot_ms_median'])} {f(lv['tpot_ms_p99'])} {f(lv['ttft_ms_median'])} {f(lv['ttft_ms_p99'])} "
              f"{lv.get('event_gap_ms_median', float('nan')):11.3f} {lv.get('event_gap_ms_p99', float('nan')):11.3f} "
              f"{lv.get('tokens_per_event', float('nan')):9.2f}")


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    """`graphline bench` (same options as `python -m bench.serve_bench`)."""
    p = sub.add_parser("bench", help="serving benchmark: throughput, TTFT and TPOT at 1/16/64 clients")
    add_arguments(p)
    p.set_defaults(func=run)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv))
