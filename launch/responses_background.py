"""Background responses (`POST /v1/responses` with `"background": true`, OpenAI's): the request is answered at once
with its response object `in_progress`, which the store keeps; the server generates the answer in a task of its own
and the store's object becomes the finished one (`completed` / `incomplete`), `failed` (with its `error`) when the
engine failed or refused it, or `cancelled` after `POST /v1/responses/{id}/cancel`. Clients poll
`GET /v1/responses/{id}`. Tasks live on the server's event loop; shutting the server down cancels them."""
from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable, Optional

from launch.responses import response_object
from launch.responses_store import ResponseStore


class BackgroundResponses:
    """The running background responses of one server (event loop only)."""

    def __init__(self) -> None:
        self._tasks: dict[str, asyncio.Task] = {}

    def start(self, store: ResponseStore, rid: str, created: int, echo: dict, conversation: list[dict],
              run: Callable[[], Awaitable[Any]]) -> dict:
        """Keep `rid` in progress and run `run()` (the answer's generation, which stores the finished object
        itself); returns the in-progress object."""
        obj = response_object(rid, created, echo, None, status="in_progress")
        store.put(obj, conversation)
        task = asyncio.get_running_loop().create_task(self._run(store, rid, created, echo, conversation, run))
        self._tasks[rid] = task
        task.add_done_callback(lambda _: self._tasks.pop(rid, None))
        return obj

    async def _run(self, store: ResponseStore, rid: str, created: int, echo: dict, conversation: list[dict],
                   run: Callable[[], Awaitable[Any]]) -> None:
        try:
            await run()
        except asyncio.CancelledError:
            store.put(response_object(rid, created, echo, None, status="cancelled"), conversation)
            raise
        except Exception as exc:  # noqa: BLE001 - the failure is the response's, polled by the client
            failed = response_object(rid, created, echo, None, status="failed")
            code = getattr(exc, "code", None) or "server_error"
            failed["error"] = {"code": code, "message": getattr(exc, "message", None) or "the engine failed while "
                               "generating this response; retry it"}
            store.put(failed, conversation)

    async def cancel(self, rid: str) -> Optional[bool]:
        """Cancel `rid`'s generation: True once cancelled, False when it is not running (finished or never in the
        background); its engine requests are aborted by the generation's own cleanup."""
        task = self._tasks.get(rid)
        if task is None:
            return False
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return True

    async def shutdown(self) -> None:
        tasks = list(self._tasks.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def __len__(self) -> int:
        return len(self._tasks)
