"""The engine's block manager: reference counts, prefix-cache keys, LRU eviction, and its invariants under random
admit / compute / finish / preempt sequences (a simulated KV store checks that a cache hit always names blocks
holding exactly the tokens it claims)."""
from __future__ import annotations

import random
import subprocess
import sys

import pytest

from engine.block_manager import (ROOT_HASH, BlockCapacityError, BlockManager, BlockManagerError, block_hash,
                                  chain_hashes)


def test_block_zero_is_never_handed_out_and_counts_add_up():
    bm = BlockManager(6, 4)
    got = bm.allocate(5)
    assert sorted(got) == [1, 2, 3, 4, 5] and bm.num_free == 0
    with pytest.raises(BlockCapacityError):
        bm.allocate(1)
    bm.free(got)
    assert bm.num_free == 5 and bm.num_referenced == 0
    bm.check()
    with pytest.raises(BlockManagerError):
        bm.free([got[0]])  # no reference left
    with pytest.raises(BlockManagerError):
        bm.free([0])


def test_keys_chain_over_the_parent_and_are_stable_across_processes():
    a = block_hash(ROOT_HASH, [1, 2, 3, 4])
    assert a == block_hash(b"", (1, 2, 3, 4)) and len(a) == 16
    assert block_hash(a, [5, 6, 7, 8]) != block_hash(block_hash(ROOT_HASH, [9, 2, 3, 4]), [5, 6, 7, 8])
    assert block_hash(ROOT_HASH, [1, 2, 3, 4]) != block_hash(ROOT_HASH, [1, 2, 3, 5])
    assert block_hash(ROOT_HASH, [2**40]) != block_hash(ROOT_HASH, [0])  # full int64 width
    code = "from engine.block_manager import block_hash; print(block_hash(b'', [1, 2, 3, 4]).hex())"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": "123", "PATH": ""}).stdout.strip()
    assert other == a.hex()  # no per-process salt: DP ranks and restarts agree
    keys = chain_hashes(list(range(10)), 4, 2, [])
    assert keys == [a := block_hash(ROOT_HASH, [0, 1, 2, 3]), block_hash(a, [4, 5, 6, 7])]
    assert chain_hashes(list(range(10)), 4, 2, keys) is keys and len(keys) == 2


def test_shared_blocks_are_reference_counted_and_stay_cached_after_release():
    bm = BlockManager(8, 4)
    tokens = list(range(12))
    keys = chain_hashes(tokens, 4, 3, [])
    a = bm.allocate(3)
    assert bm.match(keys) == []  # nothing registered before its K/V is written
    for b, k in zip(a, keys):
        assert bm.register(b, k)
    assert bm.match(keys) == a and bm.match(keys[:2] + [b"x" * 16]) == a[:2]
    bm.acquire(a[:2])  # a second sequence shares the first two blocks
    assert [bm.ref_count(b) for b in a] == [2, 2, 1] and bm.num_shared == 2 and bm.num_referenced == 3
    bm.free(a)
    assert [bm.ref_count(b) for b in a] == [1, 1, 0] and bm.num_shared == 0
    assert bm.num_free == 7 - 2 and bm.num_cached == 3 and bm.num_evictable == 1
    bm.free(a[:2])
    assert bm.num_free == 7 and bm.num_cached == 3 and bm.match(keys) == a
    bm.check()


def test_eviction_is_lru_only_when_the_free_list_is_empty_tail_blocks_first():
    bm = BlockManager(6, 2)  # 5 usable blocks
    keys = chain_hashes([1, 2, 3, 4, 5, 6], 2, 3, [])
    seq = bm.allocate(3)
    for b, k in zip(seq, keys):
        bm.register(b, k)
    bm.free(seq)
    assert bm.num_free == 5 and bm.evictions == 0
    bm.allocate(2)  # the two uncached free blocks first
    assert bm.evictions == 0 and bm.match(keys) == seq
    bm.allocate(1)  # then the least recently used cached block: the sequence's tail
    assert bm.evictions == 1 and bm.match(keys) == seq[:2]
    bm.acquire(seq[:1])  # touching the head makes it the most recently used
    bm.free(seq[:1])
    bm.allocate(1)
    assert bm.match(keys) == seq[:1] and bm.evictions == 2
    bm.check()


def test_a_duplicate_key_keeps_the_first_block_and_caching_can_be_off():
    bm = BlockManager(6, 2)
    k = block_hash(ROOT_HASH, [7, 7])
    a, b = bm.allocate(2)
    assert bm.register(a, k) and not bm.register(b, k) and bm.register(a, k)
    bm.free([a, b])
    assert bm.num_cached == 1 and bm.num_evictable == 1
    off = BlockManager(6, 2, enable_caching=False)
    (c,) = off.allocate(1)
    assert not off.register(c, k) and off.match([k]) == []
    with pytest.raises(BlockManagerError):
        off.acquire([c])
    with pytest.raises(BlockManagerError):
        bm.register(b, k)  # b holds no reference any more


@pytest.mark.parametrize("seed", range(8))
def test_invariants_hold_under_random_admit_compute_finish_preempt(seed):
    """Random admissions (prompts from a few shared prefixes, so hits happen), partial computes that register full
    blocks, finishes, preemptions and re-admissions, with evictions from a small pool. After every operation:
    reference counts match the live tables and are never negative, no block is in two lists, free + cached +
    referenced = total, block 0 is never handed out; and every cache hit names blocks whose simulated K/V holds
    exactly the tokens of the hit (so no cached block was ever handed out and overwritten while still cached)."""
    rng = random.Random(seed)
    bs, nblocks = 4, 24
    bm = BlockManager(nblocks, bs)
    store: dict[int, tuple] = {}  # block -> the tokens its "K/V" holds
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(4, 17))] for _ in range(3)]
    live: list[dict] = []  # {tokens, table, computed, registered, keys}
    queue: list[list[int]] = []
    hits = 0

    def admit(tokens: list[int]) -> bool:
        nonlocal hits
        keys: list[bytes] = []
        k = (len(tokens) - 1) // bs
        found = bm.match(chain_hashes(tokens, bs, k, keys)[:k])
        need = -(-len(tokens) // bs) - len(found)
        if need + bm.num_reviving(found) > bm.num_free:
            return False
        for j, b in enumerate(found):
            assert store[b] == tuple(tokens[j * bs:(j + 1) * bs]), "a cache hit names a block with other K/V"
        hits += len(found)
        bm.acquire(found)
        table = found + bm.allocate(need)
        assert 0 not in table and len(set(table)) == len(table)
        live.append({"tokens": tokens, "table": table, "computed": len(found) * bs, "registered": len(found),
                     "keys": keys})
        return True

    for _ in range(400):
        op = rng.random()
        if op < 0.35 or not live:
            tokens = queue.pop(0) if queue and rng.random() < 0.5 else \
                rng.choice(prefixes)[: rng.randrange(1, 17)] + [rng.randrange(50) for _ in range(rng.randrange(0, 12))]
            if not tokens:
                tokens = [1]
            if not admit(tokens):
                queue.append(tokens)
        elif op < 0.7:  # a step computes some tokens: write their K/V, register the completed full blocks
            s = rng.choice(live)
            end = min(len(s["tokens"]), s["computed"] + rng.randrange(1, 9))
            for p in range(s["computed"], end):
                b = s["table"][p // bs]
                assert bm.ref_count(b) == 1, "a shared block is written"
                blk = list(store.get(b, ())) if p % bs else []
                store[b] = tuple(blk + [s["tokens"][p]])
            s["computed"] = end
            k = end // bs
            keys = chain_hashes(s["tokens"], bs, k, s["keys"])
            for j in range(s["registered"], k):
                bm.register(s["table"][j], keys[j])
            s["registered"] = max(s["registered"], k)
        elif op < 0.9:  # finish
            s = live.pop(rng.randrange(len(live)))
            bm.free(s["table"])
        else:  # preempt: references dropped, re-admitted later (its registered blocks may still be cached)
            s = live.pop(rng.randrange(len(live)))
            bm.free(s["table"])
            queue.insert(0, s["tokens"])
        bm.check([s["table"] for s in live])
    assert hits > 0 and bm.evictions > 0  # the walk exercised both sharing and eviction
