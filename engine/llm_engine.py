"""`LLMEngine`: one scheduler per DP rank driving one executor, synchronously.

`add_request` validates (raising `RequestError` before anything is scheduled) and places
the request on the least loaded DP rank; `step()` schedules every DP rank, runs one
executor step for all of them (`None` for idle ranks) and returns the progress of every
request that advanced or finished. Not thread-safe: `AsyncLLMEngine` owns it from one thread.

Overlap (`EngineConfig.overlap`, with an executor that has `submit` / `collect`): after a
decode round is submitted, the next decode round is scheduled ahead and submitted too
(`Scheduler.schedule_ahead`: token ids refer to the in-flight round's tokens), then the
first is collected. The device goes from one round to the next without waiting for the
host, and host work (scheduling, detokenising, streaming) runs while the device computes.
The round submitted ahead is the next `step()`'s round.
"""
from __future__ import annotations

import time

import numpy as np
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Sequence

from actors.batch import BatchError
from engine.executor import executor_max_model_len
from engine.request import FinishReason, ModelLimits, Request, RequestError, RequestOutput, validate_request
from engine.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from engine.sequence import Sequence as Seq
from engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class EngineConfig:
    """max_num_seqs / max_num_batched_tokens per DP rank; max_model_len None = the executor's; decode_steps:
    multi-step decode (decode steps per scheduling round while every running sequence is greedy); overlap:
    scheduling ahead (see the module docstring; off by default), used when the executor can submit ahead, for
    rounds of at most `overlap_max_seqs` sequences. Measured on an H200 (`bench/serve_bench.py`): TPOT at
    one client 0.97-1.25 ms against 1.81 ms, but time-to-first-token p99 outliers of 0.9-1.5 s at 16-64
    clients that synchronous rounds do not show (not yet explained), hence opt-in."""

    max_num_seqs: int = 256
    max_num_batched_tokens: Optional[int] = None
    max_model_len: Optional[int] = None
    watermark_blocks: int = 1
    decode_steps: int = 1
    overlap: bool = False  # schedule and submit the next decode round before collecting the current one
    overlap_max_seqs: int = 32  # ... while a round has at most this many sequences (all DP ranks together)
    # generation stops at these unless a request sets ignore_eos: the checkpoint's EOS ids (generation_config.json,
    # else config.json); None = the executor's model config's
    eos_token_ids: Optional[tuple[int, ...]] = None


@dataclass
class StepInfo:
    """What one engine step did (for metrics): seconds in the executor, phase per DP rank, token counts."""

    seconds: float
    kinds: list[Optional[str]]  # "prefill" / "decode" / None (idle) per DP rank
    num_tokens: int
    num_seqs: int
    num_steps: int = 1  # decode steps the round ran (multi-step decode)

    @property
    def kind(self) -> str:
        ks = {k for k in self.kinds if k}
        return ks.pop() if len(ks) == 1 else "mixed"


class LLMEngine:
    def __init__(self, executor: Any, config: EngineConfig = EngineConfig()):
        self.executor = executor
        self.config = config
        mcfg = executor.model_config
        max_len = config.max_model_len or executor_max_model_len(executor) or mcfg.max_position_embeddings
        self.limits = ModelLimits(mcfg.vocab_size, int(max_len), int(executor.block_size), int(executor.num_kv_blocks))
        budget = config.max_num_batched_tokens or max(self.limits.max_model_len, 2048)
        self.sched_config = SchedulerConfig(config.max_num_seqs, budget, self.limits.max_model_len,
                                            config.watermark_blocks, config.decode_steps)
        self.schedulers = [Scheduler(self.sched_config, self.limits.num_kv_blocks, self.limits.block_size)
                           for _ in range(int(executor.dp_size))]
        eos = config.eos_token_ids if config.eos_token_ids is not None else getattr(mcfg, "eos_token_ids", ())
        self.eos_token_ids = frozenset(int(t) for t in eos or () if 0 <= int(t) < self.limits.vocab_size)
        self._seqs: dict[str, Seq] = {}
        self._pending: list[RequestOutput] = []  # finished outside a step (reset), reported by the next step
        self._overlap = config.overlap and callable(getattr(executor, "submit", None)) \
            and callable(getattr(executor, "collect", None))
        self._ahead: Optional[tuple[list[Optional[ScheduledBatch]], Any, float]] = None  # (round, ticket, t0)
        self.on_step: Optional[Callable[[StepInfo], None]] = None
        self.counters = {"requests_added": 0, "requests_finished": 0, "requests_aborted": 0, "requests_failed": 0,
                         "generated_tokens": 0, "prompt_tokens": 0, "steps": 0, "resets": 0, "executor_failures": 0,
                         "rounds_ahead": 0, "requests_requeued": 0}

    # ---- requests
    @property
    def vocab_size(self) -> int:
        return self.limits.vocab_size

    def make_request(self, prompt_token_ids: Sequence[int], sampling: Optional[SamplingParams] = None,
                     max_tokens: Optional[int] = 16, stop_token_ids: Sequence[int] = (),
                     request_id: Optional[str] = None) -> Request:
        """Build and validate a request (raises `RequestError`); schedules nothing."""
        req = Request.make(prompt_token_ids, sampling, max_tokens, stop_token_ids, request_id)
        validate_request(req, self.limits)
        return req

    def add_request(self, request: Request) -> str:
        validate_request(request, self.limits)
        if request.request_id in self._seqs:
            raise RequestError(f"request id {request.request_id!r} is already in flight", "request_id")
        rank = min(range(len(self.schedulers)), key=lambda r: self._load(r))
        seq = Seq(request, rank)
        if self.eos_token_ids and not request.sampling.ignore_eos:
            seq.stop_ids = request.stop_token_ids | self.eos_token_ids
        self._seqs[request.request_id] = seq
        self.schedulers[rank].add(seq)
        self.counters["requests_added"] += 1
        self.counters["prompt_tokens"] += len(request.prompt_token_ids)
        return request.request_id

    def _load(self, rank: int) -> tuple[int, int]:
        s = self.schedulers[rank]
        return len(s.waiting) + len(s.running), -s.allocator.num_free

    def abort(self, request_id: str) -> Optional[RequestOutput]:
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return None
        self.schedulers[seq.dp_rank].abort(request_id)
        self.counters["requests_aborted"] += 1
        return seq.take_output()

    def has_unfinished(self) -> bool:
        return bool(self._pending) or self._ahead is not None or any(s.has_unfinished for s in self.schedulers)

    @property
    def num_unfinished(self) -> int:
        return len(self._seqs)

    # ---- steps
    def step(self) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        if self._ahead is not None:
            scheduled, ticket, t0 = self._ahead
            self._ahead = None
            steps = 1
        else:
            scheduled = [s.schedule() for s in self.schedulers]
            if all(b is None for b in scheduled):
                if not outputs and any(s.waiting for s in self.schedulers):  # validation makes this unreachable
                    raise EngineStepError("scheduler stalled: waiting requests fit no KV cache even when it is empty")
                return outputs
            active = [b for b in scheduled if b is not None]
            steps = 1 if any(b.is_prefill for b in active) else min(b.num_steps for b in active)
            for b in active:
                b.num_steps = steps  # one global count: ranks whose collectives cross DP groups step together
            t0 = time.perf_counter()
            ticket = self._submit(scheduled, steps)
        if self._overlap and steps == 1:
            self._submit_ahead(scheduled)
        results = self._collect(scheduled, ticket) if self._overlap else ticket
        seconds = time.perf_counter() - t0
        outputs.extend(self._apply(scheduled, results))
        self.counters["steps"] += 1
        if self.on_step is not None:
            self.on_step(StepInfo(seconds, [None if b is None else ("prefill" if b.is_prefill else "decode")
                                            for b in scheduled],
                                  sum(b.num_tokens for b in scheduled if b is not None),
                                  sum(len(b.seqs) for b in scheduled if b is not None), steps))
        return outputs

    def _submit(self, scheduled: list[Optional[ScheduledBatch]], steps: int) -> Any:
        """Hand a round to the executor: its ticket (overlap) or its tokens (synchronous executors)."""
        batches = [None if b is None else b.batch for b in scheduled]
        try:
            if self._overlap:
                return self.executor.submit(batches, num_steps=steps) if steps > 1 else self.executor.submit(batches)
            return self.executor.step(batches, num_steps=steps) if steps > 1 else self.executor.step(batches)
        except Exception as exc:
            raise self._executor_failed(scheduled, exc) from exc

    def _collect(self, scheduled: list[Optional[ScheduledBatch]], ticket: Any) -> list:
        """The tokens of a round `_submit` handed to an overlapping executor (waits for them)."""
        try:
            return self.executor.collect(ticket)
        except Exception as exc:
            raise self._executor_failed(scheduled, exc) from exc

    def _executor_failed(self, scheduled: list[Optional[ScheduledBatch]], exc: Exception) -> "EngineStepError":
        """Forget the failed round (and any round scheduled ahead) and build the caller's error: a
        `RoundRejectedError` when the executor refused the round before any rank ran (a batch check failed: the
        executor still serves), else an `EngineStepError` (a rank failed; the executor must be rebuilt)."""
        self._cancel(scheduled)
        if isinstance(exc, BatchError):
            return RoundRejectedError(scheduled, f"{type(exc).__name__}: {exc}")
        self.counters["executor_failures"] += 1
        return EngineStepError(f"executor step failed: {type(exc).__name__}: {exc}")

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

    def _submit_ahead(self, scheduled: list[Optional[ScheduledBatch]]) -> None:
        """Schedule and submit the decode round after `scheduled` (every active DP rank, or none)."""
        active = [b for b in scheduled if b is not None]
        if not active or any(b.is_prefill or b.num_steps != 1 for b in active):
            return
        if sum(len(b.seqs) for b in active) > self.config.overlap_max_seqs:
            return
        nxt = [None if b is None else s.schedule_ahead(b) for s, b in zip(self.schedulers, scheduled)]
        if any(b is not None and n is None for b, n in zip(scheduled, nxt)):
            for s in self.schedulers:
                s.cancel_ahead()
            return
        t0 = time.perf_counter()
        self._ahead = (nxt, self._submit(nxt, 1), t0)
        self.counters["rounds_ahead"] += 1

    def _cancel(self, scheduled: list[Optional[ScheduledBatch]]) -> None:
        self._ahead = None
        for s, b in zip(self.schedulers, scheduled):
            if b is not None:
                s.cancel(b)

    def _finish_ahead(self) -> None:
        """Collect the round submitted ahead, if any (its outputs are reported by the next `step()`)."""
        if self._ahead is not None:
            scheduled, ticket, _ = self._ahead
            self._ahead = None
            self._pending.extend(self._apply(scheduled, self._collect(scheduled, ticket)))

    def _apply(self, scheduled: list[Optional[ScheduledBatch]], results: list) -> list[RequestOutput]:
        """Hand a round's tokens to the schedulers; the progress of every request that advanced or finished."""
        outputs = []
        now = time.monotonic()
        for s, b, toks in zip(self.schedulers, scheduled, results):
            if b is None:
                continue
            if toks is None:
                self._cancel(scheduled)
                raise EngineStepError("the executor returned no tokens for a scheduled DP rank")
            for seq in s.update(b, toks, now):
                if seq.is_finished and seq.finish_reason is FinishReason.ABORT:
                    continue  # reported by abort()
                out = seq.take_output()
                if seq.is_finished:
                    if self._seqs.pop(seq.request_id, None) is None:
                        continue  # finished in an earlier round (a stop token): reported then
                    self.counters["requests_finished"] += 1
                self.counters["generated_tokens"] += len(out.new_token_ids)
                outputs.append(out)
        return outputs

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
        if n != self.limits.num_kv_blocks:
            self.limits = ModelLimits(self.limits.vocab_size, self.limits.max_model_len, self.limits.block_size, n)
            for s in self.schedulers:
                s.reset_blocks(n)
            too_big = [seq for s in self.schedulers for seq in s.waiting if _needs(seq, self.limits)]
            for seq in too_big:
                self.schedulers[seq.dp_rank].waiting.remove(seq)
                seq.error = "the KV cache shrank below what this request needs"
                self.schedulers[seq.dp_rank]._finish(seq, FinishReason.ERROR)
                self._seqs.pop(seq.request_id, None)
                self._pending.append(seq.take_output())
                self.counters["requests_failed"] += 1
        self.counters["resets"] += 1
        out["preempted"] = preempted
        return out

    def rebuild(self) -> None:
        """Restart the executor after a failure (every request has been failed, no block is held)."""
        if hasattr(self.executor, "rebuild"):
            self.executor.rebuild()
        n = int(self.executor.num_kv_blocks)
        self.limits = ModelLimits(self.limits.vocab_size, self.limits.max_model_len, self.limits.block_size, n)
        for s in self.schedulers:
            s.reset_blocks(n)

    def stats(self) -> dict:
        ranks = [s.stats() for s in self.schedulers]
        return {
            "dp_ranks": ranks,
            "waiting": sum(r["waiting"] for r in ranks),
            "running": sum(r["running"] for r in ranks),
            "preemptions": sum(r["preemptions"] for r in ranks),
            "overlap": self._overlap,
            "limits": {"vocab_size": self.limits.vocab_size, "max_model_len": self.limits.max_model_len,
                       "block_size": self.limits.block_size, "num_kv_blocks": self.limits.num_kv_blocks,
                       "max_num_seqs": self.sched_config.max_num_seqs,
                       "max_num_batched_tokens": self.sched_config.max_num_batched_tokens},
            **self.counters,
        }

    # ---- offline API
    def generate(self, prompts: Sequence[Sequence[int]], sampling: Optional[SamplingParams] = None,
                 max_tokens: Optional[int] = 16, stop_token_ids: Sequence[int] = ()) -> list[RequestOutput]:
        """Generate for every prompt (continuous batching); outputs in prompt order. Every request is
        validated before any is scheduled."""
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (Sequence, np.ndarray)):
            raise RequestError("prompts must be a list of token id lists", "prompt")
        reqs = [self.make_request(p, sampling, max_tokens, stop_token_ids) for p in prompts]
        return self.run_to_completion(reqs)

    def run_to_completion(self, requests: Iterable[Request]) -> list[RequestOutput]:
        ids = [self.add_request(r) for r in requests]
        final: dict[str, RequestOutput] = {}
        while self.has_unfinished():
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[i] for i in ids]


class EngineStepError(RuntimeError):
    """The executor failed during a step (a rank died or timed out): requeue the in-flight requests
    (`LLMEngine.requeue_after_failure`), then `rebuild()`."""


class RoundRejectedError(RuntimeError):
    """The executor refused a round before any rank ran it (a batch check failed); it still serves.
    `LLMEngine.fail_rejected` fails the requests at fault alone."""

    def __init__(self, scheduled: list, message: str):
        super().__init__(message)
        self.scheduled = scheduled


def _needs(seq: Seq, limits: ModelLimits) -> bool:
    req = seq.request
    total = len(req.prompt_token_ids) + (req.max_tokens or limits.max_model_len - len(req.prompt_token_ids))
    return -(-total // limits.block_size) > limits.max_blocks_per_request
