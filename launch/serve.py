"""`graphline serve`: start the executor (start-up capture with a progress bar), then the HTTP server.

Prints `graphline: serving MODEL on http://HOST:PORT` once requests are accepted (with
`--port 0` the line carries the port the OS chose). SIGINT/SIGTERM stop it cleanly.
"""
from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time

from launch.options import (add_model_args, build_executor, checkpoint_generation_defaults, deployment_summary,
                            engine_config, load_tokenizer, served_model_name, start_executor)
from launch.reasoning import REASONING_PARSERS, ReasoningParserError, think_tags
from launch.tools import TOOL_CALL_PARSERS


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve OpenAI-compatible completions over HTTP (+ /metrics, /status, /dashboard)")
    add_model_args(p, executor_default="ray")
    s = p.add_argument_group("HTTP server")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000, help="0 = any free port (printed on start)")
    s.add_argument("--served-model-name", default=None, help="the 'model' clients send (default: preset or dir name)")
    s.add_argument("--admin-token-file", default=None, metavar="PATH",
                   help="require 'Authorization: Bearer TOKEN' on /admin/*, TOKEN read from PATH (also: the "
                        "GRAPHLINE_ADMIN_TOKEN environment variable); needed when --host is not a loopback address")
    s.add_argument("--admin-token", default=None,
                   help="the admin token itself (visible to every user of the machine in `ps`: prefer "
                        "--admin-token-file)")
    s.add_argument("--api-key-file", default=None, metavar="PATH",
                   help="require 'Authorization: Bearer KEY' on /v1/* (the OpenAI client's api_key), KEY read from "
                        "PATH (also: the GRAPHLINE_API_KEY environment variable); /health, /status, /metrics and "
                        "the dashboard stay open")
    s.add_argument("--api-key", default=None,
                   help="the API key itself (visible to every user of the machine in `ps`: prefer --api-key-file)")
    s.add_argument("--allowed-origins", default=None, metavar="ORIGINS",
                   help="comma-separated origins (e.g. https://app.example.com) whose web pages may call /v1/*, "
                        "/tokenize and /detokenize from a browser, or '*' for any; default: none (same origin only)")
    s.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=None,
                   help="chat completions return the model's think block (<think> ... </think>) as "
                        "message.reasoning_content (streamed: delta.reasoning_content) and the rest as content")
    s.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
                   help="chat completions with 'tools' return the model's <tool_call> JSON blocks (Hermes format: "
                        "Qwen3 and others) as message.tool_calls, finish_reason tool_calls")
    s.add_argument("--max-concurrent-requests", type=int, default=None, metavar="N",
                   help="engine requests (a request's n choices count n) the server holds at once, running and "
                        "waiting; more are refused with 429 and Retry-After until some finish. Default: 4 x the "
                        "running sequences all DP ranks can hold, at least 256")
    s.add_argument("--responses-store", type=int, default=0, metavar="N",
                   help="keep the last N /v1/responses answers in memory for previous_response_id and GET / DELETE "
                        "/v1/responses/{id}; default 0: none kept")
    s.add_argument("--chat-template", default=None, metavar="TEMPLATE",
                   help="a Jinja chat template (a file, or the template text itself) that replaces the checkpoint's "
                        "for chat completions, /v1/responses and /tokenize; needs a checkpoint with a tokenizer")
    s.add_argument("--metrics-interval-s", type=float, default=5.0,
                   help="refresh of status-derived Ray metrics (ray.util.metrics) when Ray is up")
    p.set_defaults(func=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    from engine.async_engine import AsyncLLMEngine
    from engine.llm_engine import LLMEngine
    from launch.metrics import ServerMetrics
    from launch.responses_store import ResponseStore
    from launch.server import ServerState

    from launch.admin import is_loopback, require_token_off_loopback, resolve_admin_token
    from launch.cors import OriginsError, parse_origins
    from launch.credentials import API_KEY, CredentialError
    from launch.options import LaunchError
    from launch.chat import ChatTemplateError, set_chat_template

    try:  # before anything starts: a bad security configuration fails in milliseconds
        admin_token = resolve_admin_token(args.admin_token, args.admin_token_file)
        require_token_off_loopback(args.host, admin_token)
        api_key = API_KEY.resolve(args.api_key, args.api_key_file)
        allowed_origins = parse_origins(args.allowed_origins)
    except (CredentialError, OriginsError) as exc:
        raise LaunchError(str(exc)) from None
    if args.max_concurrent_requests is not None and args.max_concurrent_requests < 1:
        raise LaunchError(f"--max-concurrent-requests must be >= 1, got {args.max_concurrent_requests}")
    if args.responses_store < 0:
        raise LaunchError(f"--responses-store must be >= 0, got {args.responses_store}")
    if api_key is None and not is_loopback(args.host):
        print(f"graphline: warning: --host {args.host} is not a loopback address and no API key is configured: "
              f"/v1/* answers anyone who reaches the port (pass --api-key-file PATH or set GRAPHLINE_API_KEY)",
              file=sys.stderr, flush=True)
    tokenizer = load_tokenizer(args.model)
    if args.chat_template is not None:
        try:  # before any rank starts: a broken template fails in a second
            print(f"graphline: chat template from {set_chat_template(tokenizer, args.chat_template)}", flush=True)
        except ChatTemplateError as exc:
            raise LaunchError(str(exc)) from None
    if args.reasoning_parser is not None:
        try:  # before any rank starts: a checkpoint without think tags fails in a second
            think_tags(tokenizer, args.reasoning_parser)
        except ReasoningParserError as exc:
            raise LaunchError(str(exc)) from None
    t0 = time.perf_counter()
    _log_events_to_stderr()
    # The engine thread and the HTTP event loop share the GIL: a 0.5 ms switch interval (CPython's default is
    # 5 ms) bounds how long a finished step waits for a busy event loop to let the engine thread run.
    sys.setswitchinterval(5e-4)
    executor, kind = build_executor(args)
    try:
        timings = start_executor(executor, args)
        defaults = checkpoint_generation_defaults(args.model, executor.model_config)
        engine = LLMEngine(executor, engine_config(args, defaults.get("eos_token_id", ())))
        metrics = ServerMetrics()  # after start: Ray is initialised by then (ray.util.metrics mirror)
        state = ServerState(
            engine=AsyncLLMEngine(engine, metrics, max_in_flight=max_concurrent_requests(args, engine)),
            metrics=metrics, model_name=served_model_name(args),
            model_aliases=(args.model,) if args.model != served_model_name(args) else (),
            tokenizer=tokenizer, deployment=deployment_summary(args, kind),
            startup={"executor": timings, "engine_ready_s": time.perf_counter() - t0}, admin_token=admin_token,
            api_key=api_key, allowed_origins=allowed_origins, generation_defaults=defaults,
            reasoning_parser=args.reasoning_parser, tool_call_parser=args.tool_call_parser,
            responses_store=ResponseStore(args.responses_store) if args.responses_store else None,
        )
        asyncio.run(_serve(state, args, t0))
    finally:
        shutdown = getattr(executor, "shutdown", None)
        if shutdown is not None:
            shutdown()
    return 0


def max_concurrent_requests(args: argparse.Namespace, engine) -> int:
    """`--max-concurrent-requests`, or its default: 4 x max_num_seqs x DP ranks, at least 256."""
    if args.max_concurrent_requests is not None:
        return args.max_concurrent_requests
    return max(256, 4 * engine.sched_config.max_num_seqs * len(engine.schedulers))


def _log_events_to_stderr() -> None:
    """Operator events (`engine.events`: rank failures, rebuilds, resets, engine errors): one line each on stderr."""
    import logging

    from engine.events import EVENTS

    if not EVENTS.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s graphline %(levelname)s %(message)s"))
        EVENTS.addHandler(handler)
        EVENTS.setLevel(logging.INFO)
        EVENTS.propagate = False


async def _serve(state, args: argparse.Namespace, t0: float) -> None:
    from aiohttp import web

    from launch.server import build_app, current_status

    state.engine.start()
    runner = web.AppRunner(build_app(state), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    state.ready_at = time.time()
    state.startup["ready_s"] = time.perf_counter() - t0
    lim = state.engine.engine.limits
    print(f"graphline: serving {state.model_name} on http://{args.host}:{port} "
          f"(executor {state.deployment['executor']}, tp={args.tp} dp={args.dp} ep={args.ep}, "
          f"{lim.num_kv_blocks} KV blocks x {lim.block_size} per DP rank, ready in {state.startup['ready_s']:.1f} s)",
          flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    async def refresh_ray_metrics() -> None:
        while state.metrics.ray is not None:
            await asyncio.sleep(args.metrics_interval_s)
            await current_status(state)

    refresher = asyncio.create_task(refresh_ray_metrics())
    try:
        await stop.wait()
    finally:
        print("graphline: shutting down", file=sys.stderr, flush=True)
        refresher.cancel()
        await runner.cleanup()
        state.engine.shutdown()
