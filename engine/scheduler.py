"""Continuous batching for one DP rank: FCFS admission, decode of every running sequence,
paged KV blocks, preemption by recompute.

Policy per step (vLLM-v0 style, prefill and decode are separate steps):
1. If the head of the waiting queue fits (sequence slots, token budget, free blocks),
   admit waiting sequences in FCFS order while they fit and run one prefill step for them.
2. Otherwise decode every running sequence; a sequence that needs a new block and finds
   none preempts the newest running sequence (possibly itself): its blocks are freed and
   it goes back to the front of the waiting queue to be recomputed from its prompt and
   generated tokens. Sampling is position-keyed, so the output is unchanged.
3. Scheduling ahead (`schedule_ahead`): while a decode round is in flight and nobody
   waits, the next decode round of the same sequences is built before the in-flight
   round's tokens are known: its token ids refer to them (`actors.batch.prev_token`), so
   the executor can start it as soon as the device is free. A sequence certain to finish
   (max_tokens, max_model_len) is left out; one that stops on a stop token rides along and
   its extra token is dropped. Blocks of a sequence that finishes while a round that
   writes them is in flight are freed only after that round.
"""
from __future__ import annotations

import collections
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np

from actors.batch import SampledTokens, StepBatch, prev_token
from engine.request import FinishReason, Request
from engine.sampling_rows import build_extras, needs_extras
from engine.sequence import Sequence, SeqStatus
from engine.blocks import BlockAllocator


class SchedulerError(RuntimeError):
    """The scheduler was driven out of order (e.g. an update without a scheduled batch)."""


@dataclass(frozen=True)
class SchedulerConfig:
    """max_num_seqs: running sequences per DP rank (decode batch); max_num_batched_tokens: tokens of one
    prefill step (a single longer sequence is still admitted alone); watermark_blocks: free blocks kept
    back when admitting next to running sequences (damps admit/preempt ping-pong); decode_steps: decode
    steps per scheduling round when every running sequence is greedy (multi-step decode: the ranks feed
    each step's tokens to the next on the device; blocks for the extra tokens are reserved up front, and
    tokens past a sequence's stop are discarded)."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096
    max_model_len: int = 4096
    watermark_blocks: int = 1
    decode_steps: int = 1

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "decode_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.watermark_blocks < 0:
            raise ValueError("watermark_blocks must be >= 0")


@dataclass
class ScheduledBatch:
    """The sequences of one step, in batch order, and their `StepBatch`."""

    seqs: list[Sequence]
    batch: StepBatch
    is_prefill: bool
    num_steps: int = 1

    @property
    def num_tokens(self) -> int:
        return self.batch.num_tokens


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, num_kv_blocks: int, block_size: int):
        self.cfg = cfg
        self.block_size = block_size
        self.allocator = BlockAllocator(num_kv_blocks)
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._in_flight: Optional[ScheduledBatch] = None
        self._ahead: Optional[ScheduledBatch] = None  # the round scheduled ahead of `_in_flight`

    # ---- queue management
    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def abort(self, request_id: str) -> Optional[Sequence]:
        """Remove a request wherever it is; returns its finished sequence (None if unknown)."""
        for seq in self.waiting:
            if seq.request_id == request_id:
                self.waiting.remove(seq)
                return self._finish(seq, FinishReason.ABORT)
        for seq in self.running:
            if seq.request_id == request_id:
                self.running.remove(seq)
                # a round in flight still writes its blocks: they are freed when that round is updated
                return self._finish(seq, FinishReason.ABORT, free=not self._in_any_round(seq))
        return None

    def _in_any_round(self, seq: Sequence) -> bool:
        return any(r is not None and any(s is seq for s in r.seqs) for r in (self._in_flight, self._ahead))

    def preempt_all(self) -> int:
        """Return every running sequence to the waiting queue (blocks freed, recompute later). Used by resets."""
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
        """Rebuild the allocator (after a KV cache resize); only when no sequence holds blocks."""
        if self.running or any(s.block_table for s in self.waiting):
            raise SchedulerError("reset_blocks with sequences holding blocks; preempt_all first")
        self.allocator = BlockAllocator(num_kv_blocks)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- one step
    def schedule(self) -> Optional[ScheduledBatch]:
        if self._in_flight is not None:
            raise SchedulerError("schedule() called twice without update()")
        admitted = self._admit()
        if not admitted:
            self._reserve_decode_blocks()
            if not self.running:  # everything was preempted (or nothing ran): admit from a freed cache
                admitted = self._admit()
                if not admitted:
                    return None
        if admitted:
            self.running.extend(admitted)
            sched = ScheduledBatch(admitted, self._build(admitted), True)
        else:
            steps = self._lookahead_steps()
            sched = ScheduledBatch(list(self.running), self._build(self.running), False, steps)
        self._in_flight = sched
        return sched

    def schedule_ahead(self, prev: ScheduledBatch) -> Optional[ScheduledBatch]:
        """The decode round after the in-flight `prev`, built before `prev`'s tokens are known (see the module
        docstring), or None: `prev` is not a one-step decode round, requests wait for admission, nobody
        continues, or the blocks it needs are not free (never preempts). Updated after `prev`."""
        if prev is not self._in_flight or self._ahead is not None:
            raise SchedulerError("schedule_ahead() needs the in-flight round and none scheduled ahead of it")
        if prev.is_prefill or prev.num_steps != 1 or self.waiting or prev.batch.extras is not None:
            return None  # rows with sampler extras (penalties, bans, logprobs) need their last token first
        in_prev = {id(s) for s in prev.seqs}
        if any(id(s) not in in_prev for s in self.running):
            return None
        max_len = self.cfg.max_model_len
        rows, cont = [], []
        for row, seq in enumerate(prev.seqs):
            req = seq.request
            if seq.status is SeqStatus.FINISHED or seq.num_tokens + 1 >= max_len or (
                    req.max_tokens is not None and seq.num_output_tokens + 1 >= req.max_tokens):
                continue  # finishes with `prev`'s token
            rows.append(row)
            cont.append(seq)
        if not cont:
            return None
        # `prev` appends one token (position num_tokens); this round stores it and samples the next
        need = [max(0, self.blocks_for(s.num_tokens + 1) - len(s.block_table)) for s in cont]
        if sum(need) > self.allocator.num_free:
            return None
        for seq, n in zip(cont, need):
            if n:
                seq.block_table.extend(self.allocator.allocate(n))
        batch = self._build(cont, tokens=[prev_token(r) for r in rows], hist=[s.num_tokens for s in cont])
        self._ahead = ScheduledBatch(cont, batch, False, 1)
        return self._ahead

    def cancel_ahead(self) -> None:
        """Drop the round scheduled ahead before it was submitted (the blocks it reserved stay with their
        sequences, which need them for their next round anyway)."""
        self._ahead = None

    def _lookahead_steps(self) -> int:
        """Decode steps for this round (multi-step decode): up to `decode_steps` when every running sequence
        is greedy, capped by max_model_len and by the largest remaining max_tokens; the blocks the extra
        tokens need are allocated now (fewer steps when they are short; never preempts for them)."""
        k = self.cfg.decode_steps
        run = self.running
        if k <= 1 or not run or any(s.sampling_row[0] > 0 or needs_extras(s) for s in run):
            return 1
        k = min(k, min(self.cfg.max_model_len - s.num_tokens for s in run))
        left = [s.request.max_tokens - s.num_output_tokens for s in run if s.request.max_tokens is not None]
        if len(left) == len(run):
            k = min(k, max(left))
        while k > 1:
            need = [max(0, self.blocks_for(s.num_tokens + k - 1) - len(s.block_table)) for s in run]
            if sum(need) <= self.allocator.num_free:
                for s, n in zip(run, need):
                    if n:
                        s.block_table.extend(self.allocator.allocate(n))
                return k
            k //= 2
        return 1

    def _admit(self) -> list[Sequence]:
        admitted: list[Sequence] = []
        budget = self.cfg.max_num_batched_tokens
        while self.waiting and len(self.running) + len(admitted) < self.cfg.max_num_seqs:
            seq = self.waiting[0]
            n = seq.num_new_tokens
            if admitted and n > budget:
                break
            need = self.blocks_for(seq.num_tokens) - len(seq.block_table)
            keep = self.cfg.watermark_blocks if (self.running or admitted) else 0
            if need + keep > self.allocator.num_free:
                break
            seq.block_table.extend(self.allocator.allocate(need))
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            admitted.append(seq)
            budget -= n
        return admitted

    def _reserve_decode_blocks(self) -> None:
        i = 0
        bs = self.block_size
        while i < len(self.running):
            seq = self.running[i]
            if len(seq.token_ids) <= len(seq.block_table) * bs:  # fast path: room in the last block
                i += 1
                continue
            need = self.blocks_for(seq.num_tokens) - len(seq.block_table)
            while need > self.allocator.num_free:
                victim = self.running.pop()
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                if need:
                    seq.block_table.extend(self.allocator.allocate(need))
                i += 1

    def _preempt(self, seq: Sequence) -> None:
        self.allocator.free(seq.block_table)
        seq.block_table = []
        seq.num_computed = 0
        seq.num_preemptions += 1
        seq.status = SeqStatus.WAITING
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _build(self, seqs: list[Sequence], tokens: Optional[list[int]] = None,
               hist: Optional[list[int]] = None) -> StepBatch:
        """The step batch of `seqs`: their unfed tokens, or (ahead) one given token id each at position `hist`."""
        n = len(seqs)
        tables_lists = [s.block_table for s in seqs]
        width = max(map(len, tables_lists))
        tables = np.zeros((n, width), dtype=np.int32)
        for i, bt in enumerate(tables_lists):
            tables[i, : len(bt)] = bt
        if tokens is not None:
            q = np.ones(n, dtype=np.int32)
        else:
            hist = [s.num_computed for s in seqs]
            if all(len(s.token_ids) - h == 1 for s, h in zip(seqs, hist)):  # decode: one new token each
                tokens = [s.token_ids[-1] for s in seqs]
                q = np.ones(n, dtype=np.int32)
            else:
                tokens = [t for s, h in zip(seqs, hist) for t in s.token_ids[h:]]
                q = np.array([len(s.token_ids) - h for s, h in zip(seqs, hist)], dtype=np.int32)
        rows = [s.sampling_row for s in seqs]
        greedy = all(r == (0.0, 0, 1.0, -1) for r in rows) and not any(needs_extras(s) for s in seqs)
        return StepBatch(
            token_ids=np.array(tokens, dtype=np.int64), q_seqlens=q, num_history=np.array(hist, dtype=np.int32),
            block_tables=tables,
            temperature=np.zeros(n, np.float32) if greedy else np.array([r[0] for r in rows], dtype=np.float32),
            top_k=np.zeros(n, np.int32) if greedy else np.array([r[1] for r in rows], dtype=np.int32),
            top_p=np.ones(n, np.float32) if greedy else np.array([r[2] for r in rows], dtype=np.float32),
            seeds=np.full(n, -1, np.int64) if greedy else np.array([r[3] for r in rows], dtype=np.int64),
            extras=None if greedy else build_extras(seqs),
        )

    def build_alone(self, seq: Sequence) -> StepBatch:
        """The step batch of `seq` alone, from its host tokens (to check one sequence's rows by themselves)."""
        return self._build([seq])

    def update(self, sched: ScheduledBatch, next_tokens: np.ndarray, now: Optional[float] = None) -> list[Sequence]:
        """Apply one round's sampled tokens (int64 `[B]`, or `[B, num_steps]` for multi-step decode, applied in
        order until a sequence finishes); returns the sequences of the round (finished ones freed)."""
        if sched is not self._in_flight:
            raise SchedulerError("update() for a batch that is not in flight")
        self._in_flight, self._ahead = self._ahead, None  # the round scheduled ahead is now the one in flight
        logprobs = None
        if isinstance(next_tokens, SampledTokens):
            next_tokens, logprobs = next_tokens
        toks = np.asarray(next_tokens)
        if toks.ndim == 1:
            toks = toks[:, None]
        if toks.shape != (len(sched.seqs), sched.num_steps):
            raise SchedulerError(f"tokens of shape {tuple(np.shape(next_tokens))} for {len(sched.seqs)} sequences "
                                 f"and {sched.num_steps} steps")
        now = time.monotonic() if now is None else now
        finished = False
        max_len = self.cfg.max_model_len
        for i, (seq, row) in enumerate(zip(sched.seqs, toks.tolist())):
            if seq.status is SeqStatus.FINISHED:  # stopped or aborted while this round ran: its token is dropped
                if not self._in_any_round(seq):
                    self._release(seq)
                continue
            if logprobs is not None and seq.request.sampling.logprobs is not None:
                n = seq.request.sampling.logprobs
                seq.logprobs.append((float(logprobs.chosen[i]), logprobs.top_ids[i, :n].tolist(),
                                     logprobs.top_logprobs[i, :n].tolist()))
            if seq.first_token_time is None:
                seq.first_token_time = now
            seq.last_token_time = now
            req = seq.request
            stops = seq.stop_ids
            for tok in row:
                seq.token_ids.append(tok)
                if tok in stops:  # counted as an output token; the HTTP layer returns no text for it
                    seq.finish_reason = FinishReason.STOP
                    seq.stopped_on_token = True
                    break
                if (req.max_tokens is not None and seq.num_output_tokens >= req.max_tokens) \
                        or seq.num_tokens >= max_len:
                    seq.finish_reason = FinishReason.LENGTH
                    break
            seq.num_computed = seq.num_tokens - 1  # every token but the newest has its K/V in the cache
            if seq.finish_reason is not None:
                finished = True
        if finished:
            keep = []
            for seq in self.running:
                if seq.finish_reason is not None:
                    self._finish(seq, seq.finish_reason, free=not self._in_any_round(seq))
                else:
                    keep.append(seq)
            self.running = keep
        return sched.seqs

    def cancel(self, sched: ScheduledBatch) -> None:
        """Forget an in-flight batch whose step failed (its sequences are then failed by the engine)."""
        if sched is self._in_flight:
            self._in_flight = None
            self._ahead = None

    def fail_all(self, message: str) -> list[Sequence]:
        """Finish every sequence with an error (the executor failed); returns them."""
        self._in_flight = self._ahead = None
        out = []
        for seq in list(self.running) + list(self.waiting):
            seq.error = message
            out.append(self._finish(seq, FinishReason.ERROR))
        self.running, self.waiting = [], collections.deque()
        return out

    def _finish(self, seq: Sequence, reason: FinishReason, free: bool = True) -> Sequence:
        if free:
            self._release(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        return seq

    def _release(self, seq: Sequence) -> None:
        if seq.block_table:
            self.allocator.free(seq.block_table)
            seq.block_table = []

    def stats(self) -> dict:
        return {
            "waiting": len(self.waiting),
            "running": len(self.running),
            "free_kv_blocks": self.allocator.num_free,
            "num_kv_blocks": self.allocator.num_blocks,
            "kv_usage": 1.0 - self.allocator.num_free / max(1, self.allocator.num_blocks - 1),
            "preemptions": self.num_preemptions,
        }


def make_sequence(request: Request, dp_rank: int = 0) -> Sequence:
    return Sequence(request, dp_rank)
