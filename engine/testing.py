"""`PagedToyExecutor`: a model-free executor that really uses the block tables (for engine tests).

Each step writes the fed tokens into a per-DP-rank paged token store through the block
tables, reads every sequence back from the store, and derives the next token from a hash
of what it read (and the seed / position when sampling). A scheduler that feeds the wrong
history, frees a block too early or hands one block to two sequences produces different
tokens or reads an unwritten slot (an error); a correct one produces the same tokens with
or without preemption, in any batch.
"""
from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from actors.batch import StepBatch
from engine.executor import RebuildableExecutor


class ToyExecutorError(RuntimeError):
    """The toy executor read a KV slot nobody wrote (a scheduler bug) or was told to fail."""


@dataclass(frozen=True)
class ToyModelConfig:
    vocab_size: int = 97
    max_position_embeddings: int = 4096


class PagedToyExecutor(RebuildableExecutor):
    def __init__(self, num_kv_blocks: int = 64, block_size: int = 4, vocab_size: int = 97, max_model_len: int = 256,
                 dp_size: int = 1, step_delay_s: float = 0.0):
        self.model_config = ToyModelConfig(vocab_size, max_model_len)
        self._num_blocks = num_kv_blocks
        self._block_size = block_size
        self._dp = dp_size
        self.max_model_len = max_model_len
        self.step_delay_s = step_delay_s
        self.store = np.full((dp_size, num_kv_blocks, block_size), -1, dtype=np.int64)
        self.steps: list[list[Optional[tuple[str, int]]]] = []  # per step, per DP rank: (phase, batch size)
        self.fail_next = 0  # fail this many upcoming steps
        self.resets = 0
        self.rebuilds = 0
        self.multi_steps = 0  # steps run with num_steps > 1
        self.ahead_rounds = 0  # submitted rounds whose token ids referred to the previous round
        self._last: dict[int, np.ndarray] = {}  # DP rank -> its last round's tokens (previous-step references)

    @property
    def num_kv_blocks(self) -> int:
        return self._num_blocks

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def dp_size(self) -> int:
        return self._dp

    def step(self, batches: Sequence[Optional[StepBatch]], num_steps: int = 1) -> list[Optional[np.ndarray]]:
        """`num_steps > 1`: multi-step decode like the ranks do it (each step fed the previous step's tokens);
        returns `[B, num_steps]` per DP rank."""
        if len(batches) != self._dp:
            raise ValueError(f"expected {self._dp} batches, got {len(batches)}")
        if self.fail_next:
            self.fail_next -= 1
            raise ToyExecutorError("injected rank failure")
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        for b in batches:
            if b is not None:
                b.check_multi_step(num_steps, self._block_size)
        self.steps.append([None if b is None else ("decode" if b.is_decoding else "prefill", b.batch_size)
                           for b in batches])
        if num_steps == 1:
            return [None if b is None else self._run(r, b) for r, b in enumerate(batches)]
        self.multi_steps += 1
        out: list[Optional[np.ndarray]] = []
        for r, b in enumerate(batches):
            if b is None:
                out.append(None)
                continue
            cols = []
            for _ in range(num_steps):
                toks = self._run(r, b)
                cols.append(toks)
                b = StepBatch(toks, b.q_seqlens, b.num_history + 1, b.block_tables, b.temperature, b.top_k, b.top_p,
                              b.seeds)
            out.append(np.stack(cols, axis=1))
        return out

    def submit(self, batches: Sequence[Optional[StepBatch]], num_steps: int = 1) -> list[Optional[np.ndarray]]:
        """Run the round now, filling previous-step references (negative ids) from each DP rank's last tokens;
        the ticket is the round's result. `collect` returns it."""
        resolved = []
        for r, b in enumerate(batches):
            if b is not None and b.num_tokens and int(b.token_ids.min()) < 0:
                last = self._last.get(r)
                b.validate(self.model_config.vocab_size, self._block_size, 0 if last is None else len(last))
                ids = b.token_ids.copy()
                ref = ids < 0
                ids[ref] = last[-ids[ref] - 1]
                b = StepBatch(ids, b.q_seqlens, b.num_history, b.block_tables, b.temperature, b.top_k, b.top_p,
                              b.seeds)
                self.ahead_rounds += 1
            resolved.append(b)
        out = self.step(resolved, num_steps)
        for r, o in enumerate(out):
            if o is not None:
                self._last[r] = o if o.ndim == 1 else o[:, -1]
        return out

    def collect(self, ticket: list[Optional[np.ndarray]]) -> list[Optional[np.ndarray]]:
        return ticket

    def _run(self, rank: int, b: StepBatch) -> np.ndarray:
        b.validate(self.model_config.vocab_size, self._block_size)
        store, bs = self.store[rank], self._block_size
        out = np.empty(b.batch_size, dtype=np.int64)
        start = 0
        for i in range(b.batch_size):
            q, h = int(b.q_seqlens[i]), int(b.num_history[i])
            table = b.block_tables[i]
            for j in range(q):
                pos = h + j
                store[table[pos // bs], pos % bs] = b.token_ids[start + j]
            start += q
            n = h + q
            seq = np.array([store[table[p // bs], p % bs] for p in range(n)], dtype=np.int64)
            if (seq < 0).any():
                raise ToyExecutorError(f"sequence {i} read an unwritten KV slot at position {int(np.argmax(seq < 0))}")
            out[i] = self._next(seq, float(b.temperature[i]), int(b.seeds[i]))
        return out

    def _next(self, seq: np.ndarray, temperature: float, seed: int) -> int:
        h = hashlib.blake2b(seq.tobytes(), digest_size=8)
        if temperature > 0:
            h.update(np.int64(seed if seed >= 0 else np.random.randint(1 << 62)).tobytes())
        return int.from_bytes(h.digest(), "little") % self.model_config.vocab_size

    def reference(self, prompt: Sequence[int], n: int, stop: Sequence[int] = (), temperature: float = 0.0,
                  seed: int = -1) -> list[int]:
        """The tokens a correct engine must return for `prompt` (no KV cache involved): a stop token ends them,
        and is the last one."""
        seq, out = list(prompt), []
        for _ in range(n):
            t = self._next(np.asarray(seq, dtype=np.int64), temperature, seed)
            seq.append(t)
            out.append(t)
            if t in stop:
                break
        return out

    def status(self) -> dict:
        return {"executor": "toy", "ranks": [{"rank": r, "dp_rank": r, "alive": True} for r in range(self._dp)],
                "resets": self.resets, "failures": []}

    def reset(self, recapture: bool = True, num_kv_blocks: Optional[int] = None, reload_weights: bool = False) -> dict:
        if num_kv_blocks is not None:
            self._num_blocks = num_kv_blocks
        self.store = np.full((self._dp, self._num_blocks, self._block_size), -1, dtype=np.int64)
        self.resets += 1
        return {"total_s": 0.0}

    def rebuild(self) -> None:
        self.rebuilds += 1
        self.store = np.full((self._dp, self._num_blocks, self._block_size), -1, dtype=np.int64)

    def shutdown(self) -> None:
        pass
