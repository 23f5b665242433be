"""The HTTP server (aiohttp): OpenAI-compatible completions and chat completions, models, health,
status, metrics, the operator dashboard and the admin reset. One `AsyncLLMEngine` behind it; every
handler is async and never touches the executor directly (executor calls run in the engine thread).
Requests are parsed and bounded completely (`launch.protocol`, `launch.chat`) before submission."""
from __future__ import annotations

import asyncio
import concurrent.futures
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from aiohttp import web

from engine.async_engine import AsyncLLMEngine, EngineBusyError, EngineFailedError
from engine.errors import RequestError
from engine.request import new_request_id
from launch.admin import check_admin_request
from launch.chat import parse_chat_request
from launch.cors import preflight, response_headers
from launch.credentials import check_api_key
from launch.defaults import GenerationDefaults
from launch.generation import ENGINE_FAILED, Shape, generate, log_failure
from launch.metrics import CONTENT_TYPE, ServerMetrics
from launch.json_body import parse_json_body
from launch.completions import parse_completion_request
from launch.protocol import ApiError, GenerationRequest, ParseContext, ProtocolLimits, now_s
from launch.reasoning import ThinkTags, think_tags
from launch.responses import new_id, parse_responses_request
from launch.responses_background import BackgroundResponses
from launch.responses_store import ResponseStore
from launch.responses_stream import ResponsesShape
from launch.status import build_status
from launch.structured import GrammarCompiler
from launch.tokenize_api import detokenize, tokenize

STATIC_DIR = Path(__file__).parent / "static"


@dataclass
class ServerState:
    """Everything the handlers share. `generation_defaults`: values for fields a request omits (e.g. the
    checkpoint's generation_config.json; see `launch.defaults`), validated here (`GenerationDefaultsError`)."""

    engine: AsyncLLMEngine
    metrics: ServerMetrics
    model_name: str
    model_aliases: tuple[str, ...] = ()
    tokenizer: Any = None
    deployment: dict = field(default_factory=dict)
    startup: dict = field(default_factory=dict)
    admin_token: Optional[str] = None
    api_key: Optional[str] = None  # when set, every request under /v1/ needs it (`launch.credentials`)
    allowed_origins: tuple[str, ...] = ()  # origins whose pages may call the API (`launch.cors`); () = none
    started_at: float = field(default_factory=time.time)
    ready_at: Optional[float] = None
    generation_defaults: Optional[dict] = None
    limits: ProtocolLimits = field(default_factory=ProtocolLimits)
    reasoning_parser: Optional[str] = None  # `launch.reasoning.REASONING_PARSERS`: chat returns reasoning_content
    tool_call_parser: Optional[str] = None  # `launch.tools.TOOL_CALL_PARSERS`: chat may return tool_calls
    responses_store: Optional[ResponseStore] = None  # `--responses-store N`: stored /v1/responses (None: off)
    defaults: GenerationDefaults = field(init=False)
    think_tags: Optional[ThinkTags] = field(init=False, default=None)
    tokenize_pool: Optional[concurrent.futures.ThreadPoolExecutor] = field(init=False, default=None)
    grammars: Optional[GrammarCompiler] = field(init=False, default=None)  # `response_format` (with a tokenizer)
    background: BackgroundResponses = field(init=False, default_factory=BackgroundResponses)

    def __post_init__(self) -> None:
        self.defaults = GenerationDefaults(self.generation_defaults)
        if self.reasoning_parser is not None:
            self.think_tags = think_tags(self.tokenizer, self.reasoning_parser)
        if self.tokenizer is not None:  # large texts are tokenised off the event loop (tokenizers drop the GIL)
            self.tokenize_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="graphline-tokenize")
            vocab = self.engine.engine.limits.vocab_size
            self.grammars = GrammarCompiler(self.tokenizer, vocab, self.eos_ids_in(vocab))

    @property
    def served_names(self) -> tuple[str, ...]:
        return (self.model_name, *self.model_aliases)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Generation stops at these unless a request sets ignore_eos: the defaults' eos_token_id, else the
        tokenizer's EOS."""
        if self.defaults.eos_token_ids:
            return self.defaults.eos_token_ids
        eos = getattr(self.tokenizer, "eos_token_id", None) if self.tokenizer is not None else None
        return (eos,) if isinstance(eos, int) else ()

    def eos_ids_in(self, vocab_size: int) -> tuple[int, ...]:
        """`eos_token_ids` that are ids of the model's vocabulary."""
        return tuple(t for t in self.eos_token_ids if 0 <= t < vocab_size)

    def parse_context(self) -> ParseContext:
        lim = self.engine.engine.limits  # current: a reset may resize the KV cache
        return ParseContext(self.served_names, self.tokenizer, lim.vocab_size, lim.max_model_len,
                            lim.max_blocks_per_request * lim.block_size, self.defaults,
                            self.eos_ids_in(lim.vocab_size), self.limits,
                            self.tool_call_parser, self.grammars, self.responses_store)


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
    except EngineBusyError as exc:
        resp = _error(429, f"{exc} (graphline serve --max-concurrent-requests)", None, "server_busy",
                      "rate_limit_error")
        resp.headers["Retry-After"] = "1"
    except EngineFailedError as exc:
        log_failure("request failed", exc)
        resp = _error(503, ENGINE_FAILED, None, "engine_failed", "server_error")
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        resp = _error(exc.status, exc.reason or "error", None, None,
                      "invalid_request_error" if exc.status < 500 else "server_error")
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception as exc:  # noqa: BLE001 - one request's bug never stops the server
        ref = log_failure("handler error", exc)
        resp = _error(500, f"internal server error (reference {ref})", None, "internal_error", "server_error")
    state.metrics.http_request(endpoint, resp.status)
    return resp


@web.middleware
async def _cors_preflight(request: web.Request, handler):
    if request.method == "OPTIONS":
        headers = preflight(request.path, request.headers, request.app[STATE].allowed_origins)
        if headers is not None:
            return web.Response(status=204, headers=headers)
    return await handler(request)


async def _cors_headers(request: web.Request, response: web.StreamResponse) -> None:
    """Every response (streams and errors too), before its headers go out."""
    response.headers.update(response_headers(request.path, request.headers, request.app[STATE].allowed_origins))


@web.middleware
async def _api_key_auth(request: web.Request, handler):
    check_api_key(request.path, request.method, request.headers, request.app[STATE].api_key)
    return await handler(request)


PARSE_INLINE_BYTES = 32 * 1024  # larger bodies with a tokenizer are parsed (tokenised, templated) in a worker


async def _parse(request: web.Request, state: ServerState, parser) -> GenerationRequest:
    raw = await _raw_body(request, state.limits)
    body = parse_json_body(raw, request.headers.get("Content-Type", ""), state.limits)
    ctx = state.parse_context()
    if state.tokenize_pool is None or len(raw) < PARSE_INLINE_BYTES:
        return parser(body, ctx)
    return await asyncio.get_running_loop().run_in_executor(state.tokenize_pool, parser, body, ctx)


async def _raw_body(request: web.Request, limits: ProtocolLimits) -> bytes:
    if request.content_length is not None and request.content_length > limits.max_body_bytes:
        raise ApiError(413, f"the request body exceeds {limits.max_body_bytes} bytes", None, "body_too_large")
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise ApiError(413, f"the request body exceeds {limits.max_body_bytes} bytes", None,
                       "body_too_large") from None


# ---- completions and chat
async def _parse_generation(request: web.Request, state: ServerState, parser) -> Any:
    """`parser`'s parse of the request: a `GenerationRequest`, or an object holding one as `greq`."""
    parsed = await _parse(request, state, parser)
    greq = getattr(parsed, "greq", parsed)
    if greq.grammar is not None:
        state.metrics.structured_request(greq.grammar.kind)
    return parsed


async def completions(request: web.Request) -> web.StreamResponse:
    state: ServerState = request.app[STATE]
    greq = await _parse_generation(request, state, parse_completion_request)
    return await generate(request, state.engine, state.tokenizer, greq, new_request_id(),
                          Shape(False, state.tokenizer))


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state: ServerState = request.app[STATE]
    greq = await _parse_generation(request, state, parse_chat_request)
    return await generate(request, state.engine, state.tokenizer, greq, "chat" + new_request_id(),
                          Shape(True, state.tokenizer, state.think_tags, greq.tool_choice))


async def responses(request: web.Request) -> web.StreamResponse:
    state: ServerState = request.app[STATE]
    rreq = await _parse_generation(request, state, parse_responses_request)
    greq, rid = rreq.greq, new_id("resp")
    shape = ResponsesShape(state.tokenizer, state.think_tags, greq.tool_choice, rreq.echo,
                           rreq.keeper(state.responses_store))
    if rreq.echo["background"]:  # answered now, generated by a task of the server's (`launch.responses_background`)
        run = lambda: generate(None, state.engine, state.tokenizer, greq, rid, shape)  # noqa: E731
        return web.json_response(state.background.start(state.responses_store, rid, now_s(), rreq.echo,
                                                        rreq.conversation, run))
    return await generate(request, state.engine, state.tokenizer, greq, rid, shape)


async def cancel_response(request: web.Request) -> web.Response:
    store, rid = _stored(request)
    state: ServerState = request.app[STATE]
    if not await state.background.cancel(rid):
        if store.get(rid) is None:
            raise ApiError(404, f"no stored response {rid[:80]!r}", None, "response_not_found")
        raise ApiError(400, "only a background response in progress can be cancelled", None, "invalid_state")
    return web.json_response(store.get(rid)[0])


def _stored(request: web.Request) -> tuple[ResponseStore, str]:
    state: ServerState = request.app[STATE]
    rid = request.match_info["response_id"]
    if state.responses_store is None:
        raise ApiError(404, "responses are not stored by this server (graphline serve --responses-store N)", None,
                       "response_not_found")
    return state.responses_store, rid


async def get_response(request: web.Request) -> web.Response:
    store, rid = _stored(request)
    hit = store.get(rid)
    if hit is None:
        raise ApiError(404, f"no stored response {rid[:80]!r}", None, "response_not_found")
    return web.json_response(hit[0])


async def delete_response(request: web.Request) -> web.Response:
    store, rid = _stored(request)
    if not store.delete(rid):
        raise ApiError(404, f"no stored response {rid[:80]!r}", None, "response_not_found")
    return web.json_response({"id": rid, "object": "response.deleted", "deleted": True})


async def tokenize_route(request: web.Request) -> web.Response:
    state: ServerState = request.app[STATE]
    return web.json_response(await _parse(request, state, tokenize))


async def detokenize_route(request: web.Request) -> web.Response:
    state: ServerState = request.app[STATE]
    return web.json_response(await _parse(request, state, detokenize))


# ---- models, health, status, metrics
def _model_card(state: ServerState, name: str) -> dict:
    return {"id": name, "object": "model", "created": int(state.started_at), "owned_by": "graphline",
            "root": state.model_name, "max_model_len": state.engine.engine.limits.max_model_len,
            "generation_defaults": state.defaults.in_force()}


async def models(request: web.Request) -> web.Response:
    state: ServerState = request.app[STATE]
    return web.json_response({"object": "list", "data": [_model_card(state, state.model_name)]})


async def model(request: web.Request) -> web.Response:
    state: ServerState = request.app[STATE]
    name = request.match_info["model_id"]
    if name not in state.served_names:
        shown = name if len(name) <= 256 else name[:40] + "..."
        raise ApiError(404, f"the model '{shown}' does not exist; this server serves '{state.model_name}'", "model",
                       "model_not_found")
    return web.json_response(_model_card(state, name))


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
        "admin_auth": state.admin_token is not None, "api_auth": state.api_key is not None,
        "admission": {"in_flight": state.engine.in_flight, "max_in_flight": state.engine.max_in_flight},
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
    check_admin_request(request.method, request.headers, request.scheme, state.admin_token)
    raw = await request.read() if request.can_read_body else b""
    body = parse_json_body(raw, request.headers.get("Content-Type", ""), state.limits) if raw.strip() else {}
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", None, "invalid_json")
    recapture = body.get("recapture", True)
    reload_weights = body.get("reload_weights", False)
    num_kv_blocks = body.get("num_kv_blocks")
    if not isinstance(recapture, bool) or not isinstance(reload_weights, bool):
        raise ApiError(400, "'recapture' and 'reload_weights' must be booleans", None, "invalid_type")
    if num_kv_blocks is not None and (type(num_kv_blocks) is not int or not 2 <= num_kv_blocks <= 2**31 - 1):
        raise ApiError(400, "'num_kv_blocks' must be an integer in [2, 2147483647]", "num_kv_blocks",
                       "invalid_value")
    result = await state.engine.reset(recapture=recapture, num_kv_blocks=num_kv_blocks, reload_weights=reload_weights)
    return web.json_response({"status": "ok", "result": result}, dumps=lambda o: json.dumps(o, default=str))


# ---- dashboard
async def dashboard(request: web.Request) -> web.FileResponse:
    return web.FileResponse(STATIC_DIR / "dashboard.html")


async def index(request: web.Request) -> web.Response:
    raise web.HTTPFound("/dashboard")


def build_app(state: ServerState) -> web.Application:
    app = web.Application(middlewares=[_errors, _cors_preflight, _api_key_auth],
                          client_max_size=state.limits.max_body_bytes)
    app[STATE] = state
    app.on_response_prepare.append(_cors_headers)
    app.on_shutdown.append(lambda app: app[STATE].background.shutdown())
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/responses", responses)
    app.router.add_get("/v1/responses/{response_id}", get_response)
    app.router.add_delete("/v1/responses/{response_id}", delete_response)
    app.router.add_post("/v1/responses/{response_id}/cancel", cancel_response)
    app.router.add_post("/tokenize", tokenize_route)
    app.router.add_post("/detokenize", detokenize_route)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model_id:.+}", model)
    app.router.add_get("/health", health)
    app.router.add_get("/health/live", live)
    app.router.add_get("/status", status)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/admin/reset", admin_reset)
    app.router.add_get("/dashboard", dashboard)
    app.router.add_get("/", index)
    app.router.add_static("/static/", STATIC_DIR, show_index=False)
    return app
