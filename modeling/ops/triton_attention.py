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

import torch

from modeling.ops.triton_decode import MAX_SPLITS, DecodeConfig, decode_attention, decode_config, device_sm_count
from modeling.ops.triton_prefill import PrefillConfig, prefill_attention, prefill_config
from modeling.ops.triton_store import store_kv

# query-length bounds that reach each of `prefill_config`'s tile configs
_PREFILL_BOUNDS = (16, 64, 128)


def warm_up_attention(k_cache: torch.Tensor, v_cache: torch.Tensor, num_q_heads: int, scale: float) -> int:
    """Compile every variant the attention kernels can pick while serving over these caches (`[N, bs, Hkv, D]`),
    so no step waits for a Triton compile (about a second each, on a cold cache): the decode kernel at each split
    count (powers of two up to `MAX_SPLITS`, see `decode_config`) and the prefill kernel at each tile config.
    One one-token sequence over the padding block 0 per variant, on the current stream: reads only, nothing is
    stored. Returns the number of launches. Call outside CUDA graph capture (allocates)."""
    dev, dtype = k_cache.device, k_cache.dtype
    head_dim = k_cache.shape[3]
    q = torch.zeros((1, num_q_heads, head_dim), dtype=dtype, device=dev)
    tables = torch.zeros((1, 1), dtype=torch.int32, device=dev)
    ones = torch.ones(1, dtype=torch.int32, device=dev)
    base = decode_config(1, k_cache.shape[2], 1, k_cache.shape[1], head_dim, dtype, device_sm_count(dev))
    launches, splits = 0, 1
    while splits <= MAX_SPLITS:
        decode_attention(q, k_cache, v_cache, tables, ones, scale, config=dataclasses.replace(base, num_splits=splits))
        launches, splits = launches + 1, splits * 2
    start = torch.zeros(1, dtype=torch.int32, device=dev)
    for bound in _PREFILL_BOUNDS:
        prefill_attention(q, k_cache, v_cache, start, ones, ones, tables, scale, max_q_seqlen=1,
                          config=prefill_config(bound, head_dim, dtype))
        launches += 1
    return launches


__all__ = [
    "DecodeConfig",
    "PrefillConfig",
    "decode_attention",
    "decode_config",
    "prefill_attention",
    "prefill_config",
    "store_kv",
    "warm_up_attention",
]
