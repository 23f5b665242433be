"""Operator events as structured log lines: one JSON object per line on the `graphline.events` logger.

Events: `rank_failure` (an executor failure: which rank, what happened, how many requests were requeued or
failed), `rebuild` (its outcome and duration), `reset`, `engine_error` (a bug caught in the engine thread),
`request_rejected` (a round the executor refused, the requests failed alone). `launch` attaches a stderr
handler; library users attach their own.
"""
from __future__ import annotations

import json
import logging
import time
from typing import Any

EVENTS = logging.getLogger("graphline.events")

_LEVELS = {"rank_failure": logging.WARNING, "engine_error": logging.ERROR, "request_rejected": logging.WARNING}


def log_event(event: str, **fields: Any) -> dict:
    """Emit one event line; returns the record (for logs kept in memory)."""
    record = {"event": event, "time": round(time.time(), 3), **fields}
    EVENTS.log(_LEVELS.get(event, logging.INFO), json.dumps(record, default=str, sort_keys=False))
    return record
