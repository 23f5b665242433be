"""Continuous batching for one DP rank: FCFS admission, chunked prefill mixed with decode, paged KV blocks with
prefix caching, preemption by recompute.

Each step (`schedule`) plans its rows with the chunked or the phased policy (`engine.chunking`), builds one
`StepBatch`, and `update` applies the sampled tokens:
- a row whose chunk ends before the sequence's last token drops its sampled token (it only wrote K/V);
- every other row appends its token(s) and checks the stop conditions;
- full blocks whose K/V the step completed are registered in the prefix cache (`engine.block_manager`);
- a sequence that finishes releases its block references (cached blocks stay cached until evicted).

A sequence that needs a new block and finds none preempts the newest running sequence (possibly itself): its
references are dropped and it goes back to the front of the waiting queue to be recomputed from its prompt and
generated tokens (from the prefix cache where its blocks are still cached). Sampling is position-keyed, so the
output is unchanged.

Samples of one prompt (`n > 1`): a sample added with `after=parent` waits, held, until the parent has computed
its prompt, then goes to the front of the waiting queue and reuses the parent's cached full blocks.

Scheduling ahead (`schedule_ahead`): while a pure decode round is in flight and nobody waits, the next decode
round of the same sequences is built before the in-flight round's tokens are known: its token ids refer to them
(`actors.batch.prev_token`). A sequence certain to finish (max_tokens, max_model_len) is left out; one that stops
on a stop token rides along and its extra token is dropped. Blocks of a sequence that finishes while a round
that writes them is in flight are released only after that round.
"""
from __future__ import annotations

import collections
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np

from actors.batch import SampledTokens, StepBatch, prev_token
from engine.block_manager import BlockManager, chain_hashes
from engine.chunking import StepPlanner
from engine.grammar import GrammarViolation
from engine.logprob_rows import step_entries, step_rows
from engine.request import FinishReason, Request
from engine.scheduler_config import SchedulerConfig
from engine.scheduler_failures import SchedulerError, SchedulerFailures
from engine.sequence import Sequence, SeqStatus
from engine.prompt_rows import build_ask, take_answers
from engine.step_batch import build_batch


@dataclass
class ScheduledBatch:
    """The rows of one step, in batch order, and their `StepBatch`. is_prefill: some row computes a prefill chunk
    (a mixed step when decode rows come with it), so the step runs in the prefill phase and only once."""

    seqs: list[Sequence]
    batch: StepBatch
    is_prefill: bool
    num_steps: int = 1
    num_decode_rows: int = 0
    # (row, positions) of the rows whose prompt log-probabilities the step returns (`engine.prompt_rows`)
    prompt_owners: Optional[list[tuple[int, int]]] = None

    @property
    def num_tokens(self) -> int:
        return self.batch.num_tokens

    @property
    def kind(self) -> str:
        """"decode", "prefill" (prefill chunks only) or "mixed" (decode rows and prefill chunks)."""
        if not self.is_prefill:
            return "decode"
        return "mixed" if self.num_decode_rows else "prefill"


class Scheduler(StepPlanner, SchedulerFailures):
    def __init__(self, cfg: SchedulerConfig, num_kv_blocks: int, block_size: int, vocab_size: int = 0):
        """`vocab_size`: the model's (the allowed-token masks of `allowed_token_ids` rows are that wide; 0: no row
        may have them)."""
        self.cfg = cfg
        self.block_size = block_size
        self.mask_words = -(-vocab_size // 32)
        self.blocks = BlockManager(num_kv_blocks, block_size, cfg.enable_prefix_caching)
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_chunks = 0  # intermediate prefill chunks (their sampled token dropped)
        self._held: dict[str, list[Sequence]] = {}  # parent request id -> samples waiting for its prompt
        self._in_flight: Optional[ScheduledBatch] = None
        self._ahead: Optional[ScheduledBatch] = None  # the round scheduled ahead of `_in_flight`

    @property
    def allocator(self) -> BlockManager:
        """The block manager (the name of the earlier allocator; `num_free` counts free plus evictable blocks)."""
        return self.blocks

    # ---- queue management
    def add(self, seq: Sequence, after: Optional[Sequence] = None) -> None:
        """Queue `seq`; with `after` (another sample of the same prompt, in flight here), hold it until `after`
        has computed its prompt, so that it reuses its cached blocks."""
        seq.status = SeqStatus.WAITING
        if after is not None and not after.prefilled and not after.is_finished:
            self._held.setdefault(after.request_id, []).append(seq)
        else:
            self._queue(seq, front=False)

    def _queue(self, seq: Sequence, front: bool) -> None:
        """Into the waiting queue: at its back (`front`: its front, where a preempted sequence goes); under the
        priority policy behind (`front`: before) the waiting sequences of the same priority."""
        if self.cfg.scheduling_policy != "priority":
            (self.waiting.appendleft if front else self.waiting.append)(seq)
            return
        p, w = seq.request.priority, self.waiting
        i = 0 if front else len(w)
        if front:
            while i < len(w) and w[i].request.priority < p:
                i += 1
        else:
            while i and w[i - 1].request.priority > p:
                i -= 1
        w.insert(i, seq)

    def _release_held(self, parent: Sequence) -> None:
        """Queue `parent`'s held samples; those asking for prompt log-probabilities take the parent's (the same
        prompt), so they reuse its cached blocks instead of computing the prompt again."""
        for seq in reversed(self._held.pop(parent.request_id, ())):
            have, theirs = seq.prompt_lp, parent.prompt_lp
            if have is not None and theirs is not None and len(theirs) > len(have):
                seq.prompt_lp = [*theirs]
            self.waiting.appendleft(seq)

    @property
    def num_held(self) -> int:
        return sum(map(len, self._held.values()))

    def queued(self) -> list[Sequence]:
        """Every sequence not running: waiting, or held for its parent's prompt."""
        return [*self.waiting, *(s for group in self._held.values() for s in group)]

    def remove_queued(self, seq: Sequence) -> None:
        """Take a waiting or held sequence out of its queue (the caller finishes it)."""
        if seq in self.waiting:
            self.waiting.remove(seq)
            return
        for parent, group in self._held.items():
            if seq in group:
                group.remove(seq)
                if not group:
                    del self._held[parent]
                return

    def abort(self, request_id: str) -> Optional[Sequence]:
        """Remove a request wherever it is; returns its finished sequence (None if unknown)."""
        for seq in self.waiting:
            if seq.request_id == request_id:
                self.waiting.remove(seq)
                return self._finish(seq, FinishReason.ABORT)
        for parent, held in self._held.items():
            for seq in held:
                if seq.request_id == request_id:
                    held.remove(seq)
                    if not held:
                        del self._held[parent]
                    return self._finish(seq, FinishReason.ABORT)
        for seq in self.running:
            if seq.request_id == request_id:
                self.running.remove(seq)
                # a round in flight still writes its blocks: they are released when that round is updated
                return self._finish(seq, FinishReason.ABORT, free=not self._in_any_round(seq))
        return None

    def _in_any_round(self, seq: Sequence) -> bool:
        return any(r is not None and any(s is seq for s in r.seqs) for r in (self._in_flight, self._ahead))

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self._held)

    def cached_prefix_blocks(self, seq: Sequence) -> int:
        """How many of `seq`'s leading full blocks this rank's prefix cache holds (for DP placement)."""
        return len(self._cached_prefix(seq))

    # ---- one step
    def schedule(self) -> Optional[ScheduledBatch]:
        if self._in_flight is not None:
            raise SchedulerError("schedule() called twice without update()")
        seqs, hist, q = self._plan_chunked() if self.cfg.chunked else self._plan_phased()
        if not seqs:
            return None
        num_decode = sum(1 for s in seqs if s.prefilled)
        prefill = num_decode < len(seqs)
        steps = 1 if prefill else self._lookahead_steps(seqs)
        batch = build_batch(seqs, hist, q, mask_words=self.mask_words)
        owners = None
        if prefill:  # only prompt chunks can ask for prompt log-probabilities
            batch.prompt_lp, owners = build_ask(seqs, hist, q)
        sched = ScheduledBatch(seqs, batch, prefill, steps, num_decode, owners or None)
        self._in_flight = sched
        return sched

    def schedule_ahead(self, prev: ScheduledBatch) -> Optional[ScheduledBatch]:
        """The decode round after the in-flight `prev`, built before `prev`'s tokens are known (see the module
        docstring), or None: `prev` is not a one-step decode round, requests wait for admission, nobody
        continues, or the blocks it needs are not free (never preempts). Updated after `prev`."""
        if prev is not self._in_flight or self._ahead is not None:
            raise SchedulerError("schedule_ahead() needs the in-flight round and none scheduled ahead of it")
        if prev.is_prefill or prev.num_steps != 1 or self.waiting or self._held or prev.batch.extras is not None:
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
        if sum(need) > self.blocks.num_free:
            return None
        for seq, n in zip(cont, need):
            if n:
                seq.block_table.extend(self.blocks.allocate(n))
        batch = build_batch(cont, [s.num_tokens for s in cont], [1] * len(cont),
                            tokens=[prev_token(r) for r in rows], mask_words=self.mask_words)
        self._ahead = ScheduledBatch(cont, batch, False, 1, len(cont))
        return self._ahead

    def cancel_ahead(self) -> None:
        """Drop the round scheduled ahead before it was submitted (the blocks it reserved stay with their
        sequences, which need them for their next round anyway)."""
        self._ahead = None

    def build_alone(self, seq: Sequence) -> StepBatch:
        """The step batch of `seq` alone, from its host tokens (to check one sequence's rows by themselves)."""
        n = seq.num_tokens - seq.num_computed
        if self.cfg.chunked:
            n = min(n, self.cfg.max_num_batched_tokens)
        return build_batch([seq], [seq.num_computed], [max(1, n)], mask_words=self.mask_words)

    def update(self, sched: ScheduledBatch, next_tokens: np.ndarray, now: Optional[float] = None) -> list[Sequence]:
        """Apply one round's sampled tokens (int64 `[B]`, or `[B, num_steps]` for multi-step decode, applied in
        order until a sequence finishes); returns the sequences of the round (finished ones released)."""
        if sched is not self._in_flight:
            raise SchedulerError("update() for a batch that is not in flight")
        self._in_flight, self._ahead = self._ahead, None  # the round scheduled ahead is now the one in flight
        entries = prompt = None
        if isinstance(next_tokens, SampledTokens):
            next_tokens, lp, prompt = next_tokens
            # once per step, not per row: the rows' entries as outputs carry them, and their compact rows, which
            # the sequences keep (`engine.logprob_rows`); a row asking n keeps the first n of the step's `width`
            if lp is not None:
                width = lp.top_ids.shape[1]
                entries = step_entries(lp)
                rows, row_size = step_rows(lp)
        if sched.prompt_owners is not None:
            take_answers(sched.seqs, sched.prompt_owners, prompt)
        toks = np.asarray(next_tokens)
        if toks.ndim == 1:
            toks = toks[:, None]
        if toks.shape != (len(sched.seqs), sched.num_steps):
            raise SchedulerError(f"tokens of shape {tuple(np.shape(next_tokens))} for {len(sched.seqs)} sequences "
                                 f"and {sched.num_steps} steps")
        ex = sched.batch.extras
        if entries is not None and (len(entries) != len(sched.seqs) or (ex is not None and width < ex.num_logprobs)):
            raise SchedulerError(f"logprobs of shape {tuple(lp.top_ids.shape)} for {len(sched.seqs)} sequences "
                                 f"asking for up to {-1 if ex is None else ex.num_logprobs}")
        now = time.monotonic() if now is None else now
        ends = (sched.batch.num_history + sched.batch.q_seqlens).tolist() if sched.is_prefill else None
        finished = False
        max_len = self.cfg.max_model_len
        for i, (seq, row) in enumerate(zip(sched.seqs, toks.tolist())):
            if seq.status is SeqStatus.FINISHED:  # stopped or aborted while this round ran: its token is dropped
                if not self._in_any_round(seq):
                    self._release(seq)
                continue
            if ends is not None and ends[i] < seq.num_tokens:  # an intermediate chunk: K/V written, token dropped
                seq.num_computed = ends[i]
                self.num_chunks += 1
                self._register(seq)
                continue
            if entries is not None and (n := seq.request.sampling.logprobs) is not None:
                e = entries[i]
                if n != width:
                    e = (e[0], e[1][:n], e[2][:n])
                seq.new_logprobs.append(e)
                seq.logprobs.append(rows[i * row_size: i * row_size + 4 + 8 * n])
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
                if seq.grammar is not None and _grammar_ends(seq, tok):
                    break
                if (req.max_tokens is not None and seq.num_output_tokens >= req.max_tokens) \
                        or seq.num_tokens >= max_len:
                    seq.finish_reason = FinishReason.LENGTH
                    break
            seq.num_computed = seq.num_tokens - 1  # every token but the newest has its K/V in the cache
            self._register(seq)
            if not seq.prefilled:
                seq.prefilled = True
                if self._held:
                    self._release_held(seq)
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

    def _register(self, seq: Sequence) -> None:
        """Register the full blocks whose K/V is now complete (all positions < num_computed) in the prefix cache."""
        bm = self.blocks
        k = seq.num_computed // self.block_size
        if k <= seq.num_registered or not bm.enable_caching:
            return
        keys = chain_hashes(seq.token_ids, self.block_size, k, seq.block_hashes)
        table = seq.block_table
        for j in range(seq.num_registered, k):
            bm.register(table[j], keys[j])
        seq.num_registered = k

    def _finish(self, seq: Sequence, reason: FinishReason, free: bool = True) -> Sequence:
        if free:
            self._release(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        if self._held:
            self._release_held(seq)  # its samples compute their prompt themselves (from the cache if they can)
        return seq

    def _release(self, seq: Sequence) -> None:
        if seq.block_table:
            self.blocks.free(seq.block_table)
            seq.block_table = []
        seq.num_registered = 0

    def stats(self) -> dict:
        bm = self.blocks
        usable = max(1, bm.num_blocks - 1)
        return {
            "waiting": len(self.waiting) + self.num_held,
            "running": len(self.running),
            "free_kv_blocks": bm.num_free,  # free + cached blocks nobody references
            "num_kv_blocks": bm.num_blocks,
            "kv_usage": bm.num_referenced / usable,
            "referenced_kv_blocks": bm.num_referenced,
            "shared_kv_blocks": bm.num_shared,  # referenced by two or more sequences (a shared prefix)
            "preemptions": self.num_preemptions,
            "prefill_chunks": self.num_chunks,
            "chunked_prefill": self.cfg.chunked,
            "prefix_cache": bm.stats(),
        }


def _grammar_ends(seq: Sequence, tok: int) -> bool:
    """Advance `seq`'s grammar by its new token `tok`; True (the finish reason set) when that ends the sequence: the
    grammar is complete (reason stop; the token is content, its text returned) or `tok` broke it (reason error)."""
    try:
        if not seq.grammar.advance(tok):
            return False
        seq.finish_reason = FinishReason.STOP
    except GrammarViolation as exc:
        seq.finish_reason, seq.error = FinishReason.ERROR, str(exc)
    return True


def make_sequence(request: Request, dp_rank: int = 0) -> Sequence:
    return Sequence(request, dp_rank)
