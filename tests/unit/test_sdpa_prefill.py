"""`modeling.ops.sdpa_prefill` on CPU: the by-sequence split (long sequences one by one over gathered K/V, history
and new tokens merged by log-sum-exp; the rest through the paged path with the long ones masked) against the torch
reference of the paged prefill, with the "math" backend standing in for cuDNN (GPU: tests/gpu/test_triton_kernels.py)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from modeling.attention import paged_attention
from modeling.attn_metadata import HostLens, SequenceSlice, build_step
from modeling.ops import attention_ref, get_kernel_ops
from modeling.ops.sdpa_prefill import (SDPA_MIN_PAIRS, attend, attended_pairs, long_sequences, merge,
                                       prefill_attention_by_sequence)

PAGE, HKV, D = 16, 2, 32


def _step(specs: list[tuple[int, int]], hq: int, seed: int = 0):
    """specs: (history, new tokens) per sequence; caches filled at random (every position counts as stored)."""
    g = torch.Generator().manual_seed(seed)
    pages_needed = [-(-(h + n) // PAGE) for h, n in specs]
    perm = (torch.randperm(sum(pages_needed), generator=g) + 1).tolist()  # block 0 stays the padding block
    slices, at = [], 0
    for (hist, new), n_pages in zip(specs, pages_needed):
        slices.append(SequenceSlice(tokens=[1] * new, num_history=hist, block_table=perm[at:at + n_pages]))
        at += n_pages
    _, _, meta = build_step(slices, PAGE, "cpu")
    kc = torch.randn(len(perm) + 1, PAGE, HKV, D, generator=g).bfloat16()
    vc = torch.randn(len(perm) + 1, PAGE, HKV, D, generator=g).bfloat16()
    q = torch.randn(meta.num_tokens, hq, D, generator=g).bfloat16()
    return q, kc, vc, meta


def _args(q, kc, vc, meta):
    return (q, kc, vc, meta.q_start_loc, meta.q_seqlens, meta.kv_seqlens, meta.block_tables, D ** -0.5)


@pytest.mark.parametrize("hq", [2, 4])
def test_long_sequences_split_out_equal_the_paged_reference(hq):
    # a prompt alone (820 pairs), a chunk after history (2211), a short chunk (50) and a decode row (71)
    q, kc, vc, meta = _step([(0, 40), (50, 33), (7, 5), (70, 1)], hq)
    seen = []

    def fallback(*a, **kw):
        seen.append(a[4].tolist())
        return attention_ref.prefill_attention(*a, **kw)

    out = prefill_attention_by_sequence(*_args(q, kc, vc, meta), host=meta.host_lens, fallback=fallback,
                                        max_q_seqlen=meta.max_q_seqlen, backend="math", min_pairs=500)
    ref = attention_ref.prefill_attention(*_args(q, kc, vc, meta), max_q_seqlen=meta.max_q_seqlen)
    assert seen == [[0, 0, 5, 1]]  # the paged path ran only the short sequences
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    assert not torch.equal(out[:40], torch.zeros_like(out[:40]))


def test_every_sequence_long_skips_the_paged_path_and_short_ones_take_it_whole():
    q, kc, vc, meta = _step([(0, 40), (20, 36)], 4, seed=1)
    calls = []

    def fallback(*a, **kw):
        calls.append(a)
        return attention_ref.prefill_attention(*a, **kw)

    args = _args(q, kc, vc, meta)
    out = prefill_attention_by_sequence(*args, host=meta.host_lens, fallback=fallback, backend="math", min_pairs=500)
    assert calls == []
    torch.testing.assert_close(out.float(), attention_ref.prefill_attention(*args).float(), atol=2e-2, rtol=2e-2)
    out = prefill_attention_by_sequence(*args, host=meta.host_lens, fallback=fallback, backend="math", min_pairs=2000)
    assert len(calls) == 1 and calls[0][4] is meta.q_seqlens  # nothing long: the plain paged call
    torch.testing.assert_close(out, attention_ref.prefill_attention(*args))


def test_fp32_caches_take_the_paged_path():
    q, kc, vc, meta = _step([(0, 40)], 2)
    args = (q.float(), kc.float(), vc.float(), *_args(q, kc, vc, meta)[3:])
    calls = []
    out = prefill_attention_by_sequence(*args, host=meta.host_lens, backend="math", min_pairs=8,
                                        fallback=lambda *a, **kw: calls.append(1) or attention_ref.prefill_attention(
                                            *a, **kw))
    assert calls == [1]
    torch.testing.assert_close(out, attention_ref.prefill_attention(*args))


def test_merge_of_two_key_sets_is_the_softmax_over_both():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, 9, D, generator=g)
    k = torch.randn(1, 2, 30, D, generator=g)
    v = torch.randn(1, 2, 30, D, generator=g)
    whole, lse = attend(q, k, v, False, 0.2, "math")
    a, la = attend(q, k[:, :, :13], v[:, :, :13], False, 0.2, "math")
    b, lb = attend(q, k[:, :, 13:], v[:, :, 13:], False, 0.2, "math")
    torch.testing.assert_close(merge(a, la, b, lb), whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.logaddexp(la, lb), lse, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="unknown attention backend"):
        attend(q, k, v, False, 0.2, "nope")


def test_build_step_carries_host_lengths_for_prefill_only():
    _, _, meta = build_step([SequenceSlice([1, 2, 3], 4, [1]), SequenceSlice([5], 9, [2])], PAGE, "cpu")
    assert isinstance(meta.host_lens, HostLens)
    for host, dev in zip(meta.host_lens, (meta.q_start_loc, meta.q_seqlens, meta.kv_seqlens)):
        np.testing.assert_array_equal(host, dev.numpy())
    _, _, decode = build_step([SequenceSlice([1], 4, [1]), SequenceSlice([5], 9, [2])], PAGE, "cpu")
    assert decode.is_decoding and decode.host_lens is None


def test_paged_attention_takes_the_split_when_the_ops_have_it():
    q, kc, vc, meta = _step([(0, 40), (3, 2)], 4, seed=2)
    ops = get_kernel_ops("cpu")
    assert ops.prefill_by_sequence is None  # the torch backend has no cuDNN path
    k = torch.zeros(meta.num_tokens, HKV, D).bfloat16()
    taken = []

    def by_sequence(*a, **kw):
        taken.append(kw["host"])
        return prefill_attention_by_sequence(*a, **kw, fallback=attention_ref.prefill_attention, backend="math",
                                             min_pairs=500)

    split_ops = dataclasses.replace(ops, store_kv=lambda *a: None, prefill_by_sequence=by_sequence)
    out = paged_attention(q, k, k, [(kc, vc)], 0, meta, D ** -0.5, split_ops)
    assert taken == [meta.host_lens]
    ref = paged_attention(q, k, k, [(kc, vc)], 0, meta, D ** -0.5, dataclasses.replace(ops, store_kv=lambda *a: None))
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    no_host = dataclasses.replace(meta, host_lens=None)  # e.g. a graph's bucket metadata: the paged path
    paged_attention(q, k, k, [(kc, vc)], 0, no_host, D ** -0.5, split_ops)
    assert len(taken) == 1


def test_pairs_pick_the_long_sequences_alike_on_host_and_device():
    q = np.array([2048, 2048, 8192, 1, 4096], dtype=np.int32)
    kv = np.array([2048, 2048 + 6144, 8192, 30000, 4096 + 12288], dtype=np.int32)
    pairs = attended_pairs(q, kv)
    assert pairs.tolist() == [2048 * 2049 // 2, 2048 * 6144 + 2048 * 2049 // 2, 8192 * 8193 // 2, 30000,
                              4096 * 12288 + 4096 * 4097 // 2]
    assert attended_pairs(torch.from_numpy(q), torch.from_numpy(kv)).tolist() == pairs.tolist()
    # measured (H100): 2048 fresh and 2048 after 6144 stay on the paged kernel, 8192 fresh and 4096 after 12288 go
    assert long_sequences((np.zeros(5, np.int32), q, kv)).tolist() == [2, 4]
    assert long_sequences((np.zeros(5, np.int32), q, kv), SDPA_MIN_PAIRS * 100).size == 0


def test_steps_with_a_long_sequence_stay_out_of_the_full_prefill_graphs():
    from types import SimpleNamespace

    from modeling.prefill_buffers import PrefillGraphBuffersMixin

    class Model(PrefillGraphBuffersMixin):
        def __init__(self, ops):
            self.attn_ops, self.ctx, self.layers = ops, SimpleNamespace(tp_size=1, ep_size=1), []

    def step(hist: int, new: int):
        _, _, meta = build_step([SequenceSlice([1] * new, hist, list(range(1, 2 + (hist + new) // PAGE)))], PAGE,
                                "cpu")
        return SimpleNamespace(mrope_position_ids=None, state_ids=None, attn_metadata=meta)

    ops = dataclasses.replace(get_kernel_ops("cpu"), capturable=True)
    split = Model(dataclasses.replace(ops, prefill_by_sequence=prefill_attention_by_sequence))
    assert split.supports_prefill_graph(step(0, 2048))
    assert not split.supports_prefill_graph(step(12288, 2048))  # 29.3M pairs: cuDNN in the piecewise plans
    assert Model(ops).supports_prefill_graph(step(12288, 2048))  # option off: the graph as before
