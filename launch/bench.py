"""`graphline bench`: the serving benchmark. Throughput, time to first token (TTFT) and time per output token
(TPOT) at 1, 16 and 64 concurrent clients, and start-up to the first answered request.

    graphline bench --model qwen3-0.6b                             # starts `graphline serve --port 0`
    graphline bench --url http://127.0.0.1:8000                    # an already running server
    graphline bench --model qwen3-tiny --executor local --max-tokens 16 --concurrency 1,4
    graphline bench --model qwen3-0.6b --temperature 1.0 --top-p 0.9   # sampled requests (OpenAI's default is 1.0)
    graphline bench --model qwen3-0.6b --temperature 1.0 --compare-greedy   # sampled and greedy, one server
    graphline bench --model /ckpt/Qwen3-8B --api completions,chat     # chat vs completions TPOT, one server
    graphline bench --model /ckpt/Qwen3-8B --api completions,responses   # the Responses API vs completions
    python -m bench.serve_bench ...                                # the same, from a checkout

Every client streams (server-sent events) so the first token and every later token are timed
on arrival. TPOT of a request = (last token time - first token time) / (tokens - 1); "gap" is the
time between consecutive events of a request and "tokens per event" how many tokens each carried
(several with `--server-arg=--decode-steps=8`, multi-step decode). Every request generates `--max-tokens` tokens
(`ignore_eos`). Prints a table and writes JSON (`--out`, default artifacts/serve_bench.json under the current
directory). Requests go to the server's URL only: use a loopback address.

`--api chat` sends `/v1/chat/completions` (a checkpoint with a chat template; conversations of about
`--prompt-len` tokens and a stop string that never matches, `launch.bench_chat`); `--api completions,chat` runs
both against the same server, at each concurrency one after the other, the completions prompts then being
templated conversations as token ids (same length, same output tokens), and prints chat / completions ratios of
TPOT, TTFT and throughput (JSON: `chat_vs_completions`). `--api responses` sends the same conversations to
`/v1/responses` (OpenAI's Responses API, streamed events) and `--api completions,responses` prints responses /
completions ratios (`responses_vs_completions`). Without chat or responses, completion prompts are random token ids.
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

from launch.bench_chat import (ChatPrompts, load_bench_tokenizer, one_chat_request, one_responses_request,
                               print_ratios, ratios,
                               stream_events, timings)
from actors.environment import API_KEY_ENV
from launch.credentials import API_KEY, CredentialError
from launch.options import LaunchError

APIS = ("completions", "chat", "responses")


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
    p.add_argument("--compare-greedy", action="store_true",
                   help="with --temperature > 0: also greedy requests at each concurrency on the same server, and "
                        "sampled / greedy ratios")
    p.add_argument("--response-format", default=None, choices=("json_object",),
                   help="also requests with this response_format at each concurrency (a checkpoint with a tokenizer), "
                        "and constrained / free ratios")
    p.add_argument("--api", default="completions", help="completions, chat, responses, or several side by side: completions,chat,responses")
    p.add_argument("--tokenizer", default=None, help="with chat: the served checkpoint's directory (default --model)")
    p.add_argument("--api-key", default=None,
                   help="send 'Authorization: Bearer KEY' (a server with an API key; default: the GRAPHLINE_API_KEY "
                        "environment variable, which a server this command starts inherits)")
    p.add_argument("--startup-timeout-s", type=float, default=600.0)
    p.add_argument("--out", default=str(Path("artifacts") / "serve_bench.json"))


def start_server(args: argparse.Namespace, api_key: Optional[str] = None) -> tuple[subprocess.Popen, str, float]:
    """`graphline serve` on 127.0.0.1, any free port; `api_key` (not None) travels in its environment (never argv)."""
    cmd = [sys.executable, "-m", "launch", "serve", "--model", args.model, "--executor", args.executor,
           "--tp", str(args.tp), "--dp", str(args.dp), "--max-model-len", str(args.max_model_len),
           "--host", "127.0.0.1", "--port", "0", "--no-progress", *args.server_arg]
    if args.eager:
        cmd.append("--eager")
    from actors.environment import child_environ

    env = child_environ(RAY_USAGE_STATS_ENABLED="0", PYTHONUNBUFFERED="1",
                        **({API_KEY_ENV: api_key} if api_key is not None else {}))
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
    body = {"temperature": args.temperature, "top_p": args.top_p, "ignore_eos": True}
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
    async for chunk in stream_events(session, f"{url}/v1/completions", body):
        for ch in chunk["choices"]:
            k = len(ch.get("token_ids") or [])
            if k:
                times.append(time.perf_counter())
                ntok += k
    return timings(t0, times, ntok, time.perf_counter())


def _prompts(api: str, clients: int, per_client: int, prompt_len: int, vocab: int,
             chat: Optional[ChatPrompts]) -> list[list[tuple]]:
    """Each client's (prompt, its token count), made before the clock starts: random token ids, or (with `chat`)
    conversations: their messages for chat, their templated token ids for completions (other words per API)."""
    if chat is None:
        rng = np.random.default_rng(clients)
        return [[(rng.integers(1, vocab, prompt_len).tolist(), prompt_len) for _ in range(per_client)]
                for _ in range(clients)]
    rng = np.random.default_rng((clients, APIS.index(api)))
    out = []
    for _ in range(clients):
        convs = [chat.make(rng, prompt_len) for _ in range(per_client)]
        out.append([(ids if api == "completions" else msgs, len(ids)) for msgs, ids in convs])
    return out


async def run_level(url: str, model: str, clients: int, per_client: int, prompt_len: int, max_tokens: int,
                    vocab: int, sampling: Optional[dict] = None, api: str = "completions",
                    chat: Optional[ChatPrompts] = None, headers: Optional[dict] = None) -> dict:
    """One concurrency level of `api` requests; `chat` (prompt maker) is needed for chat and makes completion
    prompts templated conversations; `headers` go with every request (`auth_headers`)."""
    import aiohttp

    sampling = {"temperature": 0.0, "ignore_eos": True} if sampling is None else sampling
    prompts = _prompts(api, clients, per_client, prompt_len, vocab, chat)
    send = {"chat": one_chat_request, "responses": one_responses_request}.get(api, one_request)
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=clients + 4),
                                     headers=headers) as s:
        async def client(i: int) -> list[dict]:
            out = []
            for prompt, ntok in prompts[i]:
                r = await send(s, url, model, prompt, max_tokens, sampling)
                r["prompt_tokens_sent"] = ntok
                r.setdefault("prompt_tokens", ntok)
                out.append(r)
            return out

        t0 = time.perf_counter()
        res = [r for rs in await asyncio.gather(*[client(i) for i in range(clients)]) for r in rs]
        wall = time.perf_counter() - t0
    tpots = np.array([r["tpot"] for r in res if r["tpot"] is not None])
    ttfts = np.array([r["ttft"] for r in res])
    toks = sum(r["tokens"] for r in res)
    gaps = np.array([g for r in res for g in r["gaps"]] or [np.nan])
    return {
        "api": api, "clients": clients, "requests": len(res), "output_tokens": toks, "wall_s": wall,
        "prompt_tokens_mean": float(np.mean([r["prompt_tokens"] for r in res])),
        # chat: requests whose server-side template gave another token count than the client's (should be 0)
        "prompt_tokens_mismatch": sum(r["prompt_tokens"] != r["prompt_tokens_sent"] for r in res),
        "throughput_tok_s": toks / wall, "requests_per_s": len(res) / wall,
        "tpot_ms_mean": float(tpots.mean() * 1e3) if len(tpots) else None,
        "tpot_ms_median": float(np.median(tpots) * 1e3) if len(tpots) else None,
        "tpot_ms_p99": float(np.percentile(tpots, 99) * 1e3) if len(tpots) else None,
        "ttft_ms_median": float(np.median(ttfts) * 1e3), "ttft_ms_p99": float(np.percentile(ttfts, 99) * 1e3),
        # gaps between consecutive streamed events of a request (several tokens per event with --decode-steps)
        "event_gap_ms_median": float(np.median(gaps) * 1e3), "event_gap_ms_p99": float(np.percentile(gaps, 99) * 1e3),
        "tokens_per_event": toks / max(1, sum(r["events"] for r in res)),
    }


def auth_headers(api_key: Optional[str]) -> dict:
    """The headers of a request to a server with API key `api_key` (none without one)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key is not None else {}


async def _first_answer(url: str, model: Optional[str], headers: Optional[dict] = None) -> tuple[str, int]:
    import aiohttp

    async with aiohttp.ClientSession(headers=headers) as s:
        async with s.get(f"{url}/v1/models") as r:
            if r.status != 200:
                hint = " (the server needs an API key: --api-key or GRAPHLINE_API_KEY)" if r.status == 401 else ""
                raise LaunchError(f"GET {url}/v1/models: HTTP {r.status}{hint}: {(await r.text())[:300]}")
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
    result: dict = {"model": args.model,
                    "config": {k: v for k, v in vars(args).items() if k not in ("func", "api_key")}}
    try:
        api_key = API_KEY.resolve(args.api_key, None)
    except CredentialError as exc:
        raise LaunchError(str(exc)) from None
    headers = auth_headers(api_key)
    apis = list(dict.fromkeys(a.strip() for a in args.api.split(",") if a.strip()))
    if not apis or any(a not in APIS for a in apis):
        raise LaunchError(f"--api {args.api!r}: use completions, chat, responses or several, e.g. completions,chat")
    chat = ChatPrompts(load_bench_tokenizer(args.tokenizer or args.model)) if set(apis) - {"completions"} else None
    try:
        if url is None:
            proc, url, t0 = start_server(args, args.api_key)
        name, vocab = asyncio.run(_first_answer(url, None, headers))
        if t0 is not None:
            result["startup_to_first_answer_s"] = time.perf_counter() - t0
        levels = []
        modes = [("sampled" if args.temperature > 0 else "greedy", sampling_body(args))]
        if args.compare_greedy and args.temperature > 0:
            modes.append(("greedy", {"temperature": 0.0, "ignore_eos": True}))
        primary = modes[0][0]  # "sampled" or "greedy": the free requests
        if args.response_format:
            modes.insert(0, ("constrained", {**modes[0][1], "response_format": {"type": args.response_format}}))
        for api in apis:  # warm-up
            for _, sampling in modes:
                asyncio.run(run_level(url, name, 1, 1, args.prompt_len, min(8, args.max_tokens), vocab, sampling,
                                      api, chat, headers))
        for c in [int(x) for x in args.concurrency.split(",") if x]:
            for api in apis:
                for label, sampling in modes:
                    lv = asyncio.run(run_level(url, name, c, args.requests_per_client, args.prompt_len,
                                               args.max_tokens, vocab, sampling, api, chat, headers))
                    lv["sampling"] = label
                    lv["armed_decode_after"] = asyncio.run(_armed_counts(url))
                    levels.append(lv)
                    print(f"  {c:>3} clients, {api}, {label}: {lv['throughput_tok_s']:.1f} tok/s, TPOT median "
                          f"{lv['tpot_ms_median']:.3f} ms; armed decode so far {lv['armed_decode_after']}",
                          file=sys.stderr, flush=True)
        result["levels"] = levels
        for api in set(apis) - {"completions"} if "completions" in apis else ():
            result[f"{api}_vs_completions"] = ratios([lv for lv in levels if lv["sampling"] == primary], api)
        if primary == "sampled" and args.compare_greedy:
            result["sampled_vs_greedy"] = mode_ratios(levels, "sampled", "greedy")
        if args.response_format:
            result["constrained_vs_free"] = mode_ratios(levels, "constrained", primary)
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    print_table(result)
    for api in APIS[1:]:
        print_ratios(result.get(f"{api}_vs_completions", []), api)
    for key in ("sampled_vs_greedy", "constrained_vs_free"):
        for row in result.get(key, []):
            print(f"{key.replace('_vs_', ' / ')}, {row['api']}, {row['clients']} clients: TPOT median "
                  f"{row['tpot_median_ratio']:.3f}, p99 {row['tpot_p99_ratio']:.3f}, TTFT median "
                  f"{row['ttft_median_ratio']:.3f}, tok/s {row['throughput_ratio']:.3f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return 0


def mode_ratios(levels: list[dict], num: str, den: str) -> list[dict]:
    """Per (api, concurrency) measured both ways: mode `num` / mode `den` (e.g. sampled / greedy, constrained /
    free) of TPOT (median, p99), TTFT median and throughput."""
    by = {(lv.get("api"), lv["clients"], lv.get("sampling")): lv for lv in levels}
    out = []
    for (api, c, mode), sampled in by.items():
        greedy = by.get((api, c, den))
        if mode != num or greedy is None:
            continue
        out.append({"api": api, "clients": c, **{f"{k}_ratio": sampled[m] / greedy[m] for k, m in (
            ("tpot_median", "tpot_ms_median"), ("tpot_p99", "tpot_ms_p99"), ("ttft_median", "ttft_ms_median"),
            ("throughput", "throughput_tok_s"))}})
    return out


def print_table(result: dict) -> None:
    cfg = result.get("config", {})
    print(f"model {result['model']}, temperature {cfg.get('temperature', 0.0)}, top_p {cfg.get('top_p', 1.0)}, "
          f"top_k {cfg.get('top_k', 0)}" + (f"; start-up to first answered request {result['startup_to_first_answer_s']:.2f} s"
                                        if "startup_to_first_answer_s" in result else ""))
    hdr = f"{'api':>11} {'clients':>7} {'requests':>8} {'tok/s':>10} {'req/s':>8} {'TPOT med ms':>12} {'TPOT p99 ms':>12} " \
          f"{'TTFT med ms':>12} {'TTFT p99 ms':>12} {'gap med ms':>11} {'gap p99 ms':>11} {'tok/event':>9}"
    print(hdr)
    print("-" * len(hdr))
    # api* = sampled requests, api+ = with --response-format (sampled at --temperature > 0), plain = greedy
    for lv in result.get("levels", []):
        f = lambda v: f"{v:12.3f}" if v is not None else f"{'-':>12}"  # noqa: E731
        mark = {"sampled": "*", "constrained": "+"}.get(lv.get("sampling"), "")
        print(f"{lv.get('api', 'completions') + mark:>11} {lv['clients']:>7} {lv['requests']:>8} {lv['throughput_tok_s']:>10.1f} {lv['requests_per_s']:>8.2f} "
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
