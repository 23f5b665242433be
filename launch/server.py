"""The HTTP server (aiohttp): OpenAI-compatible completions, health, status, metrics, the operator
dashboard and the admin reset. One `AsyncLLMEngine` behind it; every handler is async and never
touches the executor directly (executor calls run in the engine thread)."""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from aiohttp import web

from engine.async_engine import AsyncLLMEngine, EngineFailedError
from engine.request import RequestError, RequestOutput, new_request_id
from launch.metrics import CONTENT_TYPE, ServerMetrics
from launch.protocol import (ApiError, IncrementalDetokenizer, choice, completion_response, decode_text, now_s,
                             parse_completion_request, stream_chunk)
from launch.status import build_status

STATIC_DIR = Path(__file__).parent / "static"


@dataclass
class ServerState:
    engine: AsyncLLMEngine
    metrics: ServerMetrics
    model_name: str
    model_aliases: tuple[str, ...] = ()
    tokenizer: Any = None
    deployment: dict = field(default_factory=dict)
    startup: dict = field(default_factory=dict)
    admin_token: Optional[str] = None
    started_at: float = field(default_factory=time.time)
    ready_at: Optional[float] = None

    @property
    def served_names(self) -> tuple[str, ...]:
        return (self.model_name, *self.model_aliases)


STATE = web.AppKey("graphline_state", ServerState)


def _error(status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
           type_: str = "invalid_request_error") -> web.Response:
    return web.json_response(ApiError(status, message, param, code, type_).body(), status=status)


@web.middleware
async def _errors(request: web.Request, handler):
    state: ServerState = request.app[STATE]
    endpoint = request.match_info.route.resource.canonical if request.match_info.route.resource else "unmatched"
    try:
        resp = await handler(request)
    except ApiError as exc:
        resp = web.json_response(exc.body(), status=exc.status)
    except RequestError as exc:
        resp = _error(400, str(exc), exc.param, exc.code)
    except EngineFailedError as exc:
        resp = _error(503, str(exc), None, "engine_failed", "server_error")
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        resp = _error(exc.status, exc.reason or "error", None, None,
                      "invalid_request_error" if exc.status < 500 else "server_error")
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception as exc:  # noqa: BLE001 - one request's bug never stops the server
        resp = _error(500, f"internal error: {type(exc).__name__}: {exc}", None, "internal_error", "server_error")
    state.metrics.http_request(endpoint, resp.status)
    return resp


async def _json_body(request: web.Request) -> Any:
    raw = await request.read()
    if not raw:
        raise ApiError(400, "the request body is empty; send a JSON object", None, "invalid_json")
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"malformed JSON: {exc}", None, "invalid_json") from exc


# ---- completions
async def completions(request: web.Request) -> web.StreamResponse:
    state: ServerState = request.app[STATE]
    creq = parse_completion_request(await _json_body(request), state.served_names, state.tokenizer)
    eng = state.engine
    reqs = [eng.make_request(p, creq.sampling, creq.max_tokens, creq.stop_token_ids) for p in creq.prompts]
    rid, created = new_request_id(), now_s()
    if creq.stream:
        return await _stream(request, state, creq, reqs, rid, created)
    streams = []
    try:
        for r in reqs:
            streams.append(eng.submit(r))
        outs = await asyncio.gather(*[_last(s) for s in streams])
    finally:
        for s in streams:
            if not s.finished:
                eng.abort(s.request_id)
    texts = [decode_text(state.tokenizer, o.token_ids) for o in outs]
    return web.json_response(completion_response(rid, creq.model, created, outs, texts))


async def _last(stream) -> RequestOutput:
    last = None
    async for out in stream:
        last = out
    return last


class _ChunkWriter:
    """Server-sent completion chunks of one response: the envelope (id, object, created, model) is serialised
    once; each event serialises only its choices."""

    def __init__(self, resp: web.StreamResponse, rid: str, model: str, created: int):
        self.resp = resp
        head = json.dumps(stream_chunk(rid, model, created, []))
        self._head = "data: " + head[: head.rindex('"choices": []')] + '"choices": ['

    async def choices(self, choices: list[dict], usage: Optional[dict] = None) -> None:
        tail = "]" if usage is None else '], "usage": ' + json.dumps(usage)
        await self.resp.write((self._head + ", ".join(json.dumps(c) for c in choices) + tail + "}\n\n").encode())

    async def error(self, exc: BaseException) -> None:
        err = ApiError(503, str(exc), None, "engine_failed", "server_error").body()
        await self.resp.write(f"data: {json.dumps(err)}\n\n".encode())


def _delta(outs: list[RequestOutput], detok: "IncrementalDetokenizer", index: int) -> tuple[dict, RequestOutput]:
    new = outs[0].new_token_ids if len(outs) == 1 else [t for o in outs for t in o.new_token_ids]
    last = outs[-1]
    reason = last.finish_reason.value if last.finished and last.finish_reason else None
    return choice(index, detok.push(new, final=last.finished), new, reason), last


async def _stream(request: web.Request, state: ServerState, creq, reqs, rid: str, created: int) -> web.StreamResponse:
    eng = state.engine
    streams = [eng.submit(r) for r in reqs]  # validated already: submit only fails if the engine is dead
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                       "X-Accel-Buffering": "no"})
    await resp.prepare(request)
    out = _ChunkWriter(resp, rid, creq.model, created)
    detok = [IncrementalDetokenizer(state.tokenizer) for _ in reqs]
    finals: list[Optional[RequestOutput]] = [None] * len(reqs)
    try:
        if len(streams) == 1:  # the common case: read the request's stream directly, one task, no fan-in queue
            try:
                async for first in streams[0]:
                    ch, last = _delta([first, *streams[0].drain_nowait()], detok[0], 0)
                    await out.choices([ch])
                    if last.finished:
                        finals[0] = last
            except Exception as exc:  # noqa: BLE001 - reported in-band
                await out.error(exc)
        else:
            await _stream_many(streams, detok, finals, out)
        if creq.include_usage:
            done = [o for o in finals if o is not None]
            p, c = sum(o.num_prompt_tokens for o in done), sum(len(o.token_ids) for o in done)
            await out.choices([], {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c})
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
    finally:
        for s in streams:
            if not s.finished:
                eng.abort(s.request_id)
    return resp


async def _stream_many(streams, detok, finals, out: _ChunkWriter) -> None:
    """Several prompts in one request: their streams fan in to one queue, chunks go out as they come."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream) -> None:
        try:
            async for first in stream:
                queue.put_nowait((index, first, stream.drain_nowait()))
        except Exception as exc:  # noqa: BLE001 - reported in-band
            queue.put_nowait((index, exc, []))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            index, first, more = await queue.get()
            if isinstance(first, Exception):
                await out.error(first)
                remaining -= 1
                continue
            ch, last = _delta([first, *more], detok[index], index)
            await out.choices([ch])
            if last.finished:
                finals[index] = last
                remaining -= 1
    finally:
        for t in tasks:
            t.cancel()


# ---- models, health, status, metrics
async def models(request: web.Request) -> web.Response:
    state: ServerState = request.app[STATE]
    data = [{"id": state.model_name, "object": "model", "created": int(state.started_at), "owned_by": "graphline",
             "max_model_len": state.engine.engine.limits.max_model_len}]
    return web.json_response({"object": "list", "data": data})


async def health(request: web.Request) -> web.Response:
    """Readiness: 200 only while the engine runs and every rank can serve; 503 with the reason while a rank is
    dead, hung or being rebuilt (read from the executor's watcher, never waiting for a step)."""
    state: ServerState = request.app[STATE]
    h = state.engine.health()
    if not h["ok"]:
        return web.json_response({"status": "unhealthy", "reason": h["reason"], "ranks": h["ranks"]}, status=503)
    return web.json_response({"status": "ok", "model": state.model_name, "uptime_s": time.time() - state.started_at})


async def live(request: web.Request) -> web.Response:
    """Liveness: 200 while this process serves HTTP, whatever the ranks do."""
    return web.json_response({"status": "alive", "uptime_s": time.time() - request.app[STATE].started_at})


async def current_status(state: ServerState) -> dict:
    try:
        raw = await state.engine.executor_status()
    except Exception as exc:  # noqa: BLE001 - status must answer while the engine is broken
        raw = {"error": f"{type(exc).__name__}: {exc}"}
    doc = build_status(raw, state.engine.stats(), {
        "model": state.model_name, "health": _health_word(state),
        "deployment": state.deployment, "startup": state.startup, "started_at": state.started_at,
        "uptime_s": time.time() - state.started_at, "tokenizer": state.tokenizer is not None,
    }, list(state.engine.reset_log), list(state.engine.failure_log))
    state.metrics.update_status(doc)
    return doc


def _health_word(state: ServerState) -> str:
    h = state.engine.health()
    return "ok" if h["ok"] else (h["reason"] or "unhealthy")


async def status(request: web.Request) -> web.Response:
    return web.json_response(await current_status(request.app[STATE]), dumps=lambda o: json.dumps(o, default=str))


async def metrics(request: web.Request) -> web.Response:
    state: ServerState = request.app[STATE]
    await current_status(state)
    return web.Response(body=state.metrics.exposition(), headers={"Content-Type": CONTENT_TYPE})


# ---- admin
async def admin_reset(request: web.Request) -> web.Response:
    state: ServerState = request.app[STATE]
    if state.admin_token and request.headers.get("Authorization", "") != f"Bearer {state.admin_token}":
        raise ApiError(401, "admin endpoints need 'Authorization: Bearer <admin token>'", None, "unauthorized")
    body = await _json_body(request) if request.can_read_body else {}
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", None, "invalid_json")
    recapture = body.get("recapture", True)
    reload_weights = body.get("reload_weights", False)
    num_kv_blocks = body.get("num_kv_blocks")
    if not isinstance(recapture, bool) or not isinstance(reload_weights, bool):
        raise ApiError(400, "'recapture' and 'reload_weights' must be booleans", None, "invalid_type")
    if num_kv_blocks is not None and (not isinstance(num_kv_blocks, int) or isinstance(num_kv_blocks, bool)
                                      or num_kv_blocks < 2):
        raise ApiError(400, "'num_kv_blocks' must be an integer >= 2", "num_kv_blocks", "invalid_value")
    result = await state.engine.reset(recapture=recapture, num_kv_blocks=num_kv_blocks, reload_weights=reload_weights)
    return web.json_response({"status": "ok", "result": result}, dumps=lambda o: json.dumps(o, default=str))


# ---- dashboard
async def dashboard(request: web.Request) -> web.FileResponse:
    return web.FileResponse(STATIC_DIR / "dashboard.html")


async def index(request: web.Request) -> web.Response:
    raise web.HTTPFound("/dashboard")


def build_app(state: ServerState) -> web.Application:
    app = web.Application(middlewares=[_errors], client_max_size=16 * 1024 * 1024)
    app[STATE] = state
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/health/live", live)
    app.router.add_get("/status", status)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/admin/reset", admin_reset)
    app.router.add_get("/dashboard", dashboard)
    app.router.add_get("/", index)
    app.router.add_static("/static/", STATIC_DIR, show_index=False)
    return app
