"""The model side of the full decode graph buffer contract (make / fill / update context / outputs).

Buffers are allocated once per graph runner lifetime at the largest bucket and shared by
every decode graph. Padded rows are harmless by construction: slot -1 (the store
kernel skips it), kv_seqlen 1 and a block table pointing at the reserved padding
block 0 (attention stays in bounds), token 0 at position 0 (output ignored).

The per-step fields are declared as the staging spec `DECODE_STAGING` (input_ids,
position_ids, slot_mapping as int64 `[B]`, then kv_seqlens int32 `[B]` and the block table
int32 `[B, W]`); the graph runner owns their `graphrunner.staging.HostStaging` (one device
staging tensor, a pinned host mirror, its event) and hands it to `make_buffers`, whose
buffers are its device views. A step whose tensors are on the host (the rank's decode fast
path) is written into the mirror with numpy (`_stage_decode`: positions, slots and lengths
from the cached-token counts and block tables) and reaches the device in ONE host-to-device
copy of the prefix the bucket needs; a step already on the device is copied field by field.
Token ids already on the device (a step that continues the previous step's tokens without
a round trip through the host) are copied device-to-device after that transfer. The mirror
is rewritten only after the previous step's transfer finished (`HostStaging.wait`): a rank
may enqueue the next step while the device still runs the current one. An armed replay
(`FullGraphRunner.arm`) enqueues the transfer before its step is known, behind a gate: the
mirror holds padding rows until the host stages the live step and opens the gate.
"""
from __future__ import annotations

import copy
from typing import Any, Optional

import numpy as np
import torch

from graphrunner.staging import HostStaging, StagingField, StagingSpec
from modeling.attn_metadata import AttentionMetadata, HostDecodeMetadata


def _stage_decode(staging: HostStaging, ids: Optional[np.ndarray], hist: np.ndarray, tables: np.ndarray,
                  bs: int) -> None:
    """Write rows [0, n) of a decode step into the staging's host mirror only: token ids int64 `[n]` (None: leave
    them), positions = `hist` (int32 `[n]` cached tokens per sequence), the slot of each position, lengths =
    hist + 1, block tables int32 `[n, W']` (validated; columns past W' zeroed). `HostStaging.stage_decode` pads
    the rows after n; its precondition holds (no transfer out of the mirror running or due)."""
    h = staging.host_fields
    n = int(hist.shape[0])
    if ids is not None:
        h.input_ids[:n] = ids
    pos, slots = h.position_ids[:n], h.slot_mapping[:n]
    if n == 1:
        x = int(hist[0])
        pos[0] = x
        slots[0] = int(tables[0, x // bs]) * bs + x % bs
        h.kv_seqlens[0] = x + 1
    else:
        pos[:] = hist
        np.add(hist, 1, out=h.kv_seqlens[:n])
        blocks = pos // bs
        np.multiply(tables[staging.row_index[:n], blocks], bs, out=slots, casting="unsafe")
        slots += pos - blocks * bs
    width = tables.shape[1]
    bt = h.block_tables
    bt[:n, :width] = tables
    bt[:n, width:] = 0


# The per-step fields of the decode graphs, in staging layout order, with their padding rows' values.
DECODE_STAGING = StagingSpec(
    fields=(
        StagingField("input_ids", torch.int64, pad=0),
        StagingField("position_ids", torch.int64, pad=0),
        StagingField("slot_mapping", torch.int64, pad=-1),
        StagingField("kv_seqlens", torch.int32, pad=1),
        StagingField("block_tables", torch.int32, pad=0, blocks=True),
    ),
    stage_decode=_stage_decode,
)


def redirected(step: Any, fields: dict[str, Any]) -> Any:
    """A shallow copy of `step` whose `fields` (graph input views, metadata) replace its own: what a graph is
    captured on and replays from. Cheaper than `dataclasses.replace` (no __init__), which matters per step."""
    view = copy.copy(step)
    view.__dict__.update(fields)
    return view


def bucket_step(buffers: dict[str, Any], step: Any, tokens: int, seqs: int, decoding: bool) -> Any:
    """`step` redirected to bucket-shaped views of a graph's static `buffers`: `tokens` rows of input_ids,
    position_ids and slot_mapping, `seqs` rows of the per-sequence fields and block tables, and the bucket's host
    bounds (max_q_seqlen 1 when `decoding`, else `tokens`). The views and their metadata are made once per
    (tokens, seqs, block size) into `buffers["_contexts"]` and reused: they never change."""
    bs = step.attn_metadata.block_size
    key = (tokens, seqs, bs)
    ctx = buffers["_contexts"].get(key)
    if ctx is None:
        bt = buffers["block_tables"][:seqs]
        meta = AttentionMetadata(
            is_decoding=decoding,
            q_seqlens=buffers["q_seqlens"][:seqs],
            kv_seqlens=buffers["kv_seqlens"][:seqs],
            q_start_loc=buffers["q_start_loc"][:seqs],
            block_tables=bt,
            slot_mapping=buffers["slot_mapping"][:tokens],
            last_token_index=buffers["last_token_index"][:seqs],
            max_q_seqlen=1 if decoding else tokens,
            max_kv_seqlen=bt.shape[1] * bs,
            block_size=bs,
        )
        ctx = buffers["_contexts"][key] = {"input_ids": buffers["input_ids"][:tokens],
                                           "position_ids": buffers["position_ids"][:tokens], "attn_metadata": meta}
    return redirected(step, ctx)


class DecodeGraphBuffersMixin:
    """Mixed into the model; needs `self.attn_ops` (capturability) and `self.config`."""

    decode_staging = DECODE_STAGING  # the graph runner makes its `HostStaging` and passes it to `make_buffers`

    def supports_cuda_graph(self, step: Any) -> bool:
        return bool(step.is_decoding) and self.attn_ops.capturable

    def graph_extra_key(self, step: Any) -> tuple:
        return ()

    def make_buffers(self, graph_meta: Any, staging: Optional[HostStaging]) -> dict[str, Any]:
        """The decode graphs' buffers: the staged fields are `staging`'s device views (the `HostStaging` of
        `decode_staging` at `graph_meta`'s sizes, `graphrunner.staging.staging_for`), plus q_seqlens (ones),
        q_start_loc (int32 0..B-1) and last_token_index (int64 0..B-1), which no step changes."""
        dev, b, w = graph_meta.device, graph_meta.max_batch_size, graph_meta.max_blocks_per_seq
        if staging is None or staging.spec is not self.decode_staging or (staging.rows, staging.width) != (b, w):
            raise ValueError(f"make_buffers needs the HostStaging of this model's decode_staging at {b} x {w}")
        d = staging.device_fields
        return {
            "input_ids": d.input_ids,
            "position_ids": d.position_ids,
            "slot_mapping": d.slot_mapping,
            "kv_seqlens": d.kv_seqlens,
            "block_tables": d.block_tables,
            "q_seqlens": torch.ones(b, dtype=torch.int32, device=dev),
            "q_start_loc": torch.arange(b, dtype=torch.int32, device=dev),
            "last_token_index": torch.arange(b, dtype=torch.int64, device=dev),
            "staging": staging,
            "_contexts": {},  # (padded batch, padded batch, block size) -> the step fields `bucket_step` redirects
        }

    def fill_buffers(self, buffers: dict[str, Any], step: Any, padded_batch: int) -> None:
        """Copy a live decode step (one token per sequence) into rows [0, n) and pad rows [n, padded_batch).
        A host step (`HostDecodeMetadata`): wait for the previous transfer, stage it into the mirror, one
        transfer of the bucket's prefix, then token ids already on the device copied device-to-device."""
        meta = step.attn_metadata
        n = step.batch_size
        width = meta.block_tables.shape[1]
        if width > buffers["block_tables"].shape[1]:
            raise ValueError(f"block table width {width} exceeds the graph buffers' {buffers['block_tables'].shape[1]}")
        if isinstance(meta, HostDecodeMetadata):
            staging: HostStaging = buffers["staging"]
            ids_on_device = step.input_ids.is_cuda
            staging.wait()
            staging.stage_decode(None if ids_on_device else step.input_ids.numpy(), meta.num_history,
                                 meta.block_tables, meta.block_size, padded_batch)
            staging.copy_prefix(padded_batch)
            if ids_on_device:
                buffers["input_ids"][:meta.batch_size].copy_(step.input_ids, non_blocking=True)
            return
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
        """A step whose tensors are bucket-shaped views of `buffers` (what the graph is captured on). The views
        and their metadata are made once per (bucket, block size) and reused (they never change)."""
        return bucket_step(buffers, step, padded_batch, padded_batch, decoding=True)

    def get_outputs(self, output: torch.Tensor, num_tokens: int) -> torch.Tensor:
        return output[:num_tokens]
