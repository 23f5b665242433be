"""Triton CUDA kernels for the paged KV cache, with the torch reference's signatures.

Shapes (T = flat tokens, B = sequences, N = cache blocks, bs = block size in
16/32/64/128): q `[T, Hq, D]` (decode: `[B, Hq, D]`), k/v `[T, Hkv, D]`,
caches `[N, bs, Hkv, D]` in bf16, fp16 or fp32, lengths and block tables int32,
slot_mapping int32/int64. Hq = group * Hkv. See `modeling.ops.attention_ref`
for the semantics these kernels match.

- `store_kv`: static grid over len(slot_mapping); CUDA-graph safe.
- `decode_attention`: split-KV flash decoding, static grid; CUDA-graph safe.
- `decode_attention_qk`: the same over RAW q, with `qk_norm_rope_store` inside the split kernel where it can be
  (`triton_decode_qk`), else the two kernels; CUDA-graph safe.
- `prefill_attention`: causal flash attention over history + new tokens; eager.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from modeling.ops import triton_decode, triton_prefill
from modeling.ops.triton_decode import (MAX_SPLITS, DecodeConfig, decode_attention, decode_config, decode_counters,
                                     device_sm_count, fused_launch)
from modeling.ops.triton_decode_qk import DecodeQK, fusable
from modeling.ops.triton_prefill import PrefillConfig, prefill_attention, prefill_config
from modeling.ops.triton_rope import qk_norm_rope_store
from modeling.ops.triton_store import store_kv
from modeling.ops.warm_up import prime_kernel_caches, run_side_by_side

# query-length bounds that reach each of `prefill_config`'s tile configs
_PREFILL_BOUNDS = (16, 64, 128)


def decode_attention_qk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor,
                        k_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, eps: float,
                        k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                        block_tables: torch.Tensor, kv_seqlens: torch.Tensor, scale: float, num_tokens: int, *,
                        single_launch: bool = True, pdl: int = 0) -> torch.Tensor:
    """`qk_norm_rope_store` of raw q/k `[T, H, D]` (v `[T, Hkv, D]`) then `decode_attention` of its first
    `num_tokens` rows (one token per sequence), in one launch where `triton_decode_qk.fusable` and
    `triton_decode.fused_launch` allow (the default decode path), else in those two launches. Returns
    `[num_tokens, Hq, D]`; the caches gain the stored rows either way. q rows past `num_tokens` are not
    normalised by the fused launch (decode reads none of them)."""
    b = num_tokens
    qk = DecodeQK(k[:b], v[:b], q_weight, k_weight, cos, sin, positions, slot_mapping, eps)
    q_rows = q[:b]
    if q_rows.dim() == 3 and fusable(q_rows, qk, k_cache):
        cfg = decode_config(b, k_cache.shape[2], block_tables.shape[1], k_cache.shape[1], q.shape[2], k_cache.dtype,
                            device_sm_count(q.device))
        if fused_launch(b, k_cache.shape[2], cfg, single_launch, q.device):
            return decode_attention(q_rows, k_cache, v_cache, block_tables, kv_seqlens, scale, config=cfg,
                                    single_launch=single_launch, pdl=pdl, qk=qk)
    qn = qk_norm_rope_store(q, k, v, q_weight, k_weight, cos, sin, positions, eps, k_cache, v_cache, slot_mapping,
                            pdl=pdl)
    return decode_attention(qn[:b], k_cache, v_cache, block_tables, kv_seqlens, scale, single_launch=single_launch,
                            pdl=pdl)


def attention_warm_up_calls(k_cache: torch.Tensor, v_cache: torch.Tensor, num_q_heads: int, scale: float, *,
                            pdl: int = 0, single_launch: bool = True, fused_qk: bool = False
                            ) -> list[Callable[[], Any]]:
    """One launch per variant the attention kernels can pick while serving over these caches (`[N, bs, Hkv, D]`):
    the decode kernel at each split count (powers of two up to `MAX_SPLITS`, see `decode_config`) and the prefill
    kernel at each tile config. Each is a one-token sequence over the padding block 0: reads only, nothing is
    stored. Call them outside CUDA graph capture (they allocate), in any order, on any thread bound to the
    caches' device (`modeling.ops.warm_up.run_side_by_side`). `pdl` and `single_launch`: as serving launches the
    decode kernel (`modeling.ops.get_kernel_ops` binds both), so the warm-up compiles those variants. `fused_qk`:
    also the decode kernel with the q/k prologue (`decode_attention_qk`) at each split count it can take, over
    raw q/k/v laid out as the model's fused qkv output, storing nothing (slot -1)."""
    dev, dtype = k_cache.device, k_cache.dtype
    head_dim = k_cache.shape[3]
    q = torch.zeros((1, num_q_heads, head_dim), dtype=dtype, device=dev)
    tables = torch.zeros((1, 1), dtype=torch.int32, device=dev)
    ones = torch.ones(1, dtype=torch.int32, device=dev)
    start = torch.zeros(1, dtype=torch.int32, device=dev)
    base = decode_config(1, k_cache.shape[2], 1, k_cache.shape[1], head_dim, dtype, device_sm_count(dev))
    decode_counters(dev)  # the split-KV arrival counters, once, before any thread launches

    hkv = k_cache.shape[2]
    qkv = torch.zeros((1, (num_q_heads + 2 * hkv) * head_dim), dtype=dtype, device=dev)  # the model's fused layout
    raw_q, raw_k, raw_v = (t.view(1, -1, head_dim) for t in qkv.split([num_q_heads * head_dim, hkv * head_dim,
                                                                        hkv * head_dim], dim=-1))
    weight = torch.ones(head_dim, dtype=dtype, device=dev)
    table = torch.zeros((1, head_dim), dtype=torch.float32, device=dev)
    pos = torch.zeros(1, dtype=torch.int64, device=dev)  # the decode buffers' dtypes (`modeling.cudagraph`)
    no_slot = torch.full((1,), -1, dtype=torch.int64, device=dev)
    qk = DecodeQK(raw_k, raw_v, weight, weight, table, table, pos, no_slot, 1e-6)

    def decode(splits: int, fused: bool) -> Callable[[], Any]:
        cfg = dataclasses.replace(base, num_splits=splits)
        return lambda: decode_attention(raw_q if fused else q, k_cache, v_cache, tables, ones, scale, config=cfg,
                                        single_launch=single_launch, pdl=pdl, qk=qk if fused else None)

    def prefill(bound: int) -> Callable[[], Any]:
        cfg = prefill_config(bound, head_dim, dtype)
        return lambda: prefill_attention(q, k_cache, v_cache, start, ones, ones, tables, scale, max_q_seqlen=1,
                                         config=cfg)

    splits = [1 << i for i in range(MAX_SPLITS.bit_length()) if (1 << i) <= MAX_SPLITS]
    # the fused prologue runs only where the split kernel combines (`fused_launch`)
    fused = [decode(n, True) for n in splits if fused_qk and (n == 1 or single_launch)]
    return [decode(n, False) for n in splits] + fused + [prefill(bound) for bound in _PREFILL_BOUNDS]


def warm_up_attention(k_cache: torch.Tensor, v_cache: torch.Tensor, num_q_heads: int, scale: float,
                      threads: int | None = None, *, pdl: int = 0, single_launch: bool = True,
                      fused_qk: bool = False) -> int:
    """Compile every attention variant serving can pick over these caches (`attention_warm_up_calls`, with `pdl`
    and `single_launch`), side by side on `threads` threads (None: `compile_threads()`), so no step waits for a
    Triton compile (about a second each, on a cold cache). Launches on the current stream; returns the number of
    launches."""
    calls = attention_warm_up_calls(k_cache, v_cache, num_q_heads, scale, pdl=pdl, single_launch=single_launch,
                                    fused_qk=fused_qk)
    prime_kernel_caches([triton_decode, triton_prefill], k_cache.device)
    run_side_by_side(calls, threads)
    return len(calls)


__all__ = [
    "DecodeConfig",
    "PrefillConfig",
    "decode_attention",
    "decode_attention_qk",
    "decode_config",
    "prefill_attention",
    "prefill_config",
    "attention_warm_up_calls",
    "store_kv",
    "warm_up_attention",
]
