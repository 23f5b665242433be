"""The paged KV blocks of one DP rank: reference counts and automatic prefix caching. Plain Python, no torch.

Blocks are ids `1 .. num_blocks - 1` of the rank's KV arenas; block 0 is the reserved padding block and is never
handed out. Every other block is in exactly one of three states:

- **free**: reference count 0, no hash; in the free list, handed out first;
- **cached**: reference count 0, registered under the hash of its contents; kept, in LRU order, until the free
  list is empty and a new block is needed (then the least recently used one is evicted: its hash is dropped);
- **referenced**: held by one or more sequences (count >= 1), registered or not.

So `free + cached (ref 0) + referenced = num_blocks - 1` at all times (`check()`).

Prefix caching. A *full* block is registered under `block_hash(parent, tokens)`, the hash of the parent block's
hash and the block's own token ids, so a hash names the whole prefix up to the end of its block (tokens and
positions). A sequence registers a block only after the step that wrote all of its K/V has completed, and never
writes into a block after that (it writes positions >= its computed count only, and a cache hit covers computed
positions only). A new sequence looks its full-block hashes up in order and reuses the longest run of hits: the
same physical block id appears in several block tables, reference-counted; nothing is copied.

Hash and collisions: BLAKE2b with a 16-byte digest over the parent digest and the tokens as little-endian int64.
Two different prefixes share a key only on a 128-bit collision: by the birthday bound, a cache that ever sees
2**40 distinct blocks collides with probability about 2**-49, and BLAKE2b is a cryptographic hash, so a client
cannot construct a prompt whose key equals another client's prefix (Python's 64-bit tuple hash would allow both
accidental collisions at scale and constructed ones, which would hand one request another's K/V).
"""
from __future__ import annotations

import collections
import hashlib
from typing import Iterable, Optional, Sequence

import numpy as np

BlockHash = bytes
ROOT_HASH: BlockHash = b""  # the parent of a sequence's first block
PADDING_BLOCK = 0


class BlockCapacityError(RuntimeError):
    """More blocks were asked for than are free or evictable."""


class BlockManagerError(RuntimeError):
    """The block manager was misused (a block freed more often than acquired, an invariant broken)."""


def block_hash(parent: BlockHash, tokens: Sequence[int]) -> BlockHash:
    """The key of a full block: BLAKE2b-128 of the parent block's key and the block's token ids (int64)."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(np.asarray(tokens, dtype="<i8").tobytes())
    return h.digest()


def chain_hashes(tokens: Sequence[int], block_size: int, num_blocks: int, known: list[BlockHash]) -> list[BlockHash]:
    """Extend `known` (the keys of the first len(known) full blocks of `tokens`) to `num_blocks` keys, in place;
    returns it. Token lists only grow, so keys once computed stay valid."""
    while len(known) < num_blocks:
        j = len(known)
        known.append(block_hash(known[-1] if known else ROOT_HASH, tokens[j * block_size:(j + 1) * block_size]))
    return known


class BlockManager:
    """Reference-counted blocks with an LRU cache of registered full blocks (see the module docstring).

    `num_free` counts what `allocate` can hand out now: free blocks plus cached blocks nobody references."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True):
        if num_blocks < 2:
            raise ValueError(f"a KV cache needs at least 2 blocks (block 0 is reserved), got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self._ref = [0] * num_blocks
        self._free: list[int] = list(range(num_blocks - 1, 0, -1))  # a stack: pops 1, 2, 3 ... first
        self._evictable: collections.OrderedDict[int, None] = collections.OrderedDict()  # LRU first
        self._hash_of: dict[int, BlockHash] = {}
        self._block_of: dict[BlockHash, int] = {}
        self.queries = 0  # tokens looked up at admission
        self.hits = 0  # ... of which were served from the cache
        self.evictions = 0
        self.num_referenced = 0
        self.num_shared = 0  # blocks referenced by two or more sequences

    # ---- counts
    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        """Registered blocks, referenced or not."""
        return len(self._hash_of)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def is_cached(self, block: int) -> bool:
        return block in self._hash_of

    # ---- prefix lookup
    def match(self, hashes: Iterable[BlockHash]) -> list[int]:
        """The blocks of the longest run of cached keys from the start of `hashes` (references unchanged)."""
        out = []
        if not self.enable_caching:
            return out
        get = self._block_of.get
        for h in hashes:
            b = get(h)
            if b is None:
                break
            out.append(b)
        return out

    def num_reviving(self, blocks: Iterable[int]) -> int:
        """How many of `blocks` nobody references now (acquiring them takes them out of `num_free`)."""
        return sum(1 for b in blocks if self._ref[b] == 0)

    def record_query(self, num_tokens: int, num_hit: int) -> None:
        self.queries += num_tokens
        self.hits += num_hit

    # ---- references
    def acquire(self, blocks: Iterable[int]) -> None:
        """One more reference to each of `blocks` (cached blocks found by `match`)."""
        ref = self._ref
        for b in blocks:
            if b not in self._hash_of:
                raise BlockManagerError(f"block {b} is not cached: only cached blocks are shared")
            if ref[b] == 0:
                del self._evictable[b]
                self.num_referenced += 1
            elif ref[b] == 1:
                self.num_shared += 1
            ref[b] += 1

    def allocate(self, n: int) -> list[int]:
        """`n` blocks nobody references, with a reference each: free blocks first, then the least recently
        used cached blocks (evicted: their keys are dropped). Raises `BlockCapacityError` when short."""
        if n > self.num_free:
            raise BlockCapacityError(f"need {n} KV blocks, {self.num_free} free")
        out = []
        for _ in range(n):
            if self._free:
                b = self._free.pop()
            else:
                b, _ = self._evictable.popitem(last=False)
                del self._block_of[self._hash_of.pop(b)]
                self.evictions += 1
            self._ref[b] = 1
            out.append(b)
        self.num_referenced += n
        return out

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each of `blocks` (a sequence's table, in order). A block left unreferenced goes
        back to the free list, or, when registered, to the most recently used end of the cache. The table is
        walked from its end, so a sequence's tail blocks are evicted before its head blocks (a prefix is only
        useful from its start)."""
        ref = self._ref
        for b in reversed(blocks):
            if not 0 < b < self.num_blocks or ref[b] <= 0:
                raise BlockManagerError(f"block {b} is freed but holds no reference")
            ref[b] -= 1
            if ref[b] == 1:
                self.num_shared -= 1
            elif ref[b] == 0:
                self.num_referenced -= 1
                if b in self._hash_of:
                    self._evictable[b] = None
                else:
                    self._free.append(b)

    def register(self, block: int, key: BlockHash) -> bool:
        """Register a referenced full block under `key` once its K/V is written. False (nothing changes) when
        caching is off, or another block already holds `key` (two sequences computed the same prefix at once:
        the first stays the cached one, this one is freed as an ordinary block)."""
        if not self.enable_caching:
            return False
        if self._ref[block] <= 0:
            raise BlockManagerError(f"block {block} is registered but holds no reference")
        old = self._hash_of.get(block)
        if old is not None:
            if old != key:
                raise BlockManagerError(f"block {block} is registered under another key")
            return True
        if key in self._block_of:
            return False
        self._hash_of[block] = key
        self._block_of[key] = block
        return True

    # ---- introspection
    def stats(self) -> dict:
        return {"enabled": self.enable_caching, "queries": self.queries, "hits": self.hits,
                "hit_rate": self.hits / self.queries if self.queries else 0.0, "cached_blocks": self.num_cached,
                "evictable_blocks": self.num_evictable, "evictions": self.evictions}

    def check(self, tables: Optional[Iterable[Sequence[int]]] = None) -> None:
        """Raise `BlockManagerError` unless every invariant holds; with `tables` (every live block table), also
        that each block's reference count is the number of tables holding it."""
        ref, n = self._ref, self.num_blocks
        if ref[PADDING_BLOCK] != 0 or PADDING_BLOCK in self._free or PADDING_BLOCK in self._evictable:
            raise BlockManagerError("block 0 is in use")
        if min(ref) < 0:
            raise BlockManagerError("a negative reference count")
        free, evict = set(self._free), set(self._evictable)
        if len(free) != len(self._free) or free & evict:
            raise BlockManagerError("a block is listed twice among the free and cached blocks")
        referenced = {b for b in range(1, n) if ref[b] > 0}
        if (free | evict) & referenced:
            raise BlockManagerError("a referenced block is listed as free")
        if len(free) + len(evict) + len(referenced) != n - 1:
            raise BlockManagerError(f"free {len(free)} + cached {len(evict)} + referenced {len(referenced)} "
                                    f"!= {n - 1} blocks")
        if len(referenced) != self.num_referenced or sum(1 for b in referenced if ref[b] > 1) != self.num_shared:
            raise BlockManagerError("the referenced / shared counters drifted")
        if any(b not in self._hash_of for b in evict) or any(b in self._hash_of for b in free):
            raise BlockManagerError("a cached block has no key, or a free block has one")
        if {self._block_of[h] for h in self._hash_of.values()} != set(self._hash_of) \
                or len(self._block_of) != len(self._hash_of):
            raise BlockManagerError("the key <-> block maps disagree")
        if tables is not None:
            counts = [0] * n
            for t in tables:
                for b in t:
                    counts[b] += 1
            if counts != ref:
                bad = next(b for b in range(n) if counts[b] != ref[b])
                raise BlockManagerError(f"block {bad} has {ref[bad]} references but {counts[bad]} tables hold it")
