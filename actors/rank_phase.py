"""`RankPhase`: what a rank is doing (`name`, since `since`, wall clock), for its heartbeat and health answers, and
the per-thread set-up every `RankWorker` method does first. Worker methods run on several threads (Ray's default
thread, the compiled-graph loop's, the pipe loop's), and a thread's current CUDA device and torch's intra-op
thread count are per thread.
"""
from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any


class RankPhase:
    def __init__(self) -> None:
        self.name, self.since = "created", time.time()
        self.device: Any = None  # torch.device of the rank, from `RankWorker.init_groups`
        self._threads_set: set[int] = set()  # threads limited to one intra-op thread (CPU ranks)
        self._thread = threading.local()  # `.on_device`: this thread's current device is the rank's GPU

    def enter(self, phase: str) -> None:
        """The rank begins `phase` on the calling thread: on a GPU rank, the rank's device becomes the thread's
        current device (nothing resets it); on a CPU rank, the thread runs torch with one intra-op thread."""
        import torch

        self.name, self.since = phase, time.time()
        if self.device is not None and self.device.type == "cuda":
            if not getattr(self._thread, "on_device", False):  # the current device is per thread; nothing resets it
                torch.cuda.set_device(self.device)
                self._thread.on_device = True
        elif threading.get_ident() not in self._threads_set:
            torch.set_num_threads(1)  # per thread: the compiled-graph loop runs on its own thread
            self._threads_set.add(threading.get_ident())

    def leave(self) -> None:
        self.name, self.since = "idle", time.time()

    @contextlib.contextmanager
    def during(self, phase: str) -> Iterator[None]:
        """`enter(phase)`, then `leave()` however the block ends."""
        self.enter(phase)
        try:
            yield
        finally:
            self.leave()

    def seconds(self) -> float:
        """How long the rank has been in its phase."""
        return time.time() - self.since
