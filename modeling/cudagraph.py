"""The model side of the full decode graph buffer contract (make / fill / update context / outputs).

Buffers are allocated once per graph runner lifetime at the largest bucket and shared by
every decode graph. Padded rows are harmless by construction: slot -1 (the store
kernel skips it), kv_seqlen 1 and a block table pointing at the reserved padding
block 0 (attention stays in bounds), token 0 at position 0 (output ignored).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from modeling.attn_metadata import AttentionMetadata

_ROW_BUFFERS = ("q_seqlens", "kv_seqlens", "q_start_loc", "last_token_index")


class DecodeGraphBuffersMixin:
    """Mixed into the model; needs `self.attn_ops` (capturability) and `self.config`."""

    def supports_cuda_graph(self, step: Any) -> bool:
        return bool(step.is_decoding) and self.attn_ops.capturable

    def graph_extra_key(self, step: Any) -> tuple:
        return ()

    def make_buffers(self, graph_meta: Any) -> dict[str, torch.Tensor]:
        dev, b, t, w = graph_meta.device, graph_meta.max_batch_size, graph_meta.max_tokens, graph_meta.max_blocks_per_seq
        return {
            "input_ids": torch.zeros(t, dtype=torch.int64, device=dev),
            "position_ids": torch.zeros(t, dtype=torch.int64, device=dev),
            "slot_mapping": torch.full((t,), -1, dtype=torch.int64, device=dev),
            "q_seqlens": torch.ones(b, dtype=torch.int32, device=dev),
            "kv_seqlens": torch.ones(b, dtype=torch.int32, device=dev),
            "q_start_loc": torch.arange(b, dtype=torch.int32, device=dev),
            "last_token_index": torch.arange(b, dtype=torch.int64, device=dev),
            "block_tables": torch.zeros(b, w, dtype=torch.int32, device=dev),
        }

    def fill_buffers(self, buffers: dict[str, torch.Tensor], step: Any, padded_batch: int) -> None:
        """Copy a live decode step (one token per sequence) into rows [0, n) and pad rows [n, padded_batch)."""
        meta: AttentionMetadata = step.attn_metadata
        n = step.batch_size
        width = meta.block_tables.shape[1]
        if width > buffers["block_tables"].shape[1]:
            raise ValueError(f"block table width {width} exceeds the graph buffers' {buffers['block_tables'].shape[1]}")
        buffers["input_ids"][:n].copy_(step.input_ids, non_blocking=True)
        buffers["position_ids"][:n].copy_(step.position_ids, non_blocking=True)
        buffers["slot_mapping"][:n].copy_(meta.slot_mapping, non_blocking=True)
        buffers["kv_seqlens"][:n].copy_(meta.kv_seqlens, non_blocking=True)
        bt = buffers["block_tables"]
        bt[:n, :width].copy_(meta.block_tables, non_blocking=True)
        if width < bt.shape[1]:
            bt[:n, width:].zero_()
        if padded_batch > n:
            buffers["input_ids"][n:padded_batch].zero_()
            buffers["position_ids"][n:padded_batch].zero_()
            buffers["slot_mapping"][n:padded_batch].fill_(-1)
            buffers["kv_seqlens"][n:padded_batch].fill_(1)
            bt[n:padded_batch].zero_()

    def update_context(self, buffers: dict[str, torch.Tensor], step: Any, padded_batch: int) -> Any:
        """A step whose tensors are bucket-shaped views of `buffers` (what the graph is captured on)."""
        p = padded_batch
        bt = buffers["block_tables"][:p]
        meta = AttentionMetadata(
            is_decoding=True,
            q_seqlens=buffers["q_seqlens"][:p],
            kv_seqlens=buffers["kv_seqlens"][:p],
            q_start_loc=buffers["q_start_loc"][:p],
            block_tables=bt,
            slot_mapping=buffers["slot_mapping"][:p],
            last_token_index=buffers["last_token_index"][:p],
            max_q_seqlen=1,
            max_kv_seqlen=bt.shape[1] * step.attn_metadata.block_size,
            block_size=step.attn_metadata.block_size,
        )
        return dataclasses.replace(
            step, input_ids=buffers["input_ids"][:p], position_ids=buffers["position_ids"][:p], attn_metadata=meta
        )

    def get_outputs(self, output: torch.Tensor, num_tokens: int) -> torch.Tensor:
        return output[:num_tokens]
