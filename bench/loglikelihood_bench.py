"""Loglikelihood requests (what lm-evaluation-harness' loglikelihood tasks send) against plain one-token completions
of the same prompts, on one `graphline serve` at 127.0.0.1.

    python -m bench.loglikelihood_bench --model qwen3-0.6b                          # 1 and 8 clients, 256-token prompts
    python -m bench.loglikelihood_bench --model qwen3-tiny --executor local --concurrency 1,4 \\
        --requests-per-client 4 --prompt-len 64 --max-model-len 256 --server-arg=--device --server-arg=cpu
    python -m bench.loglikelihood_bench --model /ckpt/Qwen3-8B --prompts-per-request 8   # lm-eval batches prompts

Modes, at each concurrency (their order alternates from one concurrency to the next):
- `loglik`: `{"prompt": [...], "max_tokens": 1, "logprobs": 1, "echo": true, "temperature": 0}`: every prompt
  token's log-probability (the server runs the LM head over every prompt position and skips prefix-cache reuse).
  Each choice is checked: `prompt_len + 1` token_logprobs, the first null, the others numbers.
- `plain`: the same prompts with a different random first token (so the prefix cache, whose block hashes chain from
  the first token, cannot serve one mode from the other, while both modes prefill the same content), `max_tokens: 1,
  temperature: 0`, no echo, no logprobs.
Every client sends `--requests-per-client` non-streamed requests one after the other, each of
`--prompts-per-request` prompts of `--prompt-len` random token ids. Prints requests/s, prompt tokens/s and latency
(median, p99) per concurrency and mode, then loglik / plain ratios; writes JSON (`--out`). Start-up options as
`graphline bench` (`launch.bench`); `--url` benchmarks an already running (loopback) server instead.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional
from urllib.parse import urlparse

import numpy as np

from launch.bench import _first_answer, add_arguments, auth_headers, start_server
from launch.credentials import API_KEY

MODES = ("loglik", "plain")
SERVER_OPTIONS = ("url", "model", "executor", "tp", "dp", "eager", "max_model_len", "server_arg", "api_key",
                  "startup_timeout_s")


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawTextHelpFormatter)
    serve = argparse.ArgumentParser(add_help=False)
    add_arguments(serve)  # the server options of `graphline bench`, the rest of its options left out
    for action in serve._actions:
        if action.dest in SERVER_OPTIONS:
            p._add_action(action)
    p.add_argument("--concurrency", default="1,8", help="comma-separated client counts")
    p.add_argument("--requests-per-client", type=int, default=8)
    p.add_argument("--prompts-per-request", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--request-timeout-s", type=float, default=600.0)
    p.add_argument("--out", default=str(Path("artifacts") / "loglikelihood_bench.json"))
    return p.parse_args(argv)


def make_prompts(seed: int, clients: int, per_client: int, per_request: int, prompt_len: int,
                 vocab: int) -> dict[str, list]:
    """Per mode, per client, per request: its prompts (token-id lists); plain's are loglik's with another first id."""
    rng = np.random.default_rng(seed)
    ll = rng.integers(1, vocab, (clients, per_client, per_request, prompt_len))
    plain = ll.copy()
    plain[..., 0] = (ll[..., 0] - 1 + rng.integers(1, vocab - 1, ll.shape[:3])) % (vocab - 1) + 1  # != ll's, >= 1
    return {"loglik": ll.tolist(), "plain": plain.tolist()}


def body(mode: str, prompts: list[list[int]], model: str) -> dict:
    b = {"model": model, "prompt": prompts, "max_tokens": 1, "temperature": 0}
    return {**b, "logprobs": 1, "echo": True} if mode == "loglik" else b


def check(mode: str, out: dict, prompts: list[list[int]]) -> None:
    """Raises unless `out` answers every prompt (loglik: with every prompt token's log-probability)."""
    choices = sorted(out.get("choices") or [], key=lambda c: c["index"])
    if len(choices) != len(prompts):
        raise RuntimeError(f"{mode}: {len(choices)} choices for {len(prompts)} prompts: {str(out)[:300]}")
    for ch, prompt in zip(choices, prompts):
        if mode != "loglik":
            continue
        lps = (ch.get("logprobs") or {}).get("token_logprobs")
        n = len(prompt)
        if lps is None or len(lps) != n + 1 or lps[0] is not None or \
                not all(isinstance(v, (int, float)) and math.isfinite(v) for v in lps[1:]):
            raise RuntimeError(f"loglik choice {ch['index']}: expected {n + 1} token_logprobs, the first null and the "
                               f"rest numbers, got {str(lps)[:300]}")


async def run_level(url: str, model: str, mode: str, prompts: list, headers: dict, timeout_s: float) -> dict:
    """Every client's requests of `mode`, the clients concurrently; the latency of each request."""
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s), headers=headers,
                                     connector=aiohttp.TCPConnector(limit=len(prompts) + 4)) as s:
        async def client(reqs: list) -> list[float]:
            lat = []
            for ps in reqs:
                t0 = time.perf_counter()
                async with s.post(f"{url}/v1/completions", json=body(mode, ps, model)) as r:
                    if r.status != 200:
                        raise RuntimeError(f"{mode}: HTTP {r.status}: {(await r.text())[:300]}")
                    out = await r.json()
                lat.append(time.perf_counter() - t0)
                check(mode, out, ps)
            return lat

        t0 = time.perf_counter()
        lat = np.array([x for ls in await asyncio.gather(*[client(c) for c in prompts]) for x in ls])
        wall = time.perf_counter() - t0
    n_prompts = sum(len(ps) for c in prompts for ps in c)
    toks = sum(len(p) for c in prompts for ps in c for p in ps)
    return {"mode": mode, "clients": len(prompts), "requests": len(lat), "prompts": n_prompts, "prompt_tokens": toks,
            "wall_s": wall, "requests_per_s": len(lat) / wall, "prompt_tok_s": toks / wall,
            "latency_ms_median": float(np.median(lat) * 1e3), "latency_ms_p99": float(np.percentile(lat, 99) * 1e3)}


def ratios(levels: list[dict]) -> list[dict]:
    by = {(lv["clients"], lv["mode"]): lv for lv in levels}
    return [{"clients": c, "latency_median_ratio": ll["latency_ms_median"] / pl["latency_ms_median"],
             "latency_p99_ratio": ll["latency_ms_p99"] / pl["latency_ms_p99"],
             "throughput_ratio": ll["prompt_tok_s"] / pl["prompt_tok_s"]}
            for (c, m), ll in by.items() if m == "loglik" and (pl := by.get((c, "plain")))]


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL to its process group (its own session) after 30 s."""
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)


def main(argv: Optional[list[str]] = None) -> dict:
    args = parse_args(argv)
    levels_c = [int(x) for x in args.concurrency.split(",") if x.strip()]
    if not levels_c or min(levels_c) < 1 or min(args.requests_per_client, args.prompts_per_request,
                                                 args.prompt_len) < 1:
        raise SystemExit("error: --concurrency, --requests-per-client, --prompts-per-request and --prompt-len: >= 1")
    if args.url is not None and urlparse(args.url).hostname not in ("127.0.0.1", "localhost", "::1"):
        raise SystemExit(f"error: --url {args.url}: use a loopback address")
    headers = auth_headers(API_KEY.resolve(args.api_key, None))
    result: dict = {"model": args.model, "config": vars(args) | {"api_key": None}}
    proc, url, tail = None, args.url, collections.deque(maxlen=40)
    try:
        if url is None:
            proc, url, _ = start_server(args, args.api_key)
            # keep reading the server's output (a full pipe would stall it); its last lines go with an error
            threading.Thread(target=lambda: tail.extend(proc.stdout), daemon=True).start()
        name, vocab = asyncio.run(_first_answer(url, None, headers))
        timeout = args.request_timeout_s
        warm = make_prompts(0, 1, 1, args.prompts_per_request, args.prompt_len, vocab)
        for mode in MODES:
            asyncio.run(run_level(url, name, mode, warm[mode], headers, timeout))
        levels = []
        for i, c in enumerate(levels_c):
            prompts = make_prompts(i + 1, c, args.requests_per_client, args.prompts_per_request, args.prompt_len,
                                   vocab)
            for mode in (MODES if i % 2 == 0 else MODES[::-1]):
                lv = asyncio.run(run_level(url, name, mode, prompts[mode], headers, timeout))
                levels.append(lv)
                print(f"  {c:>3} clients, {mode}: {lv['requests_per_s']:.2f} req/s, latency median "
                      f"{lv['latency_ms_median']:.1f} ms", file=sys.stderr, flush=True)
        result["levels"] = levels
        result["loglik_vs_plain"] = ratios(levels)
    except BaseException:
        if tail:
            sys.stderr.write("".join("  [server] " + line for line in tail))
        raise
    finally:
        if proc is not None:
            stop_server(proc)
    print_table(result)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return result


def print_table(result: dict) -> None:
    cfg = result["config"]
    print(f"model {result['model']}, prompt_len {cfg['prompt_len']}, {cfg['prompts_per_request']} prompt(s) per "
          f"request, {cfg['requests_per_client']} requests per client")
    hdr = f"{'mode':>7} {'clients':>7} {'requests':>8} {'req/s':>8} {'prompt tok/s':>12} {'lat med ms':>11} " \
          f"{'lat p99 ms':>11}"
    print(hdr)
    print("-" * len(hdr))
    for lv in result["levels"]:
        print(f"{lv['mode']:>7} {lv['clients']:>7} {lv['requests']:>8} {lv['requests_per_s']:>8.2f} "
              f"{lv['prompt_tok_s']:>12.1f} {lv['latency_ms_median']:>11.1f} {lv['latency_ms_p99']:>11.1f}")
    for r in result["loglik_vs_plain"]:
        print(f"loglik / plain, {r['clients']} clients: latency median {r['latency_median_ratio']:.3f}, p99 "
              f"{r['latency_p99_ratio']:.3f}, prompt tok/s {r['throughput_ratio']:.3f}")


if __name__ == "__main__":
    main()
