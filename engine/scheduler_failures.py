"""The scheduler's failure half (`engine.scheduler.Scheduler` inherits it): what its queues and blocks do when the
executor fails (a rank died or hung, the ranks are rebuilt) or is reset: the rounds in flight forgotten, running
sequences requeued to be recomputed, or every sequence failed, and a fresh block manager."""
from __future__ import annotations

import collections
from typing import Any, Optional

from engine.block_manager import BlockManager
from engine.request import FinishReason
from engine.scheduler_config import SchedulerConfig
from engine.sequence import Sequence


class SchedulerError(RuntimeError):
    """The scheduler was driven out of order (e.g. an update without a scheduled batch)."""


class SchedulerFailures:
    """Mixin: the attributes and the helpers below belong to `engine.scheduler.Scheduler`."""

    cfg: SchedulerConfig
    block_size: int
    blocks: BlockManager
    waiting: collections.deque[Sequence]
    running: list[Sequence]
    _held: dict[str, list[Sequence]]
    _in_flight: Optional[Any]  # engine.scheduler.ScheduledBatch (that module imports this one)
    _ahead: Optional[Any]

    def _preempt(self, seq: Sequence) -> None:  # pragma: no cover - the planner's
        raise NotImplementedError

    def _finish(self, seq: Sequence, reason: FinishReason, free: bool = True) -> Sequence:  # pragma: no cover
        raise NotImplementedError

    def preempt_all(self) -> int:
        """Return every running sequence to the waiting queue (references dropped, recompute later). Resets."""
        n = len(self.running)
        while self.running:
            self._preempt(self.running.pop())
        return n

    def requeue_after_failure(self) -> list[Sequence]:
        """The executor failed (its ranks are rebuilt): forget the rounds in flight and return every running
        sequence to the front of the waiting queue, in order, to be recomputed like a preemption (prompt plus the
        tokens generated so far). Returns the requeued sequences. Blocks are rebuilt with `reset_blocks`."""
        self._in_flight = self._ahead = None
        seqs, self.running = self.running, []
        for seq in reversed(seqs):
            self._preempt(seq)
        return seqs

    def reset_blocks(self, num_kv_blocks: int) -> None:
        """A new, empty block manager (the KV contents are gone: reset, resize, rebuild); only when no sequence
        holds blocks. The prefix-cache counters carry on (they are cumulative)."""
        if self.running or any(s.block_table for s in self.waiting):
            raise SchedulerError("reset_blocks with sequences holding blocks; preempt_all first")
        old = self.blocks
        self.blocks = BlockManager(num_kv_blocks, self.block_size, self.cfg.enable_prefix_caching)
        self.blocks.queries, self.blocks.hits, self.blocks.evictions = old.queries, old.hits, old.evictions

    def cancel(self, sched: Any) -> None:
        """Forget an in-flight batch (`ScheduledBatch`) whose step failed (its sequences are then failed by the
        engine)."""
        if sched is self._in_flight:
            self._in_flight = None
            self._ahead = None

    def fail_all(self, message: str) -> list[Sequence]:
        """Finish every sequence with an error (the executor failed); returns them."""
        self._in_flight = self._ahead = None
        held = [s for group in self._held.values() for s in group]
        self._held = {}
        out = []
        for seq in list(self.running) + list(self.waiting) + held:
            seq.error = message
            out.append(self._finish(seq, FinishReason.ERROR))
        self.running, self.waiting = [], collections.deque()
        return out
