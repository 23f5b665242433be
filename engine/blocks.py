"""`BlockAllocator`: the scheduler's free list of physical KV blocks, plain Python (`engine/` holds no torch).
Block 0 is the rank's reserved padding block (`modeling.kv_cache.PADDING_BLOCK`) and is never handed out."""
from __future__ import annotations


class BlocksExhaustedError(RuntimeError):
    """More KV blocks were asked for than are free."""


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
            raise BlocksExhaustedError(f"need {n} KV blocks, {len(self._free)} free")
        out = self._free[-n:][::-1] if n else []
        del self._free[len(self._free) - n :]
        return out

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            if not 0 < b < self.num_blocks:
                raise ValueError(f"block {b} is not an allocatable block")
        self._free.extend(reversed(blocks))
