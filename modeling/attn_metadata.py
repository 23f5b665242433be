"""Attention metadata: the per-step description of which tokens belong to which sequence.

Built on the host from a batch of sequence slices, copied to the device once,
and passed explicitly from the model to every layer and operator (never hidden
in a global). Lifetime: one forward step. All tensors live on the step's device.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch


class MetadataError(ValueError):
    """A batch description is inconsistent (lengths, block tables, capacity)."""


@dataclass
class AttentionMetadata:
    """Per-step attention metadata.

    is_decoding: every sequence contributes exactly one query token.
    q_seqlens: int32 `[B]` new tokens per sequence in this step.
    kv_seqlens: int32 `[B]` tokens in the cache after this step (history + new).
    q_start_loc: int32 `[B]` offset of each sequence's first token in the flat batch.
    block_tables: int32 `[B, max_blocks_per_seq]` physical block ids; unused entries 0
        (block 0 is the reserved padding block, never given to a sequence).
    slot_mapping: int64 `[num_tokens]` flat cache slot of each token; -1 = do not store.
    last_token_index: int64 `[B]` flat index of each sequence's last token.
    max_q_seqlen, max_kv_seqlen: host ints, upper bounds used for eager kernel grids.
    """

    is_decoding: bool
    q_seqlens: torch.Tensor
    kv_seqlens: torch.Tensor
    q_start_loc: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    last_token_index: torch.Tensor
    max_q_seqlen: int
    max_kv_seqlen: int
    block_size: int

    @property
    def batch_size(self) -> int:
        return int(self.q_seqlens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])


@dataclass(frozen=True)
class SequenceSlice:
    """One sequence's share of a step: `tokens` appended after `num_history` cached tokens.

    block_table lists the physical blocks holding positions [0, num_history + len(tokens)).
    """

    tokens: Sequence[int]
    num_history: int
    block_table: Sequence[int]


def build_step(
    slices: Sequence[SequenceSlice],
    block_size: int,
    device: torch.device | str,
    max_blocks_per_seq: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Flatten `slices` into (input_ids int64 [T], position_ids int64 [T], metadata).

    Raises MetadataError when a slice is empty, its history is negative, or its
    block table is too short for its tokens (nothing is written anywhere).
    """
    if not slices:
        raise MetadataError("a step needs at least one sequence")
    q_lens = np.empty(len(slices), dtype=np.int32)
    kv_lens = np.empty(len(slices), dtype=np.int32)
    for i, s in enumerate(slices):
        if len(s.tokens) == 0:
            raise MetadataError(f"sequence {i} has no new tokens")
        if s.num_history < 0:
            raise MetadataError(f"sequence {i} has negative history {s.num_history}")
        q_lens[i] = len(s.tokens)
        kv_lens[i] = s.num_history + len(s.tokens)
        needed = -(-int(kv_lens[i]) // block_size)
        if len(s.block_table) < needed:
            raise MetadataError(
                f"sequence {i} needs {needed} blocks for {kv_lens[i]} tokens, block table has {len(s.block_table)}"
            )
        if any(b <= 0 for b in s.block_table[:needed]):
            raise MetadataError(f"sequence {i} uses block 0 or a negative block; block 0 is reserved for padding")
    width = max_blocks_per_seq or max(len(s.block_table) for s in slices)
    if max(len(s.block_table) for s in slices) > width:
        raise MetadataError(f"a block table is wider than max_blocks_per_seq={width}")
    tables = np.zeros((len(slices), width), dtype=np.int32)
    for i, s in enumerate(slices):
        tables[i, : len(s.block_table)] = s.block_table
    ids = np.fromiter((t for s in slices for t in s.tokens), dtype=np.int64)
    history = np.array([s.num_history for s in slices], dtype=np.int32)
    return build_step_from_arrays(ids, q_lens, history, tables, block_size, device)


def build_step_from_arrays(
    token_ids: np.ndarray,
    q_seqlens: np.ndarray,
    num_history: np.ndarray,
    block_tables: np.ndarray,
    block_size: int,
    device: torch.device | str,
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Vectorised builder from validated arrays (int64 `[T]`, int32 `[B]`, int32 `[B]`, int32 `[B, W]`).

    All int64 fields travel in one host-to-device copy and all int32 fields in another.
    """
    b, width = block_tables.shape
    total = int(token_ids.shape[0])
    q_lens = q_seqlens.astype(np.int32, copy=False)
    kv_lens = (num_history + q_lens).astype(np.int32)
    decoding = total == b  # every q_len >= 1, so T == B means one token per sequence
    if decoding:  # the per-step hot path: fewer host array ops
        starts = np.arange(b, dtype=np.int32)
        seq_of = starts
        pos = num_history.astype(np.int64)
        last = seq_of.astype(np.int64)
    else:
        starts = np.zeros(b, dtype=np.int32)
        np.cumsum(q_lens[:-1], out=starts[1:])
        seq_of = np.repeat(np.arange(b), q_lens)
        pos = np.arange(total, dtype=np.int64) - np.repeat(starts, q_lens) + np.repeat(num_history, q_lens)
        last = (starts + q_lens - 1).astype(np.int64)
    slots = block_tables[seq_of, pos // block_size].astype(np.int64) * block_size + pos % block_size
    i64 = np.concatenate([token_ids.astype(np.int64, copy=False), pos, slots, last])
    i32 = np.concatenate([q_lens, kv_lens, starts, block_tables.reshape(-1).astype(np.int32, copy=False)])
    dev = torch.device(device)
    t64 = torch.from_numpy(i64)
    t32 = torch.from_numpy(i32)
    if dev.type == "cuda":
        t64, t32 = t64.pin_memory(), t32.pin_memory()
    ids, positions, slot_mapping, last_index = t64.to(dev, non_blocking=True).split([total, total, total, b])
    q_dev, kv_dev, start_dev, tables_dev = t32.to(dev, non_blocking=True).split([b, b, b, b * width])
    meta = AttentionMetadata(
        is_decoding=decoding,
        q_seqlens=q_dev,
        kv_seqlens=kv_dev,
        q_start_loc=start_dev,
        block_tables=tables_dev.view(b, width),
        slot_mapping=slot_mapping,
        last_token_index=last_index,
        max_q_seqlen=1 if decoding else int(q_lens.max()),
        max_kv_seqlen=int(kv_lens.max()),
        block_size=block_size,
    )
    return ids, positions, meta


class HostDecodeMetadata:
    """A decode step's metadata still on the host, for a captured decode graph only (`fill_buffers` writes it
    into the graph's pinned staging mirror; no eager operator can read it).

    num_history int32 `[B]` cached tokens per sequence, block_tables int32 `[B, W]`, both validated numpy
    arrays owned by the caller until the step is launched; positions, slots and lengths are derived while
    filling the mirror, so building one costs no array work. Exposes what the graph runner reads."""

    __slots__ = ("num_history", "block_tables", "block_size", "batch_size")
    is_decoding = True
    max_q_seqlen = 1

    def __init__(self, num_history: np.ndarray, block_tables: np.ndarray, block_size: int):
        self.num_history, self.block_tables, self.block_size = num_history, block_tables, block_size
        self.batch_size = int(num_history.shape[0])

    @property
    def num_tokens(self) -> int:
        return self.batch_size


def build_decode_step_host(
    token_ids: np.ndarray,
    num_history: np.ndarray,
    block_tables: np.ndarray,
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor, HostDecodeMetadata]:
    """A decode step (one new token per sequence) whose inputs stay on the host (zero-copy views of numpy).

    For a captured decode graph: `fill_buffers` writes it into the graph's pinned staging mirror and copies
    it to the device in one transfer. token_ids int64 `[B]`, num_history int32 `[B]`, block_tables int32
    `[B, W]`, already validated. Returns (ids, positions = num_history as int64, metadata). Not for eager
    execution (the operators need device tensors and `AttentionMetadata`).
    """
    meta = HostDecodeMetadata(np.require(num_history, np.int32), np.require(block_tables, np.int32), block_size)
    ids = torch.from_numpy(np.require(token_ids, np.int64, ("C", "W")))
    return ids, torch.from_numpy(num_history.astype(np.int64)), meta


class HostPrefillMetadata:
    """A prefill or mixed step's metadata still on the host, for a captured full prefill graph only
    (`PrefillGraphBuffersMixin.fill_prefill_buffers` writes it into the graphs' pinned staging mirror and copies it
    to the device in one transfer; no eager operator can read it).

    q_seqlens / num_history int32 `[B]`, block_tables int32 `[B, W]`: validated numpy arrays owned by the caller
    until the step is launched. Positions, slots, lengths and starts are derived while filling the mirror.
    `last_token_index` is None until that fill sets it to the device view (int64 `[B]`) of the staged rows: what
    the LM head reads after the replay, valid until the next prefill-graph step."""

    __slots__ = ("q_seqlens", "num_history", "block_tables", "block_size", "batch_size", "num_tokens",
                 "last_token_index")
    is_decoding = False

    def __init__(self, q_seqlens: np.ndarray, num_history: np.ndarray, block_tables: np.ndarray, block_size: int,
                 num_tokens: int):
        self.q_seqlens, self.num_history, self.block_tables = q_seqlens, num_history, block_tables
        self.block_size, self.num_tokens = block_size, num_tokens
        self.batch_size = int(q_seqlens.shape[0])
        self.last_token_index: Optional[torch.Tensor] = None

    @property
    def max_q_seqlen(self) -> int:
        return int(self.q_seqlens.max())


def build_prefill_step_host(
    token_ids: np.ndarray,
    q_seqlens: np.ndarray,
    num_history: np.ndarray,
    block_tables: np.ndarray,
    block_size: int,
) -> tuple[torch.Tensor, HostPrefillMetadata]:
    """A non-decode step whose inputs stay on the host, for a captured full prefill graph: (token ids int64 `[T]`,
    a zero-copy CPU view, which the step also carries as its positions: the fill derives them; metadata).
    token_ids int64 `[T]`, q_seqlens / num_history int32 `[B]`, block_tables int32 `[B, W]`, already validated."""
    ids = torch.from_numpy(np.require(token_ids, np.int64, ("C", "W")))
    meta = HostPrefillMetadata(np.require(q_seqlens, np.int32), np.require(num_history, np.int32),
                               np.require(block_tables, np.int32), block_size, int(ids.shape[0]))
    return ids, meta
