"""Shared helpers for model-level GPU tests: runtimes on one GPU, sequence bookkeeping, steps."""
from __future__ import annotations

import numpy as np
import torch

from actors.rank import RankRuntime, RuntimeConfig
from graphrunner.config import GraphRunnerConfig
from graphrunner.step import ForwardStep
from modeling.attn_metadata import build_step_from_arrays
from modeling.kv_cache import BlockAllocator
from modeling.ops.options import KernelOptions
from parallel.context import ParallelContext


def make_runtime(model: str = "qwen3-0.6b", blocks: int = 512, max_len: int = 4096, capture: bool = True,
                 dtype: str | None = None, head_graph_max_batch: int | None = None,
                 kernels: KernelOptions | None = None, **graph) -> RankRuntime:
    extra = {} if head_graph_max_batch is None else {"head_graph_max_batch": head_graph_max_batch}
    if kernels is not None:
        extra["kernels"] = kernels
    cfg = RuntimeConfig(model=model, device="cuda", num_kv_blocks=blocks, max_model_len=max_len, dtype=dtype,
                        graph=GraphRunnerConfig(**graph), **extra)
    rt = RankRuntime(cfg, ParallelContext(), torch.device("cuda", 0))
    rt.load_model()
    rt.allocate_kv_cache()
    rt.build_runner()
    if capture:
        rt.capture_all()
    return rt


class Seqs:
    """Host bookkeeping of sequences on one runtime's cache: tokens and block tables."""

    def __init__(self, rt: RankRuntime):
        self.rt = rt
        self.alloc = BlockAllocator(rt.kv_cache.spec.num_blocks)
        self.bs = rt.cfg.block_size
        self.width = rt.cfg.max_blocks_per_seq

    def new(self, total_len: int) -> list[int]:
        return self.alloc.allocate(-(-total_len // self.bs))

    def step(self, chunks: list[list[int]], history: list[int], tables: list[list[int]], **kw) -> ForwardStep:
        tab = np.zeros((len(chunks), self.width), dtype=np.int32)
        for i, t in enumerate(tables):
            tab[i, : len(t)] = t
        ids, pos, meta = build_step_from_arrays(
            np.array([x for c in chunks for x in c], dtype=np.int64), np.array([len(c) for c in chunks], dtype=np.int32),
            np.array(history, dtype=np.int32), tab, self.bs, self.rt.device)
        return ForwardStep(ids, pos, self.rt.kv_cache.layers, meta, **kw)


def random_tokens(rng: np.random.Generator, n: int, vocab: int) -> list[int]:
    return rng.integers(1, vocab, n).tolist()


def eager_bucket(rt: RankRuntime, step: ForwardStep, tokens_bucket: int) -> torch.Tensor:
    """The model run eagerly on bucket-padded graph inputs (zero tail) with the live metadata."""
    n = step.num_tokens
    ids = torch.zeros(tokens_bucket, dtype=torch.int64, device=rt.device)
    pos = torch.zeros(tokens_bucket, dtype=torch.int64, device=rt.device)
    ids[:n], pos[:n] = step.input_ids, step.position_ids
    return rt.model(ids, pos, step.kv_caches, step.attn_metadata)[:n]
