"""Triton paged-attention kernels against the torch reference (`modeling.ops.attention_ref`).

GPU only (marker `gpu`); collection is safe without CUDA or Triton. Caches are
`[N, bs, Hkv, D]` with random, non-contiguous block ids (block 0 reserved).
"""
from __future__ import annotations

import random

import pytest
import torch

from modeling.attn_metadata import AttentionMetadata, SequenceSlice, build_step
from modeling.ops import attention_ref as ref

try:
    from modeling.ops import triton_attention as tri
    from modeling.ops.triton_decode import DecodeConfig, decode_counters
except ImportError:  # no triton: collection still succeeds, every test is skipped
    tri = None
    DecodeConfig = decode_counters = None

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(tri is None, reason="triton is not installed")]

ATOL = RTOL = 2e-2
DEV = "cuda"


class PagedBatch:
    """Random caches plus metadata for sequences with `(q_len, history)` each."""

    def __init__(
        self,
        shape: list[tuple[int, int]],
        hkv: int,
        d: int,
        bs: int,
        dtype: torch.dtype,
        seed: int,
        width: int | None = None,
        spare_blocks: int = 8,
    ) -> None:
        rng = random.Random(seed)
        torch.manual_seed(seed)
        need = [-(-(n + h) // bs) for n, h in shape]
        self.num_blocks = sum(need) + spare_blocks + 1
        ids = list(range(1, self.num_blocks))
        rng.shuffle(ids)
        tables = [[ids.pop() for _ in range(k)] for k in need]
        slices = [SequenceSlice([0] * n, h, t) for (n, h), t in zip(shape, tables)]
        self.k_cache = torch.randn(self.num_blocks, bs, hkv, d, device=DEV).to(dtype)
        self.v_cache = torch.randn(self.num_blocks, bs, hkv, d, device=DEV).to(dtype)
        self.m: AttentionMetadata = build_step(slices, bs, DEV, max_blocks_per_seq=width)[2]


def _close(out: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(out.float(), expected.float(), atol=ATOL, rtol=RTOL)


# ----------------------------------------------------------------------------- store_kv


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("bs", [16, 64])
@pytest.mark.parametrize("hkv,d", [(8, 128), (2, 64), (1, 128)])
def test_store_kv_exact_and_skips_padding(dtype: torch.dtype, bs: int, hkv: int, d: int) -> None:
    torch.manual_seed(bs + hkv + d)
    num_blocks, n, t = 12, 37, 45  # rows n..t-1 are bucket padding
    k_cache = torch.randn(num_blocks, bs, hkv, d, device=DEV).to(dtype)
    v_cache = torch.randn(num_blocks, bs, hkv, d, device=DEV).to(dtype)
    k = torch.randn(t, hkv, d, device=DEV).to(dtype)
    v = torch.randn(t, hkv, d, device=DEV).to(dtype)
    slots = torch.randperm((num_blocks - 1) * bs, device=DEV)[:n] + bs
    slots[::5] = -1
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    ref.store_kv(k, v, expected_k, expected_v, slots)
    before_k = k_cache.clone()
    tri.store_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    written = torch.zeros(num_blocks * bs, dtype=torch.bool, device=DEV)
    written[slots[slots >= 0]] = True
    untouched = ~written.view(num_blocks, bs)
    assert torch.equal(k_cache[untouched], before_k[untouched])


def test_store_kv_strided_rows_and_int32_slots() -> None:
    torch.manual_seed(3)
    hq, hkv, d, bs = 16, 8, 128, 16
    qkv = torch.randn(20, hq + 2 * hkv, d, device=DEV, dtype=torch.bfloat16)
    k, v = qkv[:, hq : hq + hkv], qkv[:, hq + hkv :]
    k_cache = torch.zeros(6, bs, hkv, d, device=DEV, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([16, 95, -1, 17, 40, 63, 64], device=DEV, dtype=torch.int32)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    ref.store_kv(k, v, expected_k, expected_v, slots.long())
    tri.store_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


def test_store_kv_cuda_graph_replay() -> None:
    hkv, d, bs, n = 4, 64, 16, 24
    k_cache = torch.zeros(10, bs, hkv, d, device=DEV, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    k = torch.randn(n + 8, hkv, d, device=DEV, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    slots = torch.full((n,), -1, device=DEV, dtype=torch.long)
    tri.store_kv(k, v, k_cache, v_cache, slots)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tri.store_kv(k, v, k_cache, v_cache, slots)
    new_slots = torch.randperm(9 * bs, device=DEV)[:n] + bs
    new_slots[3] = -1
    slots.copy_(new_slots)
    k.copy_(torch.randn_like(k))
    v.copy_(torch.randn_like(v))
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    ref.store_kv(k, v, expected_k, expected_v, slots)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


# ----------------------------------------------------------------------------- decode

DECODE_LENS = [1, 15, 16, 64, 65, 127, 128, 300, 1000, 1024]  # includes exact block boundaries


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bs", [16, 64])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_decode_matches_reference(dtype: torch.dtype, bs: int, d: int, group: int) -> None:
    hkv = 2
    batch = PagedBatch([(1, n - 1) for n in DECODE_LENS], hkv, d, bs, dtype, seed=group * d + bs)
    q = torch.randn(len(DECODE_LENS), hkv * group, d, device=DEV).to(dtype)
    m, scale = batch.m, d**-0.5
    expected = ref.decode_attention(q, batch.k_cache, batch.v_cache, m.block_tables, m.kv_seqlens, scale)
    out = tri.decode_attention(q, batch.k_cache, batch.v_cache, m.block_tables, m.kv_seqlens, scale)
    _close(out, expected)


@pytest.mark.parametrize("splits", [1, 3, 16, 64])
@pytest.mark.parametrize("block_n", [16, 64, 128])
def test_decode_split_configs(splits: int, block_n: int) -> None:
    d, hkv, bs = 128, 8, 64
    lens = [8192, 1, 4096, 63, 4097, 700]
    batch = PagedBatch([(1, n - 1) for n in lens], hkv, d, bs, torch.bfloat16, seed=splits + block_n, width=130)
    q = torch.randn(len(lens), 2 * hkv, d, device=DEV, dtype=torch.bfloat16)
    m = batch.m
    expected = ref.decode_attention(q, batch.k_cache, batch.v_cache, m.block_tables, m.kv_seqlens, 0.1)
    cfg = DecodeConfig(block_n=block_n, num_splits=splits, num_warps=4, num_stages=2)
    out = tri.decode_attention(q, batch.k_cache, batch.v_cache, m.block_tables, m.kv_seqlens, 0.1, config=cfg)
    _close(out, expected)


@pytest.mark.parametrize("bs", [16, 64])
@pytest.mark.parametrize("group", [1, 8])
def test_decode_long_context(bs: int, group: int) -> None:
    d, hkv = 128, 4
    lens = [8192, 8191, 5000, 8 * 1024 - bs]  # up to 512 blocks of 16
    batch = PagedBatch([(1, n - 1) for n in lens], hkv, d, bs, torch.bfloat16, seed=bs * group)
    q = torch.randn(len(lens), hkv * group, d, device=DEV, dtype=torch.bfloat16)
    m = batch.m
    expected = ref.decode_attention(q, batch.k_cache, batch.v_cache, m.block_tables, m.kv_seqlens, d**-0.5)
    out = tri.decode_attention(q, batch.k_cache, batch.v_cache, m.block_tables, m.kv_seqlens, d**-0.5)
    _close(out, expected)


def test_decode_noncontiguous_q_and_large_batch() -> None:
    d, hkv, group, bs = 128, 8, 2, 64
    rng = random.Random(7)
    lens = [rng.randint(1, 2048) for _ in range(256)]
    batch = PagedBatch([(1, n - 1) for n in lens], hkv, d, bs, torch.bfloat16, seed=11)
    qkv = torch.randn(len(lens), hkv * group + 2 * hkv, d, device=DEV, dtype=torch.bfloat16)
    q = qkv[:, : hkv * group]
    m = batch.m
    expected = ref.decode_attention(q, batch.k_cache, batch.v_cache, m.block_tables, m.kv_seqlens, d**-0.5)
    out = tri.decode_attention(q, batch.k_cache, batch.v_cache, m.block_tables, m.kv_seqlens, d**-0.5)
    _close(out, expected)


def _refill_decode_tables(rng: random.Random, fixed_lengths: tuple, num_blocks: int, bs: int, width: int,
                          tables: torch.Tensor, lens: torch.Tensor) -> None:
    """New history lengths (one of `fixed_lengths` or a random one up to 8k, one new token each) and random block
    ids (decode only reads the cache, so sequences may share blocks), copied into the graph's tables and lens."""
    shape = [(1, rng.choice([*fixed_lengths, rng.randint(0, 8191)])) for _ in range(lens.shape[0])]
    slices = [SequenceSlice([0] * n, h, [rng.randrange(1, num_blocks) for _ in range(-(-(n + h) // bs))])
              for n, h in shape]
    _, _, meta = build_step(slices, bs, DEV, max_blocks_per_seq=width)
    tables.copy_(meta.block_tables)
    lens.copy_(meta.kv_seqlens)


@pytest.mark.parametrize("batch_size", [2, 48])
def test_decode_cuda_graph_replay_with_new_lengths(batch_size: int) -> None:
    d, hkv, group, bs, width = 128, 8, 2, 64, 128
    rng = random.Random(batch_size)
    first = PagedBatch([(1, rng.randint(0, 3000)) for _ in range(batch_size)], hkv, d, bs, torch.bfloat16, 1, width)
    q = torch.randn(batch_size, hkv * group, d, device=DEV, dtype=torch.bfloat16)
    tables, lens = first.m.block_tables.clone(), first.m.kv_seqlens.clone()
    k_cache, v_cache = first.k_cache, first.v_cache

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        tri.decode_attention(q, k_cache, v_cache, tables, lens, d**-0.5)  # compile + warm-up
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tri.decode_attention(q, k_cache, v_cache, tables, lens, d**-0.5)

    # new lengths (shorter and longer, up to 8k) and new block ids over the same cache
    for step in range(3):
        _refill_decode_tables(rng, (0, 63, 64), first.num_blocks, bs, width, tables, lens)
        q.copy_(torch.randn_like(q))
        graph.replay()
        expected = ref.decode_attention(q, k_cache, v_cache, tables, lens, d**-0.5)
        torch.cuda.synchronize()
        _close(out, expected)


QWEN3_06B = (16, 8, 128, 64, torch.bfloat16)  # Hq, Hkv, D, block size, dtype


def _counters_zero(device: torch.device) -> bool:
    torch.cuda.synchronize()
    return int(decode_counters(device).count_nonzero()) == 0


@pytest.mark.parametrize("batch_size", [1, 7, 64])
@pytest.mark.parametrize("hq,hkv,d,bs,dtype", [QWEN3_06B, (8, 2, 64, 16, torch.float16), (4, 2, 64, 16, torch.float32)])
def test_decode_single_launch_equals_two_kernels(
    batch_size: int, hq: int, hkv: int, d: int, bs: int, dtype: torch.dtype
) -> None:
    """The last-arrival combine gives the split + reduce kernels' bits; empty splits, padded rows, racing programs."""
    rng = random.Random(batch_size * 1000 + hq * d + bs)
    lens = [4096] + [rng.choice([1, 2, bs - 1, bs, bs + 1, rng.randint(1, 4096)]) for _ in range(batch_size - 1)]
    batch = PagedBatch([(1, n - 1) for n in lens], hkv, d, bs, dtype, seed=batch_size + hq + bs)
    m = batch.m
    kv_lens = m.kv_seqlens.clone()
    if batch_size > 1:
        kv_lens[-1] = 0  # a padded row: every split empty, output zeros
    q = torch.randn(batch_size, hq, d, device=DEV).to(dtype)
    args = (q, batch.k_cache, batch.v_cache, m.block_tables, kv_lens, d**-0.5)
    expected = ref.decode_attention(*args)
    configs = [None, DecodeConfig(block_n=32, num_splits=64, num_warps=4, num_stages=2),
               DecodeConfig(block_n=64, num_splits=3, num_warps=4, num_stages=2)]
    for cfg in configs:
        one = tri.decode_attention(*args, config=cfg)
        two = tri.decode_attention(*args, config=cfg, single_launch=False)
        _close(one, expected)
        assert torch.equal(one, two), f"single launch differs from split + reduce ({cfg})"
        for _ in range(5):  # the arrival order changes between launches, the bits must not
            assert torch.equal(tri.decode_attention(*args, config=cfg), one), cfg
        assert _counters_zero(q.device), cfg
        if batch_size > 1:
            assert torch.count_nonzero(one[-1]) == 0


@pytest.mark.parametrize("batch_size", [1, 7, 64])
def test_decode_single_launch_cuda_graph_replays(batch_size: int) -> None:
    """Replays with new lengths (0 included) equal eager single-launch and two-kernel calls; counters stay zero."""
    hq, hkv, d, bs, dtype = QWEN3_06B
    width, scale = 128, d**-0.5
    rng = random.Random(batch_size + 17)
    first = PagedBatch([(1, rng.randint(0, 3000)) for _ in range(batch_size)], hkv, d, bs, dtype, 2, width)
    q = torch.randn(batch_size, hq, d, device=DEV, dtype=dtype)
    tables, lens = first.m.block_tables.clone(), first.m.kv_seqlens.clone()
    k_cache, v_cache = first.k_cache, first.v_cache

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        tri.decode_attention(q, k_cache, v_cache, tables, lens, scale)  # compile, allocate the counters
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tri.decode_attention(q, k_cache, v_cache, tables, lens, scale)

    for step in range(4):
        _refill_decode_tables(rng, (0, 1, 63, 64), first.num_blocks, bs, width, tables, lens)
        if step % 2 and batch_size > 1:
            lens[0] = 0  # padded row
        q.copy_(torch.randn_like(q))
        for _ in range(2):
            graph.replay()
            eager = tri.decode_attention(q, k_cache, v_cache, tables, lens, scale)
            two = tri.decode_attention(q, k_cache, v_cache, tables, lens, scale, single_launch=False)
            assert _counters_zero(q.device), step
            assert torch.equal(out, eager) and torch.equal(out, two), step
        _close(out, ref.decode_attention(q, k_cache, v_cache, tables, lens, scale))


# ----------------------------------------------------------------------------- prefill

PREFILL_SHAPES = {
    "fresh": [(37, 0), (64, 0), (1, 0), (200, 0)],
    "history": [(5, 60), (64, 64), (1, 300), (130, 126), (16, 48)],
    "mixed_decode": [(1, 99), (1, 127), (77, 0), (1, 1), (33, 31)],
    "short": [(1, 99), (16, 16), (3, 0), (2, 62)],  # small max_q: the narrow query tiles
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bs", [16, 64])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("kind", sorted(PREFILL_SHAPES))
def test_prefill_matches_reference(kind: str, group: int, d: int, bs: int, dtype: torch.dtype) -> None:
    hkv, pad = 2, 7
    batch = PagedBatch(PREFILL_SHAPES[kind], hkv, d, bs, dtype, seed=group + d + bs)
    m = batch.m
    t = m.num_tokens + pad  # padded bucket: padding rows carry slot -1 and must come out zero
    q = torch.randn(t, hkv * group, d, device=DEV).to(dtype)
    k = torch.randn(t, hkv, d, device=DEV).to(dtype)
    v = torch.randn(t, hkv, d, device=DEV).to(dtype)
    tri.store_kv(k, v, batch.k_cache, batch.v_cache, m.slot_mapping)
    args = (q, batch.k_cache, batch.v_cache, m.q_start_loc, m.q_seqlens, m.kv_seqlens, m.block_tables, d**-0.5)
    expected = ref.prefill_attention(*args)
    for max_q in (None, m.max_q_seqlen):
        out = tri.prefill_attention(*args, max_q_seqlen=max_q)
        _close(out, expected)
        assert torch.count_nonzero(out[m.num_tokens :]) == 0


@pytest.mark.parametrize("bs", [16, 64])
def test_prefill_long_context(bs: int) -> None:
    d, hkv, group = 128, 8, 2
    shape = [(2192, 6000), (8192, 0), (1, 8191), (513, 3583)]
    batch = PagedBatch(shape, hkv, d, bs, torch.bfloat16, seed=bs)
    m = batch.m
    q = torch.randn(m.num_tokens, hkv * group, d, device=DEV, dtype=torch.bfloat16)
    args = (q, batch.k_cache, batch.v_cache, m.q_start_loc, m.q_seqlens, m.kv_seqlens, m.block_tables, d**-0.5)
    expected = ref.prefill_attention(*args)
    out = tri.prefill_attention(*args, max_q_seqlen=m.max_q_seqlen)
    _close(out, expected)


def test_prefill_then_decode_consistent() -> None:
    """The last prefill row equals a decode step over the same cache."""
    d, hkv, group, bs = 128, 8, 2, 64
    batch = PagedBatch([(300, 0), (65, 63), (128, 0)], hkv, d, bs, torch.bfloat16, seed=5)
    m = batch.m
    q = torch.randn(m.num_tokens, hkv * group, d, device=DEV, dtype=torch.bfloat16)
    out = tri.prefill_attention(
        q, batch.k_cache, batch.v_cache, m.q_start_loc, m.q_seqlens, m.kv_seqlens, m.block_tables, d**-0.5
    )
    last = m.last_token_index
    dec = tri.decode_attention(q[last], batch.k_cache, batch.v_cache, m.block_tables, m.kv_seqlens, d**-0.5)
    _close(out[last], dec)


def test_fp32_caches() -> None:
    d, hkv, group, bs = 64, 2, 4, 16
    batch = PagedBatch([(1, 200), (50, 14), (1, 0)], hkv, d, bs, torch.float32, seed=9)
    m = batch.m
    q = torch.randn(m.num_tokens, hkv * group, d, device=DEV)
    args = (q, batch.k_cache, batch.v_cache, m.q_start_loc, m.q_seqlens, m.kv_seqlens, m.block_tables, d**-0.5)
    torch.testing.assert_close(tri.prefill_attention(*args), ref.prefill_attention(*args), atol=1e-4, rtol=1e-4)
    qd = q[m.last_token_index]
    dargs = (qd, batch.k_cache, batch.v_cache, m.block_tables, m.kv_seqlens, d**-0.5)
    torch.testing.assert_close(tri.decode_attention(*dargs), ref.decode_attention(*dargs), atol=1e-4, rtol=1e-4)


def _compiled_variants(kernel) -> int:
    """Compiled variants of a Triton kernel in this process (all devices)."""
    return sum(len(entry[0]) for entry in kernel.device_caches.values())


def test_warm_up_leaves_no_attention_variant_to_compile_while_serving():
    """After `warm_up_attention`, eager decode and prefill calls of any batch, block-table width and query length
    (what mixed serving steps issue) reuse compiled kernels: a compile would stall a whole step for ~1 s."""
    from modeling.ops.triton_decode import _decode_split_kernel
    from modeling.ops.triton_prefill import _prefill_kernel

    hkv, hq, d, bs = 8, 16, 128, 64
    k_cache = torch.randn(512, bs, hkv, d, device=DEV, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    for kernel in (_decode_split_kernel, _prefill_kernel):
        kernel.device_caches.clear()  # earlier tests compiled some variants: count the warm-up's own
    # 7 split counts, each with and without the loads before the PDL wait (one-sequence steps take them)
    assert tri.warm_up_attention(k_cache, v_cache, hq, d ** -0.5, threads=4) == 17
    before = (_compiled_variants(_decode_split_kernel), _compiled_variants(_prefill_kernel))
    assert before == (14, 3), f"the threaded warm-up compiled {before} (decode, prefill) variants, not (14, 3)"
    rng = random.Random(5)
    for batch in (1, 2, 3, 5, 7, 9, 17, 33, 40, 66, 130):
        width = rng.randint(1, 9)
        lens = torch.tensor([rng.randint(1, width * bs) for _ in range(batch)], dtype=torch.int32, device=DEV)
        tables = torch.randint(1, 512, (batch, width), dtype=torch.int32, device=DEV)
        q = torch.randn(batch, hq, d, device=DEV, dtype=torch.bfloat16)
        tri.decode_attention(q, k_cache, v_cache, tables[:, :width], lens, d ** -0.5)
        q_lens = torch.tensor([rng.randint(1, 150) for _ in range(batch)], dtype=torch.int32, device=DEV)
        kv = q_lens + torch.randint(0, 64, (batch,), dtype=torch.int32, device=DEV)
        wide = torch.randint(1, 512, (batch, int((kv.max().item() + bs - 1) // bs)), dtype=torch.int32, device=DEV)
        start = torch.cumsum(q_lens, 0, dtype=torch.int32) - q_lens
        qp = torch.randn(int(q_lens.sum()), hq, d, device=DEV, dtype=torch.bfloat16)
        tri.prefill_attention(qp, k_cache, v_cache, start, q_lens, kv, wide, d ** -0.5,
                              max_q_seqlen=int(q_lens.max()))
    torch.cuda.synchronize()
    assert (_compiled_variants(_decode_split_kernel), _compiled_variants(_prefill_kernel)) == before
