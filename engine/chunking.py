"""Which rows one step carries for one DP rank: decode rows, prefill chunks, admission with prefix-cache lookup.

`StepPlanner` is the scheduler's planning half (`engine.scheduler.Scheduler` inherits it); its methods read and
change the scheduler's queues and blocks and return the rows of a step as `(sequences, history, chunk sizes)`.

Chunked policy (`SchedulerConfig.chunked`, the default): a step has a budget of `max_num_batched_tokens`
tokens.
1. Every running sequence that decodes gets its one token first (a sequence that needs a new block and finds
   none preempts the newest running sequence, possibly itself). Decode rows are never starved; when they fill
   the budget, prefill waits for them to finish.
2. What is left goes to prefill chunks: the sequence whose prefill is under way first, then waiting sequences in
   FCFS order while the budget, `max_num_seqs` and the free blocks allow. Row i computes
   `token_ids[num_computed : num_computed + q_i]`; only the chunk that reaches the end of the tokens samples.
3. Admission reuses the longest run of the sequence's full blocks found in the prefix cache (at most
   `(num_tokens - 1) // block_size` blocks, so at least one token is computed and no cached block is written
   again) and allocates blocks for the rest of its tokens up front: a prefill under way never waits for blocks.

Phased policy (`enable_chunked_prefill=False`, or a budget >= max_model_len): vLLM-v0 style. If the head of the
waiting queue fits, admit FCFS while the budget allows (a single longer sequence alone) and run one prefill step
of whole uncached remainders; otherwise a decode step of every running sequence.
"""
from __future__ import annotations

import collections

from engine.block_manager import BlockManager, chain_hashes
from engine.sampling_rows import needs_extras
from engine.scheduler_config import SchedulerConfig
from engine.sequence import Sequence, SeqStatus

Rows = tuple[list[Sequence], list[int], list[int]]  # sequences, num_history, q (tokens fed) per row


class StepPlanner:
    """Mixin: the attributes below belong to `engine.scheduler.Scheduler`."""

    cfg: SchedulerConfig
    block_size: int
    blocks: BlockManager
    waiting: collections.deque[Sequence]
    running: list[Sequence]

    num_preemptions: int

    def _release(self, seq: Sequence) -> None:  # pragma: no cover - the scheduler's
        raise NotImplementedError

    def _queue(self, seq: Sequence, front: bool) -> None:  # pragma: no cover - the scheduler's
        raise NotImplementedError

    def _preempt(self, seq: Sequence) -> None:
        """Back to the waiting queue, to be recomputed (its blocks released): at its front (under the priority
        policy, the front of its priority's sequences)."""
        self._release(seq)
        seq.num_computed = 0
        seq.prefilled = False
        seq.num_preemptions += 1
        seq.status = SeqStatus.WAITING
        self.num_preemptions += 1
        self._queue(seq, front=True)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- the two policies
    def _plan_chunked(self) -> Rows:
        """Decode rows, then the prefill under way, then admissions, within the token budget (module docstring)."""
        self._preempt_for_waiting()
        self._reserve_decode_blocks()
        seqs = [s for s in self.running if s.prefilled]
        hist = [s.num_computed for s in seqs]
        q = [1] * len(seqs)
        left = self.cfg.max_num_batched_tokens - len(seqs)
        for s in self.running:
            if not s.prefilled and left > 0:
                n = min(s.num_tokens - s.num_computed, left)
                seqs.append(s)
                hist.append(s.num_computed)
                q.append(n)
                left -= n
        if left > 0:
            for s, n in self._admit(left, chunked=True):
                self.running.append(s)
                seqs.append(s)
                hist.append(s.num_computed)
                q.append(n)
        return seqs, hist, q

    def _plan_phased(self) -> Rows:
        """One prefill step of admitted sequences, or else one step of every running sequence."""
        self._preempt_for_waiting()
        admitted = self._admit(self.cfg.max_num_batched_tokens, chunked=False)
        if not admitted:
            self._reserve_decode_blocks()
            if not self.running:  # everything was preempted (or nothing ran): admit from a freed cache
                admitted = self._admit(self.cfg.max_num_batched_tokens, chunked=False)
        if admitted:
            seqs = [s for s, _ in admitted]
            self.running.extend(seqs)
            return seqs, [s.num_computed for s in seqs], [n for _, n in admitted]
        run = list(self.running)  # every unfed token of each (one per decoding sequence)
        return run, [s.num_computed for s in run], [s.num_tokens - s.num_computed for s in run]

    # ---- admission
    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """The cached blocks `seq` can reuse: its longest run of full blocks in the prefix cache, leaving at least
        its last token to compute (so a cached block is never written again), and no position whose prompt
        log-probability it still needs (`engine.prompt_rows`)."""
        if not self.blocks.enable_caching:
            return []
        k = (seq.num_tokens - 1) // self.block_size
        if seq.prompt_lp is not None:
            k = min(k, len(seq.prompt_lp) // self.block_size)
        return self.blocks.match(chain_hashes(seq.token_ids, self.block_size, k, seq.block_hashes)[:k])

    def _admit(self, budget: int, chunked: bool) -> list[tuple[Sequence, int]]:
        """Admit waiting sequences FCFS while they fit: (sequence, tokens it computes this step) each. A sequence's
        history is its cached prefix; blocks for all its tokens are taken now. Chunked: each takes what is left
        of `budget` (the last may get a partial chunk). Phased: whole remainders, a longer one only alone."""
        out: list[tuple[Sequence, int]] = []
        bm, bs = self.blocks, self.block_size
        while self.waiting and len(self.running) + len(out) < self.cfg.max_num_seqs and (budget > 0 or not chunked):
            seq = self.waiting[0]
            hits = self._cached_prefix(seq)
            cached = len(hits) * bs
            n = seq.num_tokens - cached
            if not chunked and out and n > budget:
                break
            need = self.blocks_for(seq.num_tokens) - len(hits)
            keep = self.cfg.watermark_blocks if (self.running or out) else 0
            if need + bm.num_reviving(hits) + keep > bm.num_free:
                break
            bm.acquire(hits)
            seq.block_table = hits + bm.allocate(need)
            seq.num_computed = seq.num_cached_tokens = cached
            if seq.prompt_cached_tokens < 0:
                seq.prompt_cached_tokens = min(cached, seq.prompt_len)
            seq.num_registered = len(hits)
            seq.prefilled = False
            bm.record_query(seq.num_tokens, cached)
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            take = min(n, budget) if chunked else n
            out.append((seq, take))
            budget -= take
        return out

    # ---- priority preemption
    def _victim(self) -> Sequence:
        """The running sequence to preempt: the newest; under the priority policy the one with the largest
        (priority, arrival time), as vLLM picks it."""
        if self.cfg.scheduling_policy != "priority":
            return self.running[-1]
        return max(reversed(self.running), key=lambda s: (s.request.priority, s.request.arrival_time))

    def _preempt_for_waiting(self) -> None:
        """Under the priority policy: while the head of the waiting queue has a lower priority value than a running
        sequence and cannot be admitted (no sequence slot, or too few free blocks for its uncached tokens), preempt
        the running sequence with the largest (priority, arrival) (vLLM's priority preemption)."""
        if self.cfg.scheduling_policy != "priority":
            return
        while self.waiting and self.running:
            head = self.waiting[0]
            victim = self._victim()
            if victim.request.priority <= head.request.priority:
                return
            hits = self._cached_prefix(head)
            need = self.blocks_for(head.num_tokens) - len(hits) + self.blocks.num_reviving(hits)
            if len(self.running) < self.cfg.max_num_seqs and need + self.cfg.watermark_blocks <= self.blocks.num_free:
                return
            self.running.remove(victim)
            self._preempt(victim)

    # ---- decode blocks
    def _reserve_decode_blocks(self) -> None:
        """A block for each running sequence whose next token starts one; preempts a running sequence (`_victim`,
        possibly the one that needs it) while none is free."""
        i = 0
        bs = self.block_size
        while i < len(self.running):
            seq = self.running[i]
            if len(seq.token_ids) <= len(seq.block_table) * bs:  # fast path: room in the last block
                i += 1
                continue
            need = self.blocks_for(seq.num_tokens) - len(seq.block_table)
            while need > self.blocks.num_free:
                victim = self._victim()
                j = self.running.index(victim)
                del self.running[j]
                self._preempt(victim)
                if victim is seq:
                    break
                if j < i:  # a row before it left: it moved up
                    i -= 1
            else:
                if need:
                    seq.block_table.extend(self.blocks.allocate(need))
                i += 1

    def _lookahead_steps(self, rows: list[Sequence]) -> int:
        """Decode steps for this round (multi-step decode): up to `decode_steps` when the round decodes every
        running sequence and none needs sampler extras (greedy or sampled with temperature / top-k / top-p; each
        step's draw is keyed by its own position, as a single step's is), capped by max_model_len and by the largest remaining max_tokens; the
        blocks the extra tokens need are allocated now (fewer steps when they are short; never preempts)."""
        k = self.cfg.decode_steps
        run = self.running
        if k <= 1 or not run or len(rows) != len(run) or any(
                not s.prefilled or needs_extras(s) for s in run):
            return 1
        k = min(k, min(self.cfg.max_model_len - s.num_tokens for s in run))
        left = [s.request.max_tokens - s.num_output_tokens for s in run if s.request.max_tokens is not None]
        if len(left) == len(run):
            k = min(k, max(left))
        while k > 1:
            need = [max(0, self.blocks_for(s.num_tokens + k - 1) - len(s.block_table)) for s in run]
            if sum(need) <= self.blocks.num_free:
                for s, n in zip(run, need):
                    if n:
                        s.block_table.extend(self.blocks.allocate(n))
                return k
            k //= 2
        return 1
