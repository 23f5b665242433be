"""`LLMEngine`: one scheduler per DP rank driving one executor, synchronously.

`add_request` validates (raising `RequestError` before anything is scheduled) and places
the request on the DP rank whose prefix cache holds the longest run of its prompt's full
blocks (tie: the least loaded; a sample of `n > 1` goes to its parent's rank); `step()`
schedules every DP rank, runs one executor step for all of them (`None` for idle ranks) and
returns the progress of every request that advanced or finished. Not thread-safe:
`AsyncLLMEngine` owns it from one thread.

Overlap (`EngineConfig.overlap`, with an executor that has `submit` / `collect`): after a
decode round is submitted, the next decode round is scheduled ahead and submitted too
(`Scheduler.schedule_ahead`: token ids refer to the in-flight round's tokens), then the
first is collected. The device goes from one round to the next without waiting for the
host, and host work (scheduling, detokenising, streaming) runs while the device computes.
The round submitted ahead is the next `step()`'s round.
"""
from __future__ import annotations

import dataclasses
import time

import numpy as np
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Sequence

from actors.batch import BatchError
from engine.executor import executor_max_model_len
from engine.grammar import TokenGrammar
from engine.recovery import EngineRecovery, EngineStepError, RoundRejectedError
from engine.request import FinishReason, ModelLimits, Request, RequestError, RequestOutput, validate_request
from engine.samples import check_samples_fit, max_sample_tokens, sample_requests
from engine.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from engine.sequence import Sequence as Seq
from engine.sampling_params import SamplingParams

# Tokens per step per DP rank when EngineConfig.max_num_batched_tokens is None and chunked prefill is on: a mixed
# step of 2048 tokens keeps a GPU's GEMMs compute-bound while a decode row waits at most one such step, and fits
# the default piecewise buckets (up to 4096). `graphline serve` uses 512 on CPU.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048


@dataclass(frozen=True)
class EngineConfig:
    """max_num_seqs / max_num_batched_tokens per DP rank (None: `DEFAULT_MAX_NUM_BATCHED_TOKENS` with chunked
    prefill, else max(max_model_len, 2048)); enable_chunked_prefill: split prompts over steps, mixed with decode rows
    (in force when the budget is below max_model_len); enable_prefix_caching: reuse cached full KV blocks of earlier
    prompts (`engine.block_manager`); max_model_len None = the executor's; decode_steps:
    multi-step decode (decode steps per scheduling round while no running sequence needs sampler extras); overlap:
    scheduling ahead (see the module docstring; off by default), used when the executor can submit ahead, for
    rounds of at most `overlap_max_seqs` sequences; opt-in because of time-to-first-token outliers at high
    concurrency (docs/benchmarks.md, "Engine overlap")."""

    max_num_seqs: int = 256
    max_num_batched_tokens: Optional[int] = None
    max_model_len: Optional[int] = None
    watermark_blocks: int = 1
    decode_steps: int = 1
    overlap: bool = False  # schedule and submit the next decode round before collecting the current one
    overlap_max_seqs: int = 32  # ... while a round has at most this many sequences (all DP ranks together)
    scheduling_policy: str = "fcfs"  # `engine.scheduler_config.SCHEDULING_POLICIES`
    # generation stops at these unless a request sets ignore_eos: the checkpoint's EOS ids (generation_config.json,
    # else config.json); None = the executor's model config's
    eos_token_ids: Optional[tuple[int, ...]] = None
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True


@dataclass
class StepInfo:
    """What one engine step did (for metrics): seconds in the executor, phase per DP rank, token counts."""

    seconds: float
    kinds: list[Optional[str]]  # per DP rank: "prefill", "decode", "mixed" (decode rows + chunks), None (idle)
    num_tokens: int
    num_seqs: int
    num_steps: int = 1  # decode steps the round ran (multi-step decode)

    @property
    def kind(self) -> str:
        ks = {k for k in self.kinds if k}
        return ks.pop() if len(ks) == 1 else "mixed"


class LLMEngine(EngineRecovery):
    def __init__(self, executor: Any, config: EngineConfig = EngineConfig()):
        self.executor = executor
        self.config = config
        mcfg = executor.model_config
        max_len = config.max_model_len or executor_max_model_len(executor) or mcfg.max_position_embeddings
        self.limits = ModelLimits(mcfg.vocab_size, int(max_len), int(executor.block_size), int(executor.num_kv_blocks))
        budget = config.max_num_batched_tokens or (
            DEFAULT_MAX_NUM_BATCHED_TOKENS if config.enable_chunked_prefill else max(self.limits.max_model_len, 2048))
        self.sched_config = SchedulerConfig(config.max_num_seqs, budget, self.limits.max_model_len,
                                            config.watermark_blocks, config.decode_steps,
                                            config.enable_chunked_prefill, config.enable_prefix_caching,
                                            config.scheduling_policy)
        self.schedulers = [Scheduler(self.sched_config, self.limits.num_kv_blocks, self.limits.block_size,
                                     self.limits.vocab_size)
                           for _ in range(int(executor.dp_size))]
        eos = config.eos_token_ids if config.eos_token_ids is not None else getattr(mcfg, "eos_token_ids", ())
        self.eos_token_ids = frozenset(int(t) for t in eos or () if 0 <= int(t) < self.limits.vocab_size)
        self._seqs: dict[str, Seq] = {}
        self._pending: list[RequestOutput] = []  # finished outside a step (reset), reported by the next step
        self._overlap = config.overlap and callable(getattr(executor, "submit", None)) \
            and callable(getattr(executor, "collect", None))
        self._ahead: Optional[tuple[list[Optional[ScheduledBatch]], Any, float]] = None  # (round, ticket, t0)
        self.on_step: Optional[Callable[[StepInfo], None]] = None
        self._idle = getattr(executor, "idle", None)  # optional: told when a step leaves nothing to run
        self.counters = {"requests_added": 0, "requests_finished": 0, "requests_aborted": 0, "requests_failed": 0,
                         "generated_tokens": 0, "prompt_tokens": 0, "steps": 0, "resets": 0, "executor_failures": 0,
                         "rounds_ahead": 0, "requests_requeued": 0}

    # ---- requests
    @property
    def vocab_size(self) -> int:
        return self.limits.vocab_size

    def make_request(self, prompt_token_ids: Sequence[int], sampling: Optional[SamplingParams] = None,
                     max_tokens: Optional[int] = 16, stop_token_ids: Sequence[int] = (),
                     request_id: Optional[str] = None, grammar: Optional[TokenGrammar] = None,
                     priority: int = 0) -> Request:
        """Build and validate a request (raises `RequestError`); schedules nothing. `grammar`: `engine.grammar`;
        `priority`: only under the priority scheduling policy (else it must be 0)."""
        if priority != 0 and self.sched_config.scheduling_policy != "priority":
            raise RequestError("'priority' needs the priority scheduling policy (graphline serve --scheduling-policy "
                               "priority)", "priority", "unsupported")
        req = Request.make(prompt_token_ids, sampling, max_tokens, stop_token_ids, request_id, grammar, priority)
        validate_request(req, self.limits)
        return req

    def add_request(self, request: Request) -> str:
        validate_request(request, self.limits)
        if request.request_id in self._seqs:
            raise RequestError(f"request id {request.request_id!r} is already in flight", "request_id")
        seq = Seq(request)
        parent = self._seqs.get(request.parent_id) if request.parent_id is not None else None
        seq.dp_rank = parent.dp_rank if parent is not None else self._place(seq)
        if self.eos_token_ids and not request.sampling.ignore_eos:
            seq.stop_ids = request.stop_token_ids | self.eos_token_ids
        self._seqs[request.request_id] = seq
        self.schedulers[seq.dp_rank].add(seq, after=parent)
        self.counters["requests_added"] += 1
        self.counters["prompt_tokens"] += len(request.prompt_token_ids)
        return request.request_id

    def make_samples(self, request: Request, n: int, fit_max_tokens: bool = False) -> list[Request]:
        """The n requests of n samples of `request`'s prompt (`engine.samples`), checked to fit one DP rank's KV
        cache together (`RequestError` naming `n`); `fit_max_tokens` first lowers max_tokens to what n samples can
        hold (for a max_tokens the client did not set). Add each with `add_request`, the first first."""
        shared = self.sched_config.enable_prefix_caching
        if fit_max_tokens and n > 1:
            room = max_sample_tokens(len(request.prompt_token_ids), n, self.limits, shared)
            if room >= 1 and (request.max_tokens is None or request.max_tokens > room):
                request = dataclasses.replace(request, max_tokens=room)
        check_samples_fit(request, n, self.limits, shared)
        return sample_requests(request, n)

    def _place(self, seq: Seq) -> int:
        """The DP rank whose prefix cache holds the longest run of `seq`'s full blocks; tie: the least loaded."""
        ranks = range(len(self.schedulers))
        if len(self.schedulers) == 1:
            return 0
        if not self.sched_config.enable_prefix_caching:
            return min(ranks, key=self._load)
        return min(ranks, key=lambda r: (-self.schedulers[r].cached_prefix_blocks(seq), self._load(r)))

    def _load(self, rank: int) -> tuple[int, int]:
        s = self.schedulers[rank]
        return len(s.waiting) + len(s.running) + s.num_held, -s.blocks.num_free

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
            self.on_step(StepInfo(seconds, [None if b is None else b.kind for b in scheduled],
                                  sum(b.num_tokens for b in scheduled if b is not None),
                                  sum(len(b.seqs) for b in scheduled if b is not None), steps))
        if self._idle is not None and self._ahead is None and not self.has_unfinished():
            self._idle()
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
                if not seq.is_finished and not seq.has_new_output:
                    continue  # an intermediate prefill chunk: nothing to report
                out = seq.take_output()
                if seq.is_finished:
                    if self._seqs.pop(seq.request_id, None) is None:
                        continue  # finished in an earlier round (a stop token): reported then
                    self.counters["requests_finished"] += 1
                self.counters["generated_tokens"] += len(out.new_token_ids)
                outputs.append(out)
        return outputs

    def stats(self) -> dict:
        ranks = [s.stats() for s in self.schedulers]
        caches = [r["prefix_cache"] for r in ranks]
        queries, hits = sum(c["queries"] for c in caches), sum(c["hits"] for c in caches)
        return {
            "dp_ranks": ranks,
            "waiting": sum(r["waiting"] for r in ranks),
            "running": sum(r["running"] for r in ranks),
            "preemptions": sum(r["preemptions"] for r in ranks),
            "prefill_chunks": sum(r["prefill_chunks"] for r in ranks),
            "prefix_cache": {"enabled": self.sched_config.enable_prefix_caching, "queries": queries, "hits": hits,
                             "hit_rate": hits / queries if queries else 0.0,
                             "cached_blocks": sum(c["cached_blocks"] for c in caches),
                             "evictions": sum(c["evictions"] for c in caches)},
            "chunked_prefill": self.sched_config.chunked,
            "overlap": self._overlap,
            "limits": {"vocab_size": self.limits.vocab_size, "max_model_len": self.limits.max_model_len,
                       "block_size": self.limits.block_size, "num_kv_blocks": self.limits.num_kv_blocks,
                       "max_num_seqs": self.sched_config.max_num_seqs,
                       "max_num_batched_tokens": self.sched_config.max_num_batched_tokens,
                       "enable_chunked_prefill": self.sched_config.enable_chunked_prefill,
                       "enable_prefix_caching": self.sched_config.enable_prefix_caching},
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
