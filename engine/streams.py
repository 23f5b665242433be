"""What `AsyncLLMEngine` hands its callers and how its threads wake each other: `RequestStream` (one request's
outputs on the event loop), `EngineFailedError`, and `Wakeup` (the cheapest cross-thread signal CPython has).

`Wakeup` is a binary semaphore on one raw lock: `set()` from any thread, `wait()` in one thread returns once a
`set()` happened since the previous `wait()` returned (a `set()` before the `wait()` is never lost; several count
as one). A `threading.Condition` (or `Event`, built on one) wakes a waiter in two hand-offs: the waiter's own
lock, then the condition's lock, still held by the notifier; `Wakeup` takes one.
"""
from __future__ import annotations

import asyncio
import collections
import threading
from typing import Any, Optional

from engine.request import FinishReason, Request, RequestOutput


class EngineBusyError(RuntimeError):
    """The engine holds as many requests as it may (`AsyncLLMEngine.max_in_flight`): retry later."""

    def __init__(self, held: int, limit: int):
        super().__init__(f"the server holds {held} requests, its limit is {limit}; retry later")
        self.held, self.limit = held, limit


class EngineFailedError(RuntimeError):
    """The request could not complete because the executor failed (or the engine is dead/stopped)."""


class Wakeup:
    """A binary semaphore: `set()` (any thread, idempotent until the next `wait`), `wait(timeout)` (-1: forever;
    True when set, False on timeout)."""

    __slots__ = ("_lock",)

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()  # held = not set

    def set(self) -> None:
        try:
            self._lock.release()
        except RuntimeError:  # set already
            pass

    def wait(self, timeout: float = -1) -> bool:
        return self._lock.acquire(timeout=timeout)


class RequestStream:
    """Async iterator of one request's `RequestOutput`s (deltas in `new_token_ids`) until finished.

    Filled from the event loop's thread only (`AsyncLLMEngine._dispatch`); one consumer. A deque and one
    waiter future (rather than an `asyncio.Queue`) keep the per-token delivery cost small."""

    def __init__(self, request: Request):
        self.request = request
        self._items: collections.deque = collections.deque()
        self._waiter: Optional[asyncio.Future] = None
        self.finished = False

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def _put(self, item: Any) -> None:
        self._items.append(item)
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._unwrap(self._items.popleft())

    def drain_nowait(self) -> list[RequestOutput]:
        """Outputs already queued (to coalesce several steps into one write)."""
        items = []
        while not self.finished and self._items:
            items.append(self._unwrap(self._items.popleft()))
        return items

    def _unwrap(self, item: Any) -> RequestOutput:
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
            if item.finish_reason is FinishReason.ERROR:
                raise EngineFailedError(item.error or "the executor failed")
        return item
