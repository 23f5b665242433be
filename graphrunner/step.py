"""The runner's view of one forward step, and the static facts a model needs to size graph buffers.

The runner is model-blind: it reads only the fields below. `kv_caches` and
`attn_metadata` are *frame inputs*: opaque to the runner, handed to the model
(and, inside piecewise plans, re-bound by identity to eager boundaries).
`attn_metadata` must expose `is_decoding: bool`, `batch_size: int`,
`num_tokens: int` and `max_q_seqlen: int`; everything else in it belongs to the
model and its operators.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

import torch


@dataclass(frozen=True)
class GraphMeta:
    """Static sizes a model uses in `make_buffers` (lifetime: one runner, until `reset()`).

    max_batch_size: largest decode bucket; buffers hold this many rows.
    max_tokens: largest token bucket of any path (>= max_batch_size).
    max_blocks_per_seq: width of the block-table buffer.
    device: the rank's CUDA device.
    """

    max_batch_size: int
    max_tokens: int
    max_blocks_per_seq: int
    device: torch.device


@dataclass
class ForwardStep:
    """One rank's forward request.

    input_ids, position_ids: int64 `[num_tokens]` on the rank's device (flattened tokens).
    kv_caches: the rank's paged KV arenas (frame input, runner-lifetime storage).
    attn_metadata: per-step attention metadata (frame input, request-lifetime).
    state_ids: optional per-sequence state slots (frame input).
    mrope_position_ids: optional `[3, num_tokens]` multimodal positions (graph input).
    chunked_prefill / micro_batch / adapter_ids / extras describe request features a
    plan cannot represent; the runner sends such steps eager before any side effect.
    global_decode: False forces the prefill paths (token-bucket plan or eager) for a
    locally decoding DP rank inside a global prefill; True/None allow the decode graph.
    batch_bucket_hint / token_bucket_hint: the bucket is at least this (DP ranks agree).
    extras: extra forward keyword arguments. Immutable scalars (int, float, bool,
    str, None) are descriptor constants; anything else is dynamic and goes eager.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    kv_caches: Sequence[Any]
    attn_metadata: Any
    state_ids: Optional[torch.Tensor] = None
    mrope_position_ids: Optional[torch.Tensor] = None
    chunked_prefill: bool = False
    micro_batch: bool = False
    adapter_ids: Optional[torch.Tensor] = None
    extras: Mapping[str, Any] = field(default_factory=dict)
    # Set by the coordinator so every DP rank picks the same graph: the phase of the
    # global step (None = decide locally), and lower bounds for the batch / token bucket.
    global_decode: Optional[bool] = None
    batch_bucket_hint: int = 0
    token_bucket_hint: int = 0

    @property
    def is_decoding(self) -> bool:
        return bool(self.attn_metadata.is_decoding)

    @property
    def batch_size(self) -> int:
        return int(self.attn_metadata.batch_size)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[-1])
