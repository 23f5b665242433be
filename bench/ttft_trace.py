"""Where an HTTP request's time to first token goes, outside the model: the real aiohttp app in-process on
127.0.0.1 over the local executor (the same options as `graphline serve`), one streamed completion at a time.

    python -m bench.ttft_trace --model qwen3-0.6b                       # GPU: graphs as `graphline serve`
    python -m bench.ttft_trace --model qwen3-tiny --device cpu          # CPU

Timestamps (perf_counter, one process) by wrapping the engine's hand-off points, medians over `--requests`
(the first `--warmup` dropped), in milliseconds:

  http_in              client sends -> `AsyncLLMEngine.submit` (request bytes, JSON parse, validation)
  to_engine            submit -> the engine thread takes it from its inbox (thread wake-up)
  step                 `LLMEngine.step` that yields the first token (scheduling, the executor's step, outputs)
  engine_overhead      engine thread took it -> that step ended, less `step` (a step already running, queueing)
  to_dispatch          step ended -> the event loop dispatches the output (`call_soon_threadsafe`, GIL)
  to_client            dispatch -> the client has read the first event (SSE write, client parse)
  ttft                 client sends -> client reads the first event

The client runs in the server's event loop (aiohttp's test client), so `http_in` and `to_client` include the
client's own work. Writes JSON (`--out`).
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

import numpy as np

from bench.common import write_json

SEGMENTS = ("http_in", "to_engine", "step", "engine_overhead", "to_dispatch", "to_client", "ttft")


class Marks:
    """First time each (request id, point) was reached, and the first-token step's duration per request."""

    def __init__(self) -> None:
        self.at: dict[str, dict[str, float]] = {}

    def mark(self, rid: str, point: str, value: float | None = None) -> None:
        self.at.setdefault(rid, {}).setdefault(point, time.perf_counter() if value is None else value)


def instrument(marks: Marks):
    """Wrap the engine's hand-off points (process-wide); returns the function that unwraps them."""
    from engine import AsyncLLMEngine, LLMEngine

    submit, apply, step, dispatch = (AsyncLLMEngine.submit, AsyncLLMEngine._apply, LLMEngine.step,
                                     AsyncLLMEngine._dispatch)

    def w_submit(self, request):
        marks.mark(request.request_id, "submit")
        return submit(self, request)

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

    def w_dispatch(self, outs):
        for o in outs:
            marks.mark(o.request_id, "dispatch")
        return dispatch(self, outs)

    AsyncLLMEngine.submit, AsyncLLMEngine._apply, AsyncLLMEngine._dispatch = w_submit, w_apply, w_dispatch
    LLMEngine.step = w_step

    def undo() -> None:
        AsyncLLMEngine.submit, AsyncLLMEngine._apply, AsyncLLMEngine._dispatch = submit, apply, dispatch
        LLMEngine.step = step
    return undo


async def run(args: argparse.Namespace, marks: Marks) -> list[dict[str, float]]:
    from aiohttp.test_utils import TestClient, TestServer

    from engine import AsyncLLMEngine, LLMEngine
    from launch.metrics import ServerMetrics
    from launch.options import build_executor, engine_config, start_executor
    from launch.server import ServerState, build_app

    executor, _ = build_executor(args)
    start_executor(executor, args)
    metrics = ServerMetrics()
    state = ServerState(engine=AsyncLLMEngine(LLMEngine(executor, engine_config(args)), metrics), metrics=metrics,
                        model_name=args.model, tokenizer=None)
    state.engine.start()
    rng = np.random.default_rng(0)
    vocab = executor.model_config.vocab_size
    sent: list[tuple[float, float]] = []
    try:
        async with TestClient(TestServer(build_app(state), host="127.0.0.1")) as client:
            for _ in range(args.requests):
                body = {"prompt": rng.integers(1, vocab, args.prompt_len).tolist(), "max_tokens": args.max_tokens,
                        "stream": True, "temperature": 0}
                t0 = time.perf_counter()
                r = await client.post("/v1/completions", json=body)
                if r.status != 200:
                    raise SystemExit(f"HTTP {r.status}: {(await r.read())[:300]!r}")
                first = None
                async for line in r.content:
                    if first is None and line.startswith(b"data:"):
                        first = time.perf_counter()
                sent.append((t0, first))
    finally:
        state.engine.shutdown()
        if hasattr(executor, "shutdown"):
            executor.shutdown()
    rows = []
    for (t0, first), m in zip(sent, marks.at.values()):  # request ids in submission order (dicts keep it)
        rows.append({"http_in": m["submit"] - t0, "to_engine": m["engine_got"] - m["submit"], "step": m["step_s"],
                     "engine_overhead": m["step_end"] - m["engine_got"] - m["step_s"],
                     "to_dispatch": m["dispatch"] - m["step_end"], "to_client": first - m["dispatch"],
                     "ttft": first - t0})
    return rows[args.warmup:]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from launch.options import add_model_args

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(p, executor_default="local")
    p.add_argument("--requests", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    args.no_progress = True
    marks = Marks()
    undo = instrument(marks)
    try:
        rows = asyncio.run(run(args, marks))
    finally:
        undo()
    med = {k: 1e3 * statistics.median(r[k] for r in rows) for k in SEGMENTS}
    print(f"ttft_trace {args.model} ({args.device}), {len(rows)} requests of {args.prompt_len} prompt tokens, "
          "median ms:")
    for k in SEGMENTS:
        print(f"  {k:16s} {med[k]:8.3f}")
    result = {"model": args.model, "device": args.device, "prompt_len": args.prompt_len, "median_ms": med,
              "rows": rows}
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
