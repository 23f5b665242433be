"""Decode attention with the fused q/k prologue (`triton_decode_qk`) on a GPU, bf16.

The fused launch against the two launches it replaces (`qk_norm_rope_store` then `decode_attention`) over racing
split programs: eager at the model shapes (GQA 2, 4 and 8), repeated launches (same bits whichever program
stores first), CUDA graph replays with new positions, slots and lengths, the warm-up covering every fused
variant, and qwen3-0.6b greedy generation with the option on and off.
"""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from modeling.attn_metadata import SequenceSlice, build_step

try:
    from modeling.ops import triton_attention as tri
    from modeling.ops.triton_decode import DecodeConfig, decode_counters
    from modeling.ops.triton_rope import qk_norm_rope_store
except ImportError:  # no triton: collection still succeeds, every test is skipped
    tri = None

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(tri is None, reason="triton is not installed")]

DEV = "cuda"
EPS = 1e-6
# Hq, Hkv, D, page: qwen3-0.6b (group 2), qwen3-8b (group 4), qwen3-30b-a3b (group 8)
SHAPES = {"0.6b": (16, 8, 128, 64), "8b": (32, 8, 128, 64), "30b_a3b": (32, 4, 128, 64)}


class Step:
    """A decode step over random paged caches: raw q/k/v as column views of one qkv tensor, the new token at
    position len-1 of each sequence (the last row is padding: kv_len 0, slot -1)."""

    def __init__(self, shape, lens: list[int], seed: int, width: int = 80, blocks: int | None = None):
        hq, hkv, d, page = shape
        g = torch.Generator(device=DEV).manual_seed(seed)
        self.d, self.page, self.hq, self.hkv = d, page, hq, hkv
        blocks = blocks or sum(-(-n // page) for n in lens) + 8
        self.k_cache = torch.randn(blocks, page, hkv, d, device=DEV, generator=g).to(torch.bfloat16)
        self.v_cache = torch.randn(blocks, page, hkv, d, device=DEV, generator=g).to(torch.bfloat16)
        ids = random.Random(seed).sample(range(1, blocks), blocks - 1)
        slices, used = [], 0
        for n in lens:
            slices.append(SequenceSlice(tokens=[1], num_history=n - 1, block_table=ids[used:used + -(-n // page)]))
            used += -(-n // page)
        _, pos, self.meta = build_step(slices, page, DEV, max_blocks_per_seq=width)
        self.pos = pos.to(torch.int64)
        self.slots = self.meta.slot_mapping.clone()
        self.lens = self.meta.kv_seqlens.clone()
        if len(lens) > 1:
            self.slots[-1], self.lens[-1] = -1, 0
        self.qkv = (2.0 * torch.randn(len(lens), (hq + 2 * hkv) * d, device=DEV, generator=g)).to(torch.bfloat16)
        self.qw, self.kw = [(1.0 + 0.1 * torch.randn(d, device=DEV, generator=g)).to(torch.bfloat16)
                            for _ in range(2)]
        inv = 1.0 / (1e6 ** (torch.arange(0, d, 2, device=DEV).float() / d))
        ang = torch.outer(torch.arange(8192, device=DEV).float(), inv)
        self.cos, self.sin = torch.cat((ang, ang), -1).cos(), torch.cat((ang, ang), -1).sin()

    def raw(self):
        b = self.qkv.shape[0]
        return [t.view(b, -1, self.d) for t in self.qkv.split([self.hq * self.d, self.hkv * self.d,
                                                               self.hkv * self.d], dim=-1)]

    def fused(self, kc, vc, single_launch=True):
        q, k, v = self.raw()
        return tri.decode_attention_qk(q, k, v, self.qw, self.kw, self.cos, self.sin, self.pos, EPS, kc, vc,
                                       self.slots, self.meta.block_tables, self.lens, self.d ** -0.5, q.shape[0],
                                       single_launch=single_launch)

    def unfused(self, kc, vc, config=None):
        q, k, v = self.raw()
        qn = qk_norm_rope_store(q, k, v, self.qw, self.kw, self.cos, self.sin, self.pos, EPS, kc, vc, self.slots)
        return tri.decode_attention(qn, kc, vc, self.meta.block_tables, self.lens, self.d ** -0.5, config=config)


def _caches(step):
    return step.k_cache.clone(), step.v_cache.clone()


def _assert_close_bf16(a: torch.Tensor, b: torch.Tensor, what: str):
    """Equal but for a rare last-bit norm difference (one fp32 reduction order differs, see triton_decode_qk)."""
    diff = (a.float() - b.float()).abs()
    assert diff.max().item() <= 3e-2, (what, diff.max().item())
    assert (diff == 0).float().mean().item() >= 0.99, (what, (diff == 0).float().mean().item())


def _counters_zero() -> bool:
    torch.cuda.synchronize()
    return int(decode_counters(torch.device(DEV, 0)).count_nonzero()) == 0


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("batch", [1, 7, 64, 256])
def test_fused_equals_two_launches(name: str, batch: int):
    rng = random.Random(batch)
    lens = [4096] + [rng.choice([1, 2, 63, 64, 65, rng.randint(1, 4096)]) for _ in range(batch - 1)]
    step = Step(SHAPES[name], lens, seed=batch)
    kc, vc = _caches(step)
    ukc, uvc = _caches(step)
    uo = step.unfused(ukc, uvc)
    fo = step.fused(kc, vc)
    _assert_close_bf16(fo, uo, "out")
    assert torch.equal(vc, uvc)
    _assert_close_bf16(kc, ukc, "k cache")
    assert not torch.equal(kc, step.k_cache) and not torch.equal(vc, step.v_cache)  # the new rows were stored
    if batch > 1:
        assert int(fo[-1].count_nonzero()) == 0
    for _ in range(4):  # racing stores and arrivals: the same bits every launch
        again_k, again_v = _caches(step)
        assert torch.equal(step.fused(again_k, again_v), fo)
        assert torch.equal(again_k, kc) and torch.equal(again_v, vc)
    assert _counters_zero()


def test_fused_forced_split_counts():
    """Every split count the warm-up compiles, with the new token in the last tile of a split that is not 0."""
    step = Step(SHAPES["30b_a3b"], [4096, 3000, 130, 1, 0 + 1], seed=3)
    ukc, uvc = _caches(step)
    uo = step.unfused(ukc, uvc)
    for splits in (1, 2, 4, 8, 16, 32, 64):
        cfg = DecodeConfig(block_n=32, num_splits=splits, num_warps=4, num_stages=2)
        kc, vc = _caches(step)
        q, k, v = step.raw()
        qk = tri.DecodeQK(k, v, step.qw, step.kw, step.cos, step.sin, step.pos, step.slots, EPS)
        fo = tri.decode_attention(q, kc, vc, step.meta.block_tables, step.lens, step.d ** -0.5, config=cfg, qk=qk)
        _assert_close_bf16(fo, uo, f"splits {splits}")
        assert torch.equal(vc, uvc), splits
        _assert_close_bf16(kc, ukc, f"k cache, splits {splits}")
    assert _counters_zero()


@pytest.mark.parametrize("batch", [1, 16, 128])
def test_fused_cuda_graph_replays_new_steps(batch: int):
    """One capture, replayed over new raw q/k/v, positions, slots and lengths (the decode graph's buffers)."""
    rng = random.Random(batch + 5)
    blocks = batch * 48 + 8  # one cache size for every step: lengths up to 3000 in pages of 64
    step = Step(SHAPES["8b"], [rng.randint(2, 3000) for _ in range(batch)], seed=batch + 1, blocks=blocks)
    kc, vc = _caches(step)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step.fused(kc, vc)  # compile, counters
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step.fused(kc, vc)
    for i in range(3):
        fresh = Step(SHAPES["8b"], [rng.randint(2, 3000) for _ in range(batch)], seed=100 + i, blocks=blocks)
        step.qkv.copy_(fresh.qkv)
        step.pos.copy_(fresh.pos)
        step.slots.copy_(fresh.slots)
        step.lens.copy_(fresh.lens)
        step.meta.block_tables.copy_(fresh.meta.block_tables)
        kc.copy_(fresh.k_cache)
        vc.copy_(fresh.v_cache)
        graph.replay()
        ukc, uvc = fresh.k_cache.clone(), fresh.v_cache.clone()
        _assert_close_bf16(out, fresh.unfused(ukc, uvc), f"replay {i}")
        assert torch.equal(vc, uvc), i
        _assert_close_bf16(kc, ukc, f"k cache, replay {i}")
    assert _counters_zero()


def test_warm_up_compiles_every_fused_variant():
    from modeling.ops.triton_decode import _decode_split_kernel

    hq, hkv, d, page = SHAPES["0.6b"]
    k_cache = torch.zeros(512, page, hkv, d, device=DEV, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    _decode_split_kernel.device_caches.clear()
    assert tri.warm_up_attention(k_cache, v_cache, hq, d ** -0.5, threads=4, fused_qk=True) == 17
    before = sum(len(e[0]) for e in _decode_split_kernel.device_caches.values())
    assert before == 14, before  # 7 split counts, plain and fused
    for batch in (1, 3, 17, 64, 200):
        # caches of their own size: the compiled variant does not depend on the block count
        step = Step((hq, hkv, d, page), [random.Random(batch).randint(1, 5000) for _ in range(batch)], seed=batch)
        step.fused(step.k_cache, step.v_cache)
    torch.cuda.synchronize()
    assert sum(len(e[0]) for e in _decode_split_kernel.device_caches.values()) == before


@torch.inference_mode()
def test_greedy_generation_with_and_without_the_fused_prologue():
    """qwen3-0.6b greedy tokens for 32 steps are the same with the fused decode prologue on and off."""
    from actors.rank import RuntimeConfig
    from modeling.generate import generate
    from modeling.loader import init_random
    from modeling.ops import get_kernel_ops
    from modeling.ops.options import KernelOptions
    from modeling.qwen3 import Qwen3ForCausalLM
    from tests.gpu.helpers import random_tokens

    cfg = RuntimeConfig(model="qwen3-0.6b", device="cuda").model_config(torch.device("cuda"))
    outs, used = [], []
    for on in (True, False):
        ops = get_kernel_ops("cuda", "triton", KernelOptions(decode_fused_qk=on))
        used.append(ops.decode_attention_qk is not None)
        with torch.device("cuda"):
            m = Qwen3ForCausalLM(cfg, device="cuda", ops=ops)
        init_random(m, 0)
        rng = np.random.default_rng(3)
        prompts = [random_tokens(rng, n, cfg.vocab_size) for n in (17, 64, 130)]
        outs.append(generate(m, prompts, max_new_tokens=32, block_size=64).tokens)
        del m
    assert used == [True, False]
    assert outs[0] == outs[1]
