"""Paged KV cache correctness on CPU: decode vs recompute, history vs single prefill, mixed batches."""
import pytest
import torch

from modeling.attn_metadata import SequenceSlice, build_step
from modeling.config import get_preset
from modeling.kv_cache import BlockAllocator, KVCacheSpec, PagedKVCache
from modeling.loader import init_random
from modeling.qwen3 import Qwen3ForCausalLM

BS = 4


@pytest.fixture(scope="module", params=["qwen3-tiny", "qwen3-moe-tiny"])
def model(request):
    torch.set_num_threads(2)
    m = Qwen3ForCausalLM(get_preset(request.param))
    init_random(m, seed=3)
    return m


def _cache(model, blocks=64):
    return PagedKVCache(KVCacheSpec.for_model(model.config, blocks, block_size=BS), "cpu")


def _full_logits(model, tokens):
    """Logits at every position of one sequence computed by a single prefill in a fresh cache."""
    cache = _cache(model)
    n = -(-len(tokens) // BS)
    ids, pos, meta = build_step([SequenceSlice(tokens, 0, list(range(1, n + 1)))], BS, "cpu")
    with torch.no_grad():
        return model.compute_logits(model(ids, pos, cache.layers, meta), torch.arange(len(tokens)))


def test_32_decode_steps_equal_full_recompute(model):
    cache = _cache(model)
    prompt = [5, 9, 13, 2, 77]
    table = list(range(1, 11))
    seq = list(prompt)
    ids, pos, meta = build_step([SequenceSlice(prompt, 0, table)], BS, "cpu")
    with torch.no_grad():
        logits = model.compute_logits(model(ids, pos, cache.layers, meta), meta.last_token_index)
        step_logits = []
        for _ in range(32):
            nxt = int(logits.argmax(-1))
            seq.append(nxt)
            ids, pos, meta = build_step([SequenceSlice([nxt], len(seq) - 1, table)], BS, "cpu")
            assert meta.is_decoding
            logits = model.compute_logits(model(ids, pos, cache.layers, meta), meta.last_token_index)
            step_logits.append(logits[0])
    full = _full_logits(model, seq)
    torch.testing.assert_close(torch.stack(step_logits), full[len(prompt):], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("split", [1, 4, 8, 11])
def test_prefill_with_history_equals_single_prefill(model, split):
    """Split points 4 and 8 end the history exactly on a block boundary."""
    tokens = [(i * 37 + 11) % 500 for i in range(14)]
    cache = _cache(model)
    table = [3, 7, 1, 9]
    with torch.no_grad():
        ids, pos, meta = build_step([SequenceSlice(tokens[:split], 0, table)], BS, "cpu")
        model(ids, pos, cache.layers, meta)
        ids, pos, meta = build_step([SequenceSlice(tokens[split:], split, table)], BS, "cpu")
        got = model.compute_logits(model(ids, pos, cache.layers, meta), torch.arange(len(tokens) - split))
    torch.testing.assert_close(got, _full_logits(model, tokens)[split:], atol=1e-4, rtol=1e-4)


def test_mixed_batch_lengths_and_phases(model):
    """One batch holds a fresh prefill, a prefill with history, a decode, and a sequence ending on a block edge."""
    seqs = {
        "fresh": [1, 2, 3, 4, 5, 6, 7],
        "history": [10, 11, 12, 13, 14, 15, 16, 17, 18, 19],
        "decode": [20, 21, 22, 23, 24, 25],
        "edge": [30, 31, 32, 33, 34, 35, 36, 37],  # 8 tokens = exactly 2 blocks
    }
    alloc = BlockAllocator(64)
    tables = {k: alloc.allocate(4) for k in seqs}
    cache = _cache(model)
    cached = {"fresh": 0, "history": 6, "decode": 5, "edge": 3}
    with torch.no_grad():
        warm = [SequenceSlice(seqs[k][: cached[k]], 0, tables[k]) for k in seqs if cached[k]]
        ids, pos, meta = build_step(warm, BS, "cpu")
        model(ids, pos, cache.layers, meta)
        slices = [SequenceSlice(seqs[k][cached[k]:], cached[k], tables[k]) for k in seqs]
        ids, pos, meta = build_step(slices, BS, "cpu")
        assert not meta.is_decoding
        logits = model.compute_logits(model(ids, pos, cache.layers, meta), meta.last_token_index)
    for i, k in enumerate(seqs):
        torch.testing.assert_close(logits[i], _full_logits(model, seqs[k])[-1], atol=1e-4, rtol=1e-4)


def test_padding_slot_is_skipped(model):
    """Slot -1 rows never write the cache (the graph padding convention)."""
    cache = _cache(model)
    before = [(k.clone(), v.clone()) for k, v in cache.layers]
    ids, pos, meta = build_step([SequenceSlice([1, 2, 3], 0, [2])], BS, "cpu")
    meta.slot_mapping.fill_(-1)
    with torch.no_grad():
        model(ids, pos, cache.layers, meta)
    for (k, v), (k0, v0) in zip(cache.layers, before):
        assert torch.equal(k, k0) and torch.equal(v, v0)
