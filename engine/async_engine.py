"""`AsyncLLMEngine`: the step loop in a background thread, tokens streamed to asyncio callers.

One thread owns the `LLMEngine` and the executor (executor calls are blocking and the
coordinator is not re-entrant): it applies queued submissions, aborts and commands
(`call`: reset ...) between steps, runs steps while work exists and sleeps otherwise
(`engine.streams.Wakeup`: one raw lock, one thread hand-off to wake it). Outputs go back to the
event loop once per step (`loop.call_soon_threadsafe`) into one `RequestStream` per request.

The first token's path is kept short (time to first token): a streaming handler submits with
`wake=False`, prepares its response and only then `wake()`s the engine thread, so that thread
runs to the model step without waiting for the event loop to let go of the GIL; and a step that
gives a request its first token, in a batch of at most `HANDOFF_MAX_OUTPUTS` requests, waits (at
most `first_token_handoff_s`) until the event loop has dispatched its outputs (the streams'
consumers have written them) before the engine thread runs the next step's host work, which
would otherwise hold the GIL while the event loop waits for it.

Requests are validated in the caller's thread (`submit` raises `RequestError`) before
anything reaches the engine thread.

Failures:
- an executor failure (a rank died or hung) requeues every in-flight request, rebuilds the
  executor and carries on: the requests are recomputed like a preemption and their streams
  continue with no token lost or repeated. A request fails only when it was already requeued
  once, or when the rebuild fails (the engine is then dead and refuses new requests);
- the executor's watcher (`Coordinator.fault_listeners`) reports a dead or hung rank from its
  own thread, so an idle engine rebuilds before any request arrives;
- a round the executor refuses before any rank runs it fails the requests at fault alone;
- every failure, rebuild and reset is one structured log line (`engine.events`).
State for `/health`, `/status` and `/metrics` is kept outside the engine thread: `health()` reads
the executor's watcher, `stats()` a snapshot the engine thread publishes, and `executor_status()`
a snapshot a status thread refreshes, so none of them waits for a step.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import threading
import time
from typing import Any, AsyncIterator, Callable, Optional, Sequence

from engine.engine_status import EngineStatus
from engine.events import log_event
from engine.grammar import TokenGrammar
from engine.llm_engine import EngineStepError, LLMEngine, RoundRejectedError, StepInfo
from engine.request import Request, RequestError, RequestOutput
from engine.sampling_params import SamplingParams
from engine.streams import EngineBusyError, EngineFailedError, RequestStream, Wakeup

__all__ = ["AsyncLLMEngine", "EngineFailedError", "EngineObserver", "RequestStream", "HANDOFF_MAX_OUTPUTS"]

FIRST_TOKEN_HANDOFF_S = 0.001  # the default bound of the first-token hand-off (`AsyncLLMEngine`)
HANDOFF_MAX_OUTPUTS = 4  # the first-token hand-off waits only for steps of at most this many requests' outputs


class EngineObserver:
    """Hooks called from the engine thread (metrics). Override what you need."""

    def on_step(self, info: StepInfo) -> None: ...

    def on_request_finished(self, out: RequestOutput) -> None: ...

    def on_reset(self, result: dict) -> None: ...

    def on_failure(self, message: str) -> None: ...


class AsyncLLMEngine(EngineStatus):
    """The engine thread and its streams (see the module doc); `/health`, `/status` and `/metrics` reads live in
    `engine.engine_status.EngineStatus`."""

    def __init__(self, engine: LLMEngine, observer: Optional[EngineObserver] = None,
                 first_token_handoff_s: float = FIRST_TOKEN_HANDOFF_S, max_in_flight: int = 0):
        """`first_token_handoff_s`: the longest a step that gave first tokens waits for the event loop to dispatch
        them (seconds, finite, >= 0; 0 never waits; see the module doc). `max_in_flight`: requests submitted and not
        finished that `admit` allows (0: no bound)."""
        if not isinstance(first_token_handoff_s, (int, float)) or isinstance(first_token_handoff_s, bool) \
                or not 0 <= first_token_handoff_s < float("inf"):
            raise ValueError(f"first_token_handoff_s must be a finite number >= 0, got {first_token_handoff_s!r}")
        if type(max_in_flight) is not int or max_in_flight < 0:
            raise ValueError(f"max_in_flight must be an int >= 0, got {max_in_flight!r}")
        self.max_in_flight = max_in_flight
        self.engine = engine
        self.observer = observer or EngineObserver()
        engine.on_step = self._on_step
        self._lock = threading.Lock()  # guards `_inbox`
        self._wake = Wakeup()  # the engine thread sleeps on it
        self._inbox: list[tuple] = []
        self.first_token_handoff_s = float(first_token_handoff_s)
        self._streams: dict[str, RequestStream] = {}
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._thread: Optional[threading.Thread] = None
        self._stop = False
        self.dead: Optional[str] = None
        self.recovering: Optional[str] = None  # why the executor is being rebuilt, while it is
        self.last_step_time: Optional[float] = None
        self.started_time = time.time()
        self.status_interval_s = 1.0
        self._status: tuple[float, dict] = (0.0, {})  # (monotonic time, executor status) from the status thread
        self._status_thread: Optional[threading.Thread] = None
        self._status_stop = threading.Event()
        self._status_wake = threading.Event()  # read the status now (after a rebuild or a reset)
        self._stats: dict = {}  # `LLMEngine.stats()`, published by the engine thread
        self._stats_at = 0.0
        self.reset_log: collections.deque[dict] = collections.deque(maxlen=50)  # {time, figures...}
        self.failure_log: collections.deque[dict] = collections.deque(maxlen=50)  # {time, message, rebuilt}
        listeners = getattr(engine.executor, "fault_listeners", None)
        if listeners is not None:
            listeners.append(self._on_executor_fault)
        self._publish_stats()

    # ---- life cycle
    def start(self, loop: Optional[asyncio.AbstractEventLoop] = None) -> None:
        self._loop = loop or asyncio.get_running_loop()
        try:  # the first status document, before any step can run
            self._status = (time.monotonic(), self.engine.executor.status())
        except Exception as exc:  # noqa: BLE001
            self._status = (time.monotonic(), {"error": f"{type(exc).__name__}: {exc}"})
        self._thread = threading.Thread(target=self._run, name="graphline-engine", daemon=True)
        self._thread.start()
        self._status_thread = threading.Thread(target=self._refresh_status, name="graphline-status", daemon=True)
        self._status_thread.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        self._stop = True
        self._wake.set()
        self._status_stop.set()
        self._status_wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._status_thread is not None:
            self._status_thread.join(timeout)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.dead is None

    # ---- requests (event-loop thread)
    def make_request(self, prompt_token_ids: Sequence[int], sampling: Optional[SamplingParams] = None,
                     max_tokens: Optional[int] = 16, stop_token_ids: Sequence[int] = (),
                     request_id: Optional[str] = None, grammar: Optional[TokenGrammar] = None,
                     priority: int = 0) -> Request:
        return self.engine.make_request(prompt_token_ids, sampling, max_tokens, stop_token_ids, request_id, grammar,
                                        priority)

    def make_samples(self, request: Request, n: int, fit_max_tokens: bool = False) -> list[Request]:
        """The n requests of n samples of `request`'s prompt (`LLMEngine.make_samples`); submit them in order."""
        return self.engine.make_samples(request, n, fit_max_tokens)

    @property
    def in_flight(self) -> int:
        """Requests submitted and not yet finished or aborted (event loop thread)."""
        return len(self._streams)

    def admit(self, k: int) -> None:
        """Raise `EngineBusyError` unless `k` more requests fit under `max_in_flight` (call before submitting them
        together, on the event loop thread)."""
        if self.max_in_flight and len(self._streams) + k > self.max_in_flight:
            raise EngineBusyError(len(self._streams), self.max_in_flight)

    def submit(self, request: Request, wake: bool = True) -> RequestStream:
        """Queue a validated request; raises `RequestError` (bad request) or `EngineFailedError` (dead).
        `wake=False`: leave the engine thread asleep until `wake()` (or any other submission) so that the caller
        can finish its own work on the event loop first; the request is queued either way."""
        from engine.request import validate_request

        validate_request(request, self.engine.limits)
        if self.dead is not None or self._stop:
            raise EngineFailedError(f"the engine is not serving: {self.dead or 'shutting down'}")
        if request.request_id in self._streams:
            raise RequestError(f"request id {request.request_id!r} is already in flight", "request_id")
        stream = RequestStream(request)
        self._streams[request.request_id] = stream
        self._post(("add", request), wake)
        return stream

    def wake(self) -> None:
        """Wake the engine thread for requests submitted with `wake=False`."""
        self._wake.set()

    async def generate(self, request: Request) -> AsyncIterator[RequestOutput]:
        """Stream one request's outputs; aborts it if the consumer stops early (client disconnect)."""
        stream = self.submit(request)
        try:
            async for out in stream:
                yield out
        finally:
            if not stream.finished:
                self.abort(request.request_id)

    def abort(self, request_id: str) -> None:
        if self._streams.pop(request_id, None) is not None:
            self._post(("abort", request_id))

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn()` in the engine thread between steps (it may use the executor)."""
        if self._thread is None or not self._thread.is_alive():
            raise EngineFailedError("the engine thread is not running")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._post(("call", fn, fut))
        return await asyncio.wrap_future(fut)

    async def reset(self, recapture: bool = True, num_kv_blocks: Optional[int] = None,
                    reload_weights: bool = False) -> dict:
        """Drain (finish the step in flight), preempt running sequences, reset + re-capture every rank, resume."""
        t0 = time.perf_counter()

        def run() -> dict:
            try:
                return self.engine.reset(recapture, num_kv_blocks, reload_weights)
            except Exception as exc:  # a rank failed during the reset: requeue in-flight requests, rebuild
                self._recover(f"reset failed: {type(exc).__name__}: {exc}")
                raise EngineFailedError("the reset failed; the executor was rebuilt") from exc

        result = await self.call(run)
        result = {**result, "wall_s": time.perf_counter() - t0}
        flat = {k: v for k, v in result.items() if isinstance(v, (int, float, str, bool))}
        self.reset_log.append({"time": time.time(), **flat})
        log_event("reset", **flat)
        try:  # the status after the reset, before the caller's next request reads it (off the event loop)
            self._status = (time.monotonic(), await asyncio.to_thread(self.engine.executor.status))
        except Exception:  # noqa: BLE001 - the status thread reads it again
            self._status_wake.set()
        self.observer.on_reset(result)
        return result

    # ---- engine thread
    def _post(self, item: tuple, wake: bool = True) -> None:
        with self._lock:
            self._inbox.append(item)
        if wake:
            self._wake.set()

    def _run(self) -> None:
        eng = self.engine
        while True:
            if not self._inbox and not (eng.has_unfinished() and self.dead is None):
                self._publish_stats()  # going idle: the last figures of the busy spell
            # a post after this test has set `_wake` already, so the wait returns at once: no lost wake-up
            while not self._inbox and not (eng.has_unfinished() and self.dead is None) and not self._stop:
                self._wake.wait()
            if self._stop:
                break
            with self._lock:
                inbox, self._inbox = self._inbox, []
            self._apply(inbox)
            if self.dead is not None or not eng.has_unfinished() or inbox:
                self._publish_stats()
            if self.dead is not None or not eng.has_unfinished():
                continue
            try:
                outs = eng.step()
            except EngineStepError as exc:
                self._recover(str(exc))
                continue
            except RoundRejectedError as exc:
                outs = eng.fail_rejected(exc)
                log_event("request_rejected", reason=str(exc), requests_failed=len(outs))
                self._deliver(outs)
                continue
            except Exception as exc:  # an engine bug: the requests in flight fail, the ranks are not touched
                self._on_engine_error(exc)
                continue
            self.last_step_time = time.monotonic()
            if self.last_step_time - self._stats_at > 0.05 or any(
                    o.finished or o.num_generated == len(o.new_token_ids) for o in outs):
                # a request started or finished: publish before its outputs go out, so a caller that saw them
                # sees the figures that include them
                self._publish_stats()
            if outs:
                self._deliver(outs)
        self._fail_streams("the engine stopped")

    def _apply(self, inbox: list[tuple]) -> None:
        errors: list[tuple[str, BaseException]] = []
        for item in inbox:
            kind = item[0]
            if kind == "add":
                try:
                    self.engine.add_request(item[1])
                except Exception as exc:  # e.g. limits changed by a reset since submit()
                    errors.append((item[1].request_id, exc))
            elif kind == "abort":
                self.engine.abort(item[1])
            elif kind == "fault":  # the executor's watcher: a rank of group `generation` died or hung
                reason, generation = item[1], item[2]
                if self.dead is None and getattr(self.engine.executor, "generation", generation) == generation:
                    self._recover(reason)
            elif kind == "call":
                fn, fut = item[1], item[2]
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn())
                    except BaseException as exc:  # noqa: BLE001 - handed to the caller
                        fut.set_exception(exc)
        if errors:
            self._loop.call_soon_threadsafe(self._deliver_errors, errors)

    def _on_step(self, info: StepInfo) -> None:
        try:
            self.observer.on_step(info)
        except Exception:  # noqa: BLE001 - metrics never break serving
            pass

    def _deliver(self, outs: list[RequestOutput]) -> None:
        for out in outs:
            if out.finished:
                try:
                    self.observer.on_request_finished(out)
                except Exception:  # noqa: BLE001 - metrics never break serving
                    pass
        wait = self.first_token_handoff_s
        if wait > 0 and len(outs) <= HANDOFF_MAX_OUTPUTS and any(
                o.new_token_ids and o.num_generated == len(o.new_token_ids) for o in outs):
            done = Wakeup()  # a first token: let the event loop write it before the next step takes the GIL
            self._loop.call_soon_threadsafe(self._dispatch, outs, done)
            done.wait(wait)
        else:
            self._loop.call_soon_threadsafe(self._dispatch, outs)

    def _dispatch(self, outs: list[RequestOutput], done: Optional[Wakeup] = None) -> None:
        for out in outs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            stream._put(out)
        if done is not None:  # after the consumers the outputs woke have run (and written them)
            self._loop.call_soon(done.set)

    def _deliver_errors(self, errors: list[tuple[str, BaseException]]) -> None:
        for rid, exc in errors:
            stream = self._streams.pop(rid, None)
            if stream is not None:
                stream._put(exc)

    def _on_executor_fault(self, reason: str, generation: int) -> None:
        """Called from the executor's watcher thread: wake the engine thread to rebuild (idle or not)."""
        self._post(("fault", reason, generation))

    def _recover(self, message: str) -> None:
        """An executor failure: requeue the in-flight requests, rebuild the executor, carry on. Requests fail only
        when they were already requeued once, or when the rebuild fails (then the engine is dead)."""
        eng = self.engine
        self.recovering = message
        self.observer.on_failure(message)
        in_flight = sum(len(s.running) for s in eng.schedulers)
        outs = eng.requeue_after_failure()
        log_event("rank_failure", reason=message, requeued=in_flight - len(outs), failed=len(outs))
        t0 = time.perf_counter()
        try:
            eng.rebuild()
            log_event("rebuild", ok=True, seconds=round(time.perf_counter() - t0, 3))
        except Exception as exc:  # noqa: BLE001
            self.dead = "the model executor failed and could not be restarted"
            log_event("rebuild", ok=False, seconds=round(time.perf_counter() - t0, 3),
                      error=f"{type(exc).__name__}: {exc}")
            outs += eng.fail_all(self.dead)
        self.recovering = None
        self._status_wake.set()
        self._publish_stats()
        self._deliver(outs)
        self.failure_log.append({"time": time.time(), "message": message, "rebuilt": self.dead is None,
                                 "requeued": in_flight - len(outs)})
        if self.dead is not None:
            self._fail_streams(self.dead)

    def _on_engine_error(self, exc: BaseException) -> None:
        """A bug in the engine's own code: the requests in flight fail with a generic message (the details go to
        the log), the executor is left as it is."""
        import traceback

        log_event("engine_error", error=f"{type(exc).__name__}: {exc}",
                  traceback="".join(traceback.format_exception(type(exc), exc, exc.__traceback__))[-4000:])
        outs = self.engine.fail_all("internal error in the engine; the request was not completed")
        self.failure_log.append({"time": time.time(), "message": f"engine error: {type(exc).__name__}",
                                 "rebuilt": False})
        self._publish_stats()
        self._deliver(outs)

    def _fail_streams(self, message: str) -> None:
        if self._loop is None or self._loop.is_closed():
            return

        def fail() -> None:
            for rid in list(self._streams):
                self._streams.pop(rid)._put(EngineFailedError(message))

        try:
            self._loop.call_soon_threadsafe(fail)
        except RuntimeError:
            pass
