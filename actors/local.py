"""`LocalExecutor`: one rank in this process, no Ray (like vLLM's uniprocess executor).

Used by `graphline demo`, single-GPU benchmarks and tests that need the graph runner
without a cluster. Same start-up order as the coordinator: weights, KV cache, runner,
capture of every decode then every prefill bucket.
"""
from __future__ import annotations

import time
from typing import Optional, Sequence

import numpy as np

from actors.batch import StepBatch
from actors.rank import RankRuntime, RuntimeConfig, resolve_device
from modeling.generate import GenerationResult, validate_prompt
from modeling.kv_cache import BlockAllocator, CacheCapacityError
from parallel.context import ParallelContext


class LocalExecutor:
    def __init__(self, cfg: RuntimeConfig):
        self.cfg = cfg
        self.runtime = RankRuntime(cfg, ParallelContext(), resolve_device(cfg.device))

    def start(self, progress: bool = False) -> dict[str, float]:
        """Weights, KV cache, runner, then every bucket's capture; returns the runtime's timings."""
        rt = self.runtime
        rt.load_model()
        rt.allocate_kv_cache()
        rt.build_runner()
        rt.capture_all(progress)
        return dict(rt.timings)

    @property
    def num_kv_blocks(self) -> int:
        return self.runtime.kv_cache.spec.num_blocks

    def step(self, batches: Sequence[Optional[StepBatch]], num_steps: int = 1) -> list[Optional[np.ndarray]]:
        if len(batches) != 1:
            raise ValueError(f"a local executor has one DP rank, got {len(batches)} batches")
        return [self.runtime.execute(batches[0], num_steps=num_steps)]

    def greedy(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> GenerationResult:
        """Greedy generation of all prompts together (prefill then decode steps); blocks freed after."""
        vocab, bs = self.runtime.model_config.vocab_size, self.cfg.block_size
        for i, p in enumerate(prompts):
            validate_prompt(p, vocab, i)
        alloc = BlockAllocator(self.num_kv_blocks)
        need = [-(-(len(p) + max_new_tokens) // bs) for p in prompts]
        if max(len(p) for p in prompts) + max_new_tokens > self.cfg.max_model_len:
            raise CacheCapacityError(f"a sequence exceeds max_model_len {self.cfg.max_model_len}")
        tables = [alloc.allocate(n) for n in need]
        seqs = [list(p) for p in prompts]
        timings: list[float] = []
        batch = StepBatch.from_sequences(prompts, [0] * len(prompts), tables)
        for _ in range(max_new_tokens):
            t0 = time.perf_counter()
            nxt = self.runtime.execute(batch)
            timings.append(time.perf_counter() - t0)
            for s, t in zip(seqs, nxt.tolist()):
                s.append(int(t))
            batch = StepBatch.from_sequences([[s[-1]] for s in seqs], [len(s) - 1 for s in seqs], tables)
        return GenerationResult([s[len(p):] for s, p in zip(seqs, prompts)], timings)
