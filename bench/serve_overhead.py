"""What the serving layer itself costs per output token: the HTTP server, the async engine and the
scheduler around an executor without a model, with streaming clients.

    python -m bench.serve_overhead --step-ms 2.0 --concurrency 1,16,64 --out artifacts/serve_overhead.json

The executor returns token 7 for every sequence after sleeping `--step-ms` (the GIL is free meanwhile,
as when the engine thread waits for the ranks' replies), so a step is paced like a GPU decode step and
time per output token (TPOT) minus the step time is what the layer adds: scheduling, token
bookkeeping, delivery to the event loop and server-sent events that do not fit in the step's shadow.
The server runs in a child process (its own GIL, like `graphline serve`); the clients run here.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import sys
import time
from pathlib import Path
from typing import Optional

import numpy as np

from launch.bench import run_level


class InstantExecutor:
    """The engine's executor surface with no model: every sequence's next token is 7, after `step_s` a step."""

    def __init__(self, step_s: float = 0.0, max_model_len: int = 65536, num_kv_blocks: int = 100000,
                 block_size: int = 64):
        from engine.testing import ToyModelConfig

        self.step_s = step_s
        self.model_config = ToyModelConfig(1000, max_model_len)
        self.max_model_len, self.num_kv_blocks, self.block_size, self.dp_size = (max_model_len, num_kv_blocks,
                                                                                 block_size, 1)

    def step(self, batches, num_steps: int = 1):
        if self.step_s:
            time.sleep(self.step_s * num_steps)
        shape = (lambda b: (b.batch_size,)) if num_steps == 1 else (lambda b: (b.batch_size, num_steps))
        return [None if b is None else np.full(shape(b), 7, dtype=np.int64) for b in batches]

    def status(self) -> dict:
        return {"executor": "instant", "ranks": []}

    def reset(self, recapture: bool = True, num_kv_blocks: Optional[int] = None, reload_weights: bool = False):
        return {}


def _serve(port_q, decode_steps: int, step_s: float) -> None:
    from aiohttp import web

    from engine.async_engine import AsyncLLMEngine
    from engine.llm_engine import EngineConfig, LLMEngine
    from launch.metrics import ServerMetrics
    from launch.server import ServerState, build_app

    sys.setswitchinterval(5e-4)  # as `graphline serve` does

    async def main() -> None:
        engine = LLMEngine(InstantExecutor(step_s), EngineConfig(max_num_seqs=256, decode_steps=decode_steps))
        metrics = ServerMetrics()
        state = ServerState(engine=AsyncLLMEngine(engine, metrics), metrics=metrics, model_name="instant",
                            deployment={"executor": "instant"})
        state.engine.start()
        runner = web.AppRunner(build_app(state), handler_cancellation=True, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        state.ready_at = time.time()
        port_q.put(site._server.sockets[0].getsockname()[1])
        await asyncio.Event().wait()

    asyncio.run(main())


def main(argv: Optional[list[str]] = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", default="1,16,64")
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--decode-steps", type=int, default=1)
    p.add_argument("--step-ms", type=float, default=2.0, help="simulated device time of one decode step")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_serve, args=(q, args.decode_steps, args.step_ms / 1e3), daemon=True)
    proc.start()
    try:
        url = f"http://127.0.0.1:{q.get(timeout=120)}"
        asyncio.run(run_level(url, "instant", 1, 1, args.prompt_len, 8, 1000))  # warm-up
        levels = []
        for c in (int(x) for x in args.concurrency.split(",") if x):
            lv = asyncio.run(run_level(url, "instant", c, args.requests_per_client, args.prompt_len, args.max_tokens,
                                       1000))
            levels.append(lv)
            lv["overhead_ms_per_token"] = lv["tpot_ms_median"] - args.step_ms
            print(f"{c:4d} clients: TPOT median {lv['tpot_ms_median']:.3f} ms (step {args.step_ms:.2f} ms: "
                  f"{lv['overhead_ms_per_token']:+.3f} ms over it), {lv['throughput_tok_s']:.0f} tok/s, "
                  f"{lv['tokens_per_event']:.2f} tokens per event", flush=True)
    finally:
        proc.terminate()
        proc.join(10)
    result = {"decode_steps": args.decode_steps, "levels": levels, "args": vars(args)}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
