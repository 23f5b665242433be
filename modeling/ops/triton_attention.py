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

from modeling.ops.triton_decode import DecodeConfig, decode_attention, decode_config
from modeling.ops.triton_prefill import PrefillConfig, prefill_attention, prefill_config
from modeling.ops.triton_store import store_kv

__all__ = [
    "DecodeConfig",
    "PrefillConfig",
    "decode_attention",
    "decode_config",
    "prefill_attention",
    "prefill_config",
    "store_kv",
]
