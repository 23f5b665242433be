"""Triton CUDA kernels for the paged KV cache, with the torch reference's signatures.

Shapes (T = flat tokens, B = sequences, N = cache blocks, bs = block size in
16/32/64/128): q `[T, Hq, D]` (decode: `[B, Hq, D]`), k/v `[T, Hkv, D]`,
caches `[N, bs, Hkv, D]` in bf16, fp16 or fp32, lengths and block tables int32,
slot_mapping int32/int64. Hq = group * Hkv. See `modeling.ops.attention_ref`
for the semantics these kernels match.

- `store_kv`: static grid over len(slot_mapping); CUDA-graph safe.
- `decode_attention`: split-KV flash decoding, static grid; CUDA-graph safe.
- `prefill_attention`: causal flash attention over history + new tokens; eager.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from modeling.ops import triton_decode, triton_prefill
from modeling.ops.triton_decode import (MAX_SPLITS, DecodeConfig, decode_attention, decode_config, decode_counters,
                                     device_sm_count)
from modeling.ops.triton_prefill import MID_MAX_Q, SMALL_MAX_Q, PrefillConfig, prefill_attention, prefill_config
from modeling.ops.triton_store import store_kv
from modeling.ops.warm_up import prime_kernel_caches, run_side_by_side

# query-length bounds that reach each of `prefill_config`'s tile configs
_PREFILL_BOUNDS = (SMALL_MAX_Q, MID_MAX_Q, MID_MAX_Q + 1)


def attention_warm_up_calls(k_cache: torch.Tensor, v_cache: torch.Tensor, num_q_heads: int, scale: float, *,
                            pdl: int = 0, single_launch: bool = True,
                            prefetch: bool | None = None) -> list[Callable[[], Any]]:
    """One launch per variant the attention kernels can pick while serving over these caches (`[N, bs, Hkv, D]`):
    the decode kernel at each split count (powers of two up to `MAX_SPLITS`, see `decode_config`), with and without
    the loads before its PDL wait (`prefetch` None: both, as `DecodeConfig.prefetch` picks by batch), and the prefill
    kernel at each tile config. Each is a one-token sequence over the padding block 0: reads only, nothing is
    stored. Call them outside CUDA graph capture (they allocate), in any order, on any thread bound to the
    caches' device (`modeling.ops.warm_up.run_side_by_side`). `pdl`, `single_launch` and `prefetch`: as serving
    launches the decode kernel (`modeling.ops.get_kernel_ops` binds them), so the warm-up compiles those variants."""
    dev, dtype = k_cache.device, k_cache.dtype
    head_dim = k_cache.shape[3]
    q = torch.zeros((1, num_q_heads, head_dim), dtype=dtype, device=dev)
    tables = torch.zeros((1, 1), dtype=torch.int32, device=dev)
    ones = torch.ones(1, dtype=torch.int32, device=dev)
    start = torch.zeros(1, dtype=torch.int32, device=dev)
    base = decode_config(1, k_cache.shape[2], 1, k_cache.shape[1], head_dim, dtype, device_sm_count(dev))
    decode_counters(dev)  # the split-KV arrival counters, once, before any thread launches

    def decode(splits: int, early: bool) -> Callable[[], Any]:
        cfg = dataclasses.replace(base, num_splits=splits)
        return lambda: decode_attention(q, k_cache, v_cache, tables, ones, scale, config=cfg,
                                        single_launch=single_launch, prefetch=early, pdl=pdl)

    def prefill(bound: int) -> Callable[[], Any]:
        cfg = prefill_config(bound, head_dim, dtype)
        return lambda: prefill_attention(q, k_cache, v_cache, start, ones, ones, tables, scale, max_q_seqlen=1,
                                         config=cfg)

    splits = [1 << i for i in range(MAX_SPLITS.bit_length()) if (1 << i) <= MAX_SPLITS]
    early = (False, True) if prefetch is None else (bool(prefetch),)  # None: the config's, by batch
    return [decode(n, e) for n in splits for e in early] + [prefill(bound) for bound in _PREFILL_BOUNDS]


def warm_up_attention(k_cache: torch.Tensor, v_cache: torch.Tensor, num_q_heads: int, scale: float,
                      threads: int | None = None, *, pdl: int = 0, single_launch: bool = True,
                      prefetch: bool | None = None) -> int:
    """Compile every attention variant serving can pick over these caches (`attention_warm_up_calls`, with `pdl`,
    `single_launch` and `prefetch`), side by side on `threads` threads (None: `compile_threads()`), so no step waits
    for a Triton compile (about a second each, on a cold cache). Launches on the current stream; returns the number of
    launches."""
    calls = attention_warm_up_calls(k_cache, v_cache, num_q_heads, scale, pdl=pdl, single_launch=single_launch,
                                    prefetch=prefetch)
    prime_kernel_caches([triton_decode, triton_prefill], k_cache.device)
    run_side_by_side(calls, threads)
    return len(calls)


__all__ = [
    "DecodeConfig",
    "PrefillConfig",
    "decode_attention",
    "decode_config",
    "prefill_attention",
    "prefill_config",
    "attention_warm_up_calls",
    "store_kv",
    "warm_up_attention",
]
