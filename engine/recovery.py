"""What `LLMEngine` does when the executor fails, refuses a round, or is reset (`EngineRecovery`, a mixin).

- A rank failure mid-round (`EngineStepError`): `requeue_after_failure` returns every running sequence to its
  waiting queue (recomputed like a preemption; a second failure fails it), then `rebuild()` restarts the executor.
- A round refused before any rank ran it (`RoundRejectedError`): `fail_rejected` fails the sequences at fault.
- `reset()`: the round in flight completes, running sequences are preempted, every rank resets (and re-captures).
Whenever the KV contents are lost (reset, resize, rebuild) every DP rank's prefix cache is emptied
(`Scheduler.reset_blocks`): a cached block must never outlive the K/V it names.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from actors.batch import BatchError
from engine.executor import RebuildableExecutor
from engine.request import FinishReason, ModelLimits, RequestOutput
from engine.sequence import Sequence as Seq

if TYPE_CHECKING:
    from engine.scheduler import Scheduler


class EngineStepError(RuntimeError):
    """The executor failed during a step (a rank died or timed out): requeue the in-flight requests
    (`LLMEngine.requeue_after_failure`), then `rebuild()`."""


class RoundRejectedError(RuntimeError):
    """The executor refused a round before any rank ran it (a batch check failed); it still serves.
    `LLMEngine.fail_rejected` fails the requests at fault alone."""

    def __init__(self, scheduled: list, message: str):
        super().__init__(message)
        self.scheduled = scheduled


class EngineRecovery:
    """Mixin: the attributes below belong to `engine.llm_engine.LLMEngine`."""

    executor: Any
    schedulers: list["Scheduler"]
    limits: ModelLimits
    counters: dict
    _seqs: dict
    _pending: list
    _ahead: Any

    def _finish_ahead(self) -> None:  # pragma: no cover - the engine's
        raise NotImplementedError

    def fail_rejected(self, err: "RoundRejectedError") -> list[RequestOutput]:
        """After a `RoundRejectedError`: find the sequences whose own rows the executor rejects (each checked alone)
        and finish them with an error; every other sequence of the round is scheduled again by the next step.
        When no single row is at fault, every sequence of the rejected DP batch fails (no rank is rebuilt)."""
        culprits = []
        for d, b in enumerate(err.scheduled):
            if b is None:
                continue
            bad = [seq for seq in b.seqs if not seq.is_finished and not self._row_runs(d, seq)]
            culprits.extend(bad or [seq for seq in b.seqs if not seq.is_finished])
        outs = []
        for seq in culprits:
            sched = self.schedulers[seq.dp_rank]
            if seq in sched.running:
                sched.running.remove(seq)
            seq.error = "the request could not be run by the model executor"
            sched._finish(seq, FinishReason.ERROR)
            if self._seqs.pop(seq.request_id, None) is not None:
                self.counters["requests_failed"] += 1
                outs.append(seq.take_output())
        return outs

    def _row_runs(self, dp_rank: int, seq: Seq) -> bool:
        """Whether the executor accepts a batch of `seq` alone, as the scheduler would build it now."""
        check = getattr(self.executor, "check_batch", None)
        batch = self.schedulers[dp_rank].build_alone(seq)
        try:
            if check is not None:
                check(dp_rank, batch)
            else:
                batch.validate(self.limits.vocab_size, self.limits.block_size)
        except (BatchError, ValueError):
            return False
        return True

    def requeue_after_failure(self) -> list[RequestOutput]:
        """The executor failed mid-round: every running sequence goes back to its scheduler's waiting queue to be
        recomputed after `rebuild()` (its stream continues with no token lost or repeated). A sequence that was
        already requeued once after a failure fails instead; their outputs are returned."""
        self._ahead = None
        outs = []
        for s in self.schedulers:
            for seq in s.requeue_after_failure():
                seq.num_failures += 1
                if seq.num_failures > 1:
                    s.waiting.remove(seq)
                    seq.error = "the request failed: the model executor failed twice while it ran"
                    s._finish(seq, FinishReason.ERROR)
                    if self._seqs.pop(seq.request_id, None) is not None:
                        self.counters["requests_failed"] += 1
                        outs.append(seq.take_output())
        self.counters["requests_requeued"] += sum(len(s.waiting) for s in self.schedulers)
        return outs

    def fail_all(self, message: str) -> list[RequestOutput]:
        """Finish every in-flight request with an error (after an executor failure)."""
        self._ahead = None
        outs = []
        for s in self.schedulers:
            for seq in s.fail_all(message):
                outs.append(seq.take_output())
        self.counters["requests_failed"] += len(outs)
        self._seqs.clear()
        return outs

    def reset(self, recapture: bool = True, num_kv_blocks: Optional[int] = None,
              reload_weights: bool = False) -> dict:
        """Preempt every running sequence (they are recomputed afterwards with identical output), reset and
        re-capture every rank, resize the block pools if the KV cache changed. Call between steps only."""
        self._finish_ahead()  # the round in flight completes first; its outputs go out with the next step
        preempted = sum(s.preempt_all() for s in self.schedulers)
        out = dict(self.executor.reset(recapture=recapture, num_kv_blocks=num_kv_blocks,
                                       reload_weights=reload_weights) or {})
        n = int(self.executor.num_kv_blocks)
        for s in self.schedulers:  # the KV contents are gone (or resized): the prefix caches are emptied
            s.reset_blocks(n)
        if n != self.limits.num_kv_blocks:
            self.limits = ModelLimits(self.limits.vocab_size, self.limits.max_model_len, self.limits.block_size, n)
            too_big = [seq for s in self.schedulers for seq in s.queued() if _needs(seq, self.limits)]
            for seq in too_big:
                self.schedulers[seq.dp_rank].remove_queued(seq)
                seq.error = "the KV cache shrank below what this request needs"
                self.schedulers[seq.dp_rank]._finish(seq, FinishReason.ERROR)
                self._seqs.pop(seq.request_id, None)
                self._pending.append(seq.take_output())
                self.counters["requests_failed"] += 1
        self.counters["resets"] += 1
        out["preempted"] = preempted
        return out

    def rebuild(self) -> None:
        """Restart the executor after a failure (every in-flight request was requeued or failed, no block is held);
        the prefix caches are emptied (the KV contents are gone)."""
        if isinstance(self.executor, RebuildableExecutor):
            self.executor.rebuild()
        n = int(self.executor.num_kv_blocks)
        self.limits = ModelLimits(self.limits.vocab_size, self.limits.max_model_len, self.limits.block_size, n)
        for s in self.schedulers:
            s.reset_blocks(n)


def _needs(seq: Seq, limits: ModelLimits) -> bool:
    req = seq.request
    total = len(req.prompt_token_ids) + (req.max_tokens or limits.max_model_len - len(req.prompt_token_ids))
    return -(-total // limits.block_size) > limits.max_blocks_per_request
