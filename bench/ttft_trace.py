"""Where an HTTP request's time to first token goes, outside the model: the real aiohttp app in-process on
127.0.0.1 over the local executor (the same options as `graphline serve`), one streamed completion at a time.

    python -m bench.ttft_trace --model qwen3-0.6b                       # GPU: graphs as `graphline serve`
    python -m bench.ttft_trace --model qwen3-tiny --device cpu          # CPU

The client (`bench.ttft_trace.client_requests`, aiohttp) runs in its own process by default, as `graphline bench`'s
does (`--client loop`: in the server's event loop, where its own work competes with the server's). Timestamps
(perf_counter: CLOCK_MONOTONIC, comparable across the two processes) by wrapping the engine's hand-off points,
medians over `--requests` (the first `--warmup` dropped), in milliseconds:

  http_in              client sends -> `AsyncLLMEngine.submit` (request bytes, JSON parse, validation)
  to_engine            submit -> the engine thread takes it from its inbox (the handler's response set-up, which
                       it finishes before waking the engine thread, and the thread wake-up)
  step                 `LLMEngine.step` that yields the first token (scheduling, the executor's step, outputs)
  engine_overhead      engine thread took it -> that step ended, less `step` (a step already running, queueing)
  to_dispatch          step ended -> the event loop dispatches the output (`call_soon_threadsafe`, GIL)
  to_client            dispatch -> the client has read the first event (SSE write, client parse)
  ttft                 client sends -> client reads the first event

`http_in` and `to_client` include the client's own work; marks on the server's side split them (`SPLITS`, also
medians):

  client_send          client sends -> the handler runs (the client's JSON and request, aiohttp's HTTP parsing)
  parse                handler -> the request is parsed (body read, JSON, validation, tokenisation)
  to_submit            parsed -> `submit` (engine requests, choice states)
  sse_write            dispatch -> the first event is handed to the transport (stream wake-up, detokenise, JSON)
  client_read          handed to the transport -> the client has read it

Writes JSON (`--out`).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from typing import Any

import numpy as np

from bench.common import write_json

SEGMENTS = ("http_in", "to_engine", "step", "engine_overhead", "to_dispatch", "to_client", "ttft")
SPLITS = ("client_send", "parse", "to_submit", "sse_write", "client_read")  # http_in and to_client, split


class Marks:
    """First time each (request id, point) was reached, and the first-token step's duration per request."""

    def __init__(self) -> None:
        self.at: dict[str, dict[str, float]] = {}
        self.pending: dict[str, float] = {}  # server-side marks before the request has an id (one client)
        self.current: str | None = None  # the request submitted last

    def mark(self, rid: str, point: str, value: float | None = None) -> None:
        self.at.setdefault(rid, {}).setdefault(point, time.perf_counter() if value is None else value)

    def mark_pending(self, point: str) -> None:
        self.pending.setdefault(point, time.perf_counter())


def instrument(marks: Marks):
    """Wrap the engine's hand-off points (process-wide); returns the function that unwraps them."""
    import launch.generation as gen
    import launch.server as srv
    from engine import AsyncLLMEngine, LLMEngine

    submit, apply, step, dispatch = (AsyncLLMEngine.submit, AsyncLLMEngine._apply, LLMEngine.step,
                                     AsyncLLMEngine._dispatch)
    raw_body, parse_completion, write_choices = srv._raw_body, srv.parse_completion_request, gen._ChunkWriter.choices

    async def w_raw_body(request, limits):
        marks.pending.clear()
        marks.mark_pending("handler")
        return await raw_body(request, limits)

    def w_parse_completion(body, ctx):
        out = parse_completion(body, ctx)
        marks.mark_pending("parsed")
        return out

    async def w_choices(self, choices, usage_=None):
        await write_choices(self, choices, usage_)
        if marks.current is not None and choices:
            marks.mark(marks.current, "written")

    def w_submit(self, request, *args, **kw):
        marks.mark(request.request_id, "submit")
        for point, at in marks.pending.items():
            marks.mark(request.request_id, point, at)
        marks.current = request.request_id
        return submit(self, request, *args, **kw)

    def w_apply(self, inbox):
        for item in inbox:
            if item[0] == "add":
                marks.mark(item[1].request_id, "engine_got")
        return apply(self, inbox)

    def w_step(self):
        t0 = time.perf_counter()
        outs = step(self)
        t1 = time.perf_counter()
        for o in outs:
            marks.mark(o.request_id, "step_s", t1 - t0)
            marks.mark(o.request_id, "step_end", t1)
        return outs

    def w_dispatch(self, outs, *args):
        for o in outs:
            marks.mark(o.request_id, "dispatch")
        return dispatch(self, outs, *args)

    AsyncLLMEngine.submit, AsyncLLMEngine._apply, AsyncLLMEngine._dispatch = w_submit, w_apply, w_dispatch
    LLMEngine.step = w_step
    srv._raw_body, srv.parse_completion_request, gen._ChunkWriter.choices = w_raw_body, w_parse_completion, w_choices

    def undo() -> None:
        AsyncLLMEngine.submit, AsyncLLMEngine._apply, AsyncLLMEngine._dispatch = submit, apply, dispatch
        LLMEngine.step = step
        srv._raw_body, srv.parse_completion_request, gen._ChunkWriter.choices = raw_body, parse_completion, \
            write_choices
    return undo


async def client_requests(url: str, requests: int, prompt_len: int, vocab: int, max_tokens: int
                          ) -> list[tuple[float, float]]:
    """One streamed completion at a time; (perf_counter when sent, when the first event was read) of each."""
    import aiohttp

    rng = np.random.default_rng(0)
    sent: list[tuple[float, float]] = []
    async with aiohttp.ClientSession() as session:
        for _ in range(requests):
            body = {"prompt": rng.integers(1, vocab, prompt_len).tolist(), "max_tokens": max_tokens,
                    "stream": True, "temperature": 0}
            t0 = time.perf_counter()
            async with session.post(url, json=body) as r:
                if r.status != 200:
                    raise SystemExit(f"HTTP {r.status}: {(await r.read())[:300]!r}")
                first = None
                async for line in r.content:
                    if first is None and line.startswith(b"data:"):
                        first = time.perf_counter()
            sent.append((t0, first))
    return sent


async def run(args: argparse.Namespace, marks: Marks) -> list[dict[str, float]]:
    from aiohttp import web

    from engine import AsyncLLMEngine, LLMEngine
    from launch.metrics import ServerMetrics
    from launch.options import build_executor, engine_config, start_executor
    from launch.server import ServerState, build_app

    executor, _ = build_executor(args)
    start_executor(executor, args)
    metrics = ServerMetrics()
    handoff = {} if args.first_token_handoff_ms is None else {"first_token_handoff_s": args.first_token_handoff_ms / 1e3}
    state = ServerState(engine=AsyncLLMEngine(LLMEngine(executor, engine_config(args)), metrics, **handoff),
                        metrics=metrics, model_name=args.model, tokenizer=None)
    state.engine.start()
    vocab = executor.model_config.vocab_size
    runner = web.AppRunner(build_app(state), handler_cancellation=True, access_log=None)  # as `graphline serve`
    try:
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}/v1/completions"
        if args.client == "loop":
            sent = await client_requests(url, args.requests, args.prompt_len, vocab, args.max_tokens)
        else:  # perf_counter is CLOCK_MONOTONIC: the client process's times compare with the server's
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-c", "import sys; from bench.ttft_trace import client_main; client_main(sys.argv[1:])",
                url, str(args.requests), str(args.prompt_len), str(vocab), str(args.max_tokens),
                stdout=asyncio.subprocess.PIPE)
            out, _ = await proc.communicate()
            if proc.returncode != 0:
                raise SystemExit(f"the client process failed (exit {proc.returncode})")
            sent = [tuple(x) for x in json.loads(out)]
    finally:
        await runner.cleanup()
        state.engine.shutdown()
        if hasattr(executor, "shutdown"):
            executor.shutdown()
    rows = []
    for (t0, first), m in zip(sent, marks.at.values()):  # request ids in submission order (dicts keep it)
        rows.append({"http_in": m["submit"] - t0, "to_engine": m["engine_got"] - m["submit"], "step": m["step_s"],
                     "engine_overhead": m["step_end"] - m["engine_got"] - m["step_s"],
                     "to_dispatch": m["dispatch"] - m["step_end"], "to_client": first - m["dispatch"],
                     "ttft": first - t0, "client_send": m["handler"] - t0, "parse": m["parsed"] - m["handler"],
                     "to_submit": m["submit"] - m["parsed"], "sse_write": m["written"] - m["dispatch"],
                     "client_read": first - m["written"]})
    return rows[args.warmup:]


def client_main(argv: list[str]) -> None:
    """The client process: url, requests, prompt_len, vocab, max_tokens; prints [[sent, first], ...] as JSON."""
    url, *nums = argv
    print(json.dumps(asyncio.run(client_requests(url, *map(int, nums)))))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from launch.options import add_model_args

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(p, executor_default="local")
    p.add_argument("--requests", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--client", choices=("process", "loop"), default="process",
                   help="process: the client in its own process (as `graphline bench`); loop: in the server's event "
                        "loop (its work then shows in http_in and to_client)")
    p.add_argument("--first-token-handoff-ms", type=float, default=None,
                   help="AsyncLLMEngine's first_token_handoff_s (ms; 0 = never wait for the event loop)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    args.no_progress = True
    marks = Marks()
    undo = instrument(marks)
    try:
        rows = asyncio.run(run(args, marks))
    finally:
        undo()
    med = {k: 1e3 * statistics.median(r[k] for r in rows) for k in SEGMENTS + SPLITS}
    print(f"ttft_trace {args.model} ({args.device}), {len(rows)} requests of {args.prompt_len} prompt tokens, "
          f"client in the {args.client}, median ms:")
    for k in SEGMENTS:
        print(f"  {k:16s} {med[k]:8.3f}")
    print("  of which: " + ", ".join(f"{k} {med[k]:.3f}" for k in SPLITS))
    result = {"model": args.model, "device": args.device, "prompt_len": args.prompt_len, "client": args.client,
              "median_ms": med,
              "rows": rows}
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
