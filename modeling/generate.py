"""Single-process generation on one model: the yardstick for tests and the `demo` job.

Runs eagerly (no graph runner): one batched prefill of all prompts, then one batched
greedy decode step per new token, on a paged KV cache it owns.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from modeling.attn_metadata import SequenceSlice, build_step
from modeling.kv_cache import BlockAllocator, CacheCapacityError, KVCacheSpec, PagedKVCache


class TokenIdError(ValueError):
    """A prompt holds a token id outside [0, vocab_size)."""


def validate_prompt(prompt: Sequence[int], vocab_size: int, index: int = 0) -> None:
    if len(prompt) == 0:
        raise TokenIdError(f"prompt {index} is empty")
    bad = [t for t in prompt if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size]
    if bad:
        raise TokenIdError(f"prompt {index} has token id {bad[0]!r} outside [0, {vocab_size})")


@dataclass
class GenerationResult:
    tokens: list[list[int]]
    step_seconds: list[float] = field(default_factory=list)  # [prefill, decode 1, decode 2, ...]


@torch.inference_mode()
def generate(
    model,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int = 16,
    block_size: int = 64,
    num_blocks: Optional[int] = None,
    kv_cache: Optional[PagedKVCache] = None,
) -> GenerationResult:
    """Generate `max_new_tokens` greedy tokens after each prompt. Raises before touching the cache when a
    prompt is invalid or the sequences cannot fit."""
    cfg = model.config
    for i, p in enumerate(prompts):
        validate_prompt(p, cfg.vocab_size, i)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    longest = max(len(p) for p in prompts) + max_new_tokens
    if longest > cfg.max_position_embeddings:
        raise CacheCapacityError(f"a sequence of {longest} tokens exceeds max_position_embeddings {cfg.max_position_embeddings}")
    if kv_cache is not None:
        block_size = kv_cache.spec.block_size
    per_seq = [-(-(len(p) + max_new_tokens) // block_size) for p in prompts]
    if kv_cache is None:
        need = sum(per_seq) + 1
        spec = KVCacheSpec.for_model(cfg, num_blocks or need, block_size, model.ctx.tp_size)
        kv_cache = PagedKVCache(spec, model.device)
    alloc = BlockAllocator(kv_cache.spec.num_blocks)
    if sum(per_seq) > alloc.num_free:
        raise CacheCapacityError(f"the prompts need {sum(per_seq)} KV blocks, the cache has {alloc.num_free}")
    tables = [alloc.allocate(n) for n in per_seq]
    width = max(per_seq)
    seqs = [list(p) for p in prompts]
    timings: list[float] = []
    slices = [SequenceSlice(list(p), 0, t) for p, t in zip(prompts, tables)]
    for step in range(max_new_tokens):
        t0 = time.perf_counter()
        ids, pos, meta = build_step(slices, block_size, model.device, width)
        hidden = model(ids, pos, kv_cache.layers, meta)
        logits = model.compute_logits(hidden, meta.last_token_index)
        nxt = logits.argmax(dim=-1).tolist()
        timings.append(time.perf_counter() - t0)
        for s, t in zip(seqs, nxt):
            s.append(t)
        slices = [SequenceSlice([s[-1]], len(s) - 1, t) for s, t in zip(seqs, tables)]
    return GenerationResult([s[len(p):] for s, p in zip(seqs, prompts)], timings)
