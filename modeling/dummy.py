"""Harmless bucket-shaped dummy inputs for warm-up and graph capture.

Every token's slot is -1 (nothing is stored) and every block table points at the
reserved padding block 0, so running a dummy step never touches a real sequence's KV.
"""
from __future__ import annotations

import torch

from modeling.attn_metadata import AttentionMetadata


def make_dummy_inputs(num_tokens: int, batch_size: int, is_decoding: bool, block_size: int, max_blocks_per_seq: int,
                      device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """(input_ids int64 [num_tokens], position_ids int64 [num_tokens], metadata) for `batch_size` sequences."""
    if batch_size < 1 or num_tokens < batch_size:
        raise ValueError(f"dummy step needs 1 <= batch_size <= num_tokens, got {batch_size}, {num_tokens}")
    if is_decoding and num_tokens != batch_size:
        raise ValueError("a decode dummy step has exactly one token per sequence")
    dev = torch.device(device)
    base, extra = divmod(num_tokens, batch_size)
    q_lens = torch.full((batch_size,), base, dtype=torch.int32)
    q_lens[:extra] += 1
    if int(q_lens.max()) > max_blocks_per_seq * block_size:
        raise ValueError(f"dummy sequence of {int(q_lens.max())} tokens exceeds {max_blocks_per_seq} blocks")
    starts = torch.zeros(batch_size, dtype=torch.int32)
    starts[1:] = torch.cumsum(q_lens, 0)[:-1]
    positions = torch.cat([torch.arange(int(n)) for n in q_lens]).to(torch.int64)
    meta = AttentionMetadata(
        is_decoding=is_decoding,
        q_seqlens=q_lens.to(dev),
        kv_seqlens=q_lens.clone().to(dev),
        q_start_loc=starts.to(dev),
        block_tables=torch.zeros(batch_size, max_blocks_per_seq, dtype=torch.int32, device=dev),
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=dev),
        last_token_index=(starts + q_lens - 1).to(torch.int64).to(dev),
        max_q_seqlen=int(q_lens.max()),
        max_kv_seqlen=int(q_lens.max()),
        block_size=block_size,
    )
    return torch.zeros(num_tokens, dtype=torch.int64, device=dev), positions.to(dev), meta
