"""Paged KV cache: one K and one V arena per layer, `[num_blocks, block_size, kv_heads, head_dim]`.

Arenas start zeroed. Block 0 is the reserved padding block: never handed to a sequence, and is
where padded rows of graph buckets point. Arenas live for the runtime's lifetime (until
a reset resizes them); their addresses are captured by CUDA graphs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from modeling.config import ModelConfig

PADDING_BLOCK = 0


class CacheCapacityError(RuntimeError):
    """Not enough KV blocks (or a sequence longer than the cache allows)."""


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_blocks: int
    block_size: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if self.num_blocks < 2:
            raise CacheCapacityError(f"a KV cache needs at least 2 blocks (one is reserved), got {self.num_blocks}")
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")

    @property
    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.kv_heads * self.head_dim * elem

    @property
    def usable_tokens(self) -> int:
        return (self.num_blocks - 1) * self.block_size

    @staticmethod
    def for_model(cfg: ModelConfig, num_blocks: int, block_size: int = 64, tp_size: int = 1,
                  dtype: torch.dtype | None = None) -> "KVCacheSpec":
        kv_heads = max(1, cfg.num_kv_heads // tp_size)
        return KVCacheSpec(cfg.num_layers, num_blocks, block_size, kv_heads, cfg.head_dim, dtype or cfg.dtype)

    @staticmethod
    def from_memory_budget(cfg: ModelConfig, budget_bytes: int, block_size: int = 64, tp_size: int = 1,
                           dtype: torch.dtype | None = None) -> "KVCacheSpec":
        one = KVCacheSpec.for_model(cfg, 2, block_size, tp_size, dtype)
        n = budget_bytes // one.bytes_per_block
        if n < 2:
            raise CacheCapacityError(
                f"a KV budget of {budget_bytes} bytes holds {n} blocks of {one.bytes_per_block} bytes; need at least 2"
            )
        return KVCacheSpec.for_model(cfg, int(n), block_size, tp_size, dtype)


class PagedKVCache:
    """The per-layer arenas of one rank. `layers[i]` is `(k, v)`; `layers` is the model's `kv_caches` argument."""

    def __init__(self, spec: KVCacheSpec, device: torch.device | str):
        self.spec = spec
        shape = (spec.num_blocks, spec.block_size, spec.kv_heads, spec.head_dim)
        self.layers = [
            (torch.zeros(shape, dtype=spec.dtype, device=device), torch.zeros(shape, dtype=spec.dtype, device=device))
            for _ in range(spec.num_layers)
        ]

    @property
    def nbytes(self) -> int:
        return self.spec.bytes_per_block * self.spec.num_blocks


class BlockAllocator:
    """Free list of physical blocks 1..num_blocks-1 (block 0 is never handed out). Host-side, O(1)."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, 0, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise CacheCapacityError(f"need {n} KV blocks, {len(self._free)} free")
        out = self._free[-n:][::-1] if n else []
        del self._free[len(self._free) - n :]
        return out

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            if not 0 < b < self.num_blocks:
                raise ValueError(f"block {b} is not an allocatable block")
        self._free.extend(reversed(blocks))
