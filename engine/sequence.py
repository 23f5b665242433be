"""`Sequence`: the scheduler's mutable state of one request (tokens, KV blocks, status).

Invariant: positions [0, num_computed) of `token_ids` have their K/V in the blocks of
`block_table`; a step feeds a chunk `token_ids[num_computed:num_computed + q]` and samples the
token at position `num_computed + q`, which is kept only when the chunk reaches the end of
`token_ids` (the last chunk of a prefill, or a decode row). Admission sets `num_computed` to the
tokens found in the prefix cache (whole blocks, at least one token left to compute). Preemption
by recompute drops the blocks and sets `num_computed` to 0, so the prompt and every generated
token are fed again (from the prefix cache where their blocks are still cached).
`block_hashes[j]` is the prefix-cache key of full block j (`engine.block_manager`); the first
`num_registered` blocks of the table are registered in the cache.
"""
from __future__ import annotations

import enum
import secrets
from typing import Optional

import numpy as np

from engine.logprob_rows import entries
from engine.request import FinishReason, Request, RequestOutput
from engine.sampling_rows import extras_flags


class SeqStatus(str, enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    __slots__ = ("request", "token_ids", "prompt_len", "block_table", "num_computed", "status", "finish_reason",
                 "num_preemptions", "first_token_time", "last_token_time", "_emitted", "dp_rank", "error",
                 "sampling_row", "num_failures", "stop_ids", "stopped_on_token", "logprobs", "new_logprobs",
                 "block_hashes", "num_registered", "prefilled", "num_cached_tokens", "prompt_cached_tokens", "extras_flags",
                 "_table_array", "grammar", "prompt_lp")

    def __init__(self, request: Request, dp_rank: int = 0):
        self.request = request
        self.token_ids: list[int] = list(request.prompt_token_ids)
        self.prompt_len = len(request.prompt_token_ids)
        self.block_table: list[int] = []
        self._table_array: Optional[tuple[list[int], np.ndarray]] = None  # (the list it was made from, its array)
        self.num_computed = 0
        self.status = SeqStatus.WAITING
        self.finish_reason: Optional[FinishReason] = None
        self.num_preemptions = 0
        self.first_token_time: Optional[float] = None
        self.last_token_time: Optional[float] = None
        self._emitted = 0  # generated tokens already reported in a RequestOutput
        self.dp_rank = dp_rank
        self.error: Optional[str] = None
        self.num_failures = 0  # executor failures (a rank died or hung) this sequence was in flight for
        self.stop_ids = request.stop_token_ids  # the engine adds the model's EOS ids (unless ignore_eos)
        self.stopped_on_token = False
        # when the request asked for logprobs: per generated token its entry (chosen logprob, top ids, top logprobs)
        # as a compact row (`engine.logprob_rows`: bytes, which the garbage collector never walks); `new_logprobs`:
        # the entries not reported yet, as the outputs carry them (lists), which `take_output` hands out (the
        # scheduler appends to both)
        self.logprobs: list[bytes] = []
        self.new_logprobs: list[tuple[float, list[int], list[float]]] = []
        self.block_hashes: list[bytes] = []  # prefix-cache keys of the full blocks computed so far (tokens only grow)
        self.num_registered = 0  # leading blocks of block_table registered in the prefix cache
        self.prefilled = False  # the prompt (and, after a preemption, the generated tokens) is computed
        self.num_cached_tokens = 0  # tokens served from the prefix cache at the last admission
        self.prompt_cached_tokens = -1  # prompt tokens served from the prefix cache at the first (-1: not yet)
        sp = request.sampling
        # (temperature, top_k, top_p, seed): this sequence's row of a step's sampling arrays. An unseeded sampled
        # request gets its seed here, once, on the driver: every rank that samples it draws the same token, and a
        # preempted or requeued sequence samples the same tokens again.
        seed = sp.seed if sp.seed is not None else (secrets.randbits(63) if sp.temperature > 0 else -1)
        self.sampling_row = (sp.temperature, sp.top_k, sp.top_p, seed)
        # which sampler extras the request uses (`engine.sampling_rows`)
        self.extras_flags = extras_flags(sp, request.grammar is not None)
        # this sequence's position in the request's grammar (`engine.grammar`); None: free text
        self.grammar = request.grammar.start() if request.grammar is not None else None
        # prompt log-probabilities (`engine.prompt_rows`): one entry per prompt token after the first, collected while
        # the prompt is computed (every sample of an `n` > 1 prompt computes its own); None when not asked
        self.prompt_lp: Optional[list] = [] if sp.prompt_logprobs is not None else None

    def block_table_array(self) -> np.ndarray:
        """`block_table` as int32 `[len]`, made again only when the table changed: tables only grow (`extend`) or are
        replaced whole, so the list object and its length identify the contents. Read-only to callers."""
        t, c = self.block_table, self._table_array
        if c is None or c[0] is not t or len(c[1]) != len(t):
            c = self._table_array = (t, np.array(t, dtype=np.int32))
        return c[1]

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len:]

    @property
    def num_new_tokens(self) -> int:
        """Tokens the next step feeds (the whole sequence after a preemption, else one)."""
        return len(self.token_ids) - self.num_computed

    @property
    def has_new_output(self) -> bool:
        """Generated tokens not yet reported by `take_output`."""
        return self.num_tokens - self.prompt_len > self._emitted

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    def take_output(self) -> RequestOutput:
        """The progress since the last call (marks the new tokens as reported). `token_ids` (every generated
        token) is filled in the final output only: copying it every step would cost O(length) per step."""
        start = self.prompt_len + self._emitted
        new = self.token_ids[start:]
        self._emitted += len(new)
        done = self.status is SeqStatus.FINISHED
        req = self.request
        lps = every = prompt = None
        if self.prompt_lp is not None and (done or start == self.prompt_len):  # the first output and the last
            prompt = [None, *self.prompt_lp]
        if req.sampling.logprobs is not None:
            lps, self.new_logprobs = self.new_logprobs, []
            if done:
                every = entries(self.logprobs, req.sampling.logprobs)
        return RequestOutput(req.request_id, req.prompt_token_ids, new, self.token_ids[self.prompt_len:] if done else [],
                             self._emitted, done, self.finish_reason, req.arrival_time, self.first_token_time,
                             self.last_token_time if done else None, self.num_preemptions, self.error,
                             done and self.stopped_on_token, lps, every, max(0, self.prompt_cached_tokens), prompt)

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id}, {self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed}, blocks={len(self.block_table)})")
