"""The model side of the full decode graph buffer contract (make / fill / update context / outputs).

Buffers are allocated once per graph runner lifetime at the largest bucket and shared by
every decode graph. Padded rows are harmless by construction: slot -1 (the store
kernel skips it), kv_seqlen 1 and a block table pointing at the reserved padding
block 0 (attention stays in bounds), token 0 at position 0 (output ignored).

The per-step fields live in one device staging tensor, field after field (input_ids,
position_ids, slot_mapping as int64, then kv_seqlens and the block table as int32), with
a pinned host mirror. A step whose tensors are on the host (the rank's decode fast path)
is written into the mirror with numpy and reaches the device in ONE host-to-device copy
of the prefix the bucket needs; a step already on the device is copied field by field.
Token ids already on the device (a step that continues the previous step's tokens without
a round trip through the host) are copied device-to-device after that transfer. The mirror
is rewritten only after the previous step's transfer finished (an event recorded after it):
a rank may enqueue the next step while the device still runs the current one. An armed
replay (`FullGraphRunner.arm`) enqueues the transfer before its step is known, behind a gate:
the mirror holds padding rows until the host stages the live step and opens the gate.
"""
from __future__ import annotations

import copy
from typing import Any

import numpy as np
import torch

from modeling.attn_metadata import AttentionMetadata, HostDecodeMetadata

_ROW_BUFFERS = ("q_seqlens", "kv_seqlens", "q_start_loc", "last_token_index")


def _pad_host_rows(h: dict[str, Any], lo: int, hi: int) -> None:
    """Rows [lo, hi) of the pinned mirror's fields `h` become padding rows (token 0 at position 0, slot -1,
    length 1, block table of the padding block 0)."""
    if hi > lo:
        h["input_ids"][lo:hi] = 0
        h["position_ids"][lo:hi] = 0
        h["slot_mapping"][lo:hi] = -1
        h["kv_seqlens"][lo:hi] = 1
        h["block_tables"][lo:hi] = 0


class DecodeGraphBuffersMixin:
    """Mixed into the model; needs `self.attn_ops` (capturability) and `self.config`."""

    def supports_cuda_graph(self, step: Any) -> bool:
        return bool(step.is_decoding) and self.attn_ops.capturable

    def graph_extra_key(self, step: Any) -> tuple:
        return ()

    def make_buffers(self, graph_meta: Any) -> dict[str, Any]:
        dev, b, w = graph_meta.device, graph_meta.max_batch_size, graph_meta.max_blocks_per_seq
        n64 = 3 * b + -(-(b + b * w) // 2)  # three int64 fields, then the int32 fields packed in pairs
        staging = torch.zeros(n64, dtype=torch.int64, device=dev)
        host = torch.zeros(n64, dtype=torch.int64, pin_memory=dev.type == "cuda")
        h64, h32 = host.numpy(), host.numpy()[3 * b:].view(np.int32)
        d32 = staging[3 * b:].view(torch.int32)
        bufs: dict[str, Any] = {
            "input_ids": staging[0:b],
            "position_ids": staging[b:2 * b],
            "slot_mapping": staging[2 * b:3 * b],
            "kv_seqlens": d32[0:b],
            "block_tables": d32[b:b + b * w].view(b, w),
            "q_seqlens": torch.ones(b, dtype=torch.int32, device=dev),
            "q_start_loc": torch.arange(b, dtype=torch.int32, device=dev),
            "last_token_index": torch.arange(b, dtype=torch.int64, device=dev),
            "_staging": staging,
            "_host": host,
            "_host_copied": torch.cuda.Event() if dev.type == "cuda" else None,  # recorded after each transfer
            "_host_fields": {"input_ids": h64[0:b], "position_ids": h64[b:2 * b], "slot_mapping": h64[2 * b:3 * b],
                             "kv_seqlens": h32[0:b], "block_tables": h32[b:b + b * w].reshape(b, w),
                             "rows": np.arange(b)},
            "_copy_views": {},  # padded batch -> (staging bytes, mirror bytes) of its one transfer
            "_contexts": {},  # (padded batch, block size) -> the step fields `update_context` redirects
        }
        bufs["slot_mapping"].fill_(-1)
        bufs["kv_seqlens"].fill_(1)
        return bufs

    def fill_buffers(self, buffers: dict[str, Any], step: Any, padded_batch: int) -> None:
        """Copy a live decode step (one token per sequence) into rows [0, n) and pad rows [n, padded_batch)."""
        meta = step.attn_metadata
        n = step.batch_size
        width = meta.block_tables.shape[1]
        if width > buffers["block_tables"].shape[1]:
            raise ValueError(f"block table width {width} exceeds the graph buffers' {buffers['block_tables'].shape[1]}")
        if isinstance(meta, HostDecodeMetadata):
            self._fill_from_host(buffers, step, meta, padded_batch)
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

    @classmethod
    def _fill_from_host(cls, buffers: dict[str, Any], step: Any, meta: HostDecodeMetadata, p: int) -> None:
        """Write a host decode step into the pinned mirror and copy the prefix bucket `p` needs in one transfer.
        Token ids already on the device are copied device-to-device after it."""
        cls.wait_staged(buffers)
        cls.stage_host_step(buffers, step, p)
        cls.copy_staged(buffers, p)
        if step.input_ids.is_cuda:
            buffers["input_ids"][:meta.batch_size].copy_(step.input_ids, non_blocking=True)

    @staticmethod
    def wait_staged(buffers: dict[str, Any]) -> None:
        """Block until the latest transfer out of the pinned mirror has run (no-op before the first), so the
        mirror may be rewritten."""
        copied = buffers["_host_copied"]
        if copied is not None:
            copied.synchronize()

    @staticmethod
    def stage_host_padding(buffers: dict[str, Any], p: int) -> None:
        """Make rows [0, p) of the pinned mirror padding rows (token 0 at position 0, slot -1, length 1, block
        table of the padding block): a transfer of it makes a replay of bucket `p` write no KV. Host only; the
        same precondition as `stage_host_decode`."""
        _pad_host_rows(buffers["_host_fields"], 0, p)

    @classmethod
    def stage_host_step(cls, buffers: dict[str, Any], step: Any, p: int) -> None:
        """`stage_host_decode` for a host decode step (`HostDecodeMetadata`); ids already on the device are not
        written (the caller copies them)."""
        meta = step.attn_metadata
        ids = None if step.input_ids.is_cuda else step.input_ids.numpy()
        cls.stage_host_decode(buffers, ids, meta.num_history, meta.block_tables, meta.block_size, p)

    @staticmethod
    def stage_host_decode(buffers: dict[str, Any], ids: Any, hist: np.ndarray, tables: np.ndarray, bs: int,
                          p: int) -> None:
        """Write a decode step into the pinned mirror only: token ids int64 `[n]` (None: leave them), positions =
        `hist` (int32 `[n]` cached tokens per sequence), the slot of each position, lengths = hist + 1, block
        tables int32 `[n, W]` (validated), padding rows up to bucket `p`. Nothing is enqueued. Precondition: no
        transfer out of the mirror is running or due before the caller's next `copy_staged` (`wait_staged`, or a
        transfer still held behind a closed gate, `FullGraphRunner.arm`)."""
        h = buffers["_host_fields"]
        n = int(hist.shape[0])
        if ids is not None:
            h["input_ids"][:n] = ids
        pos, slots = h["position_ids"][:n], h["slot_mapping"][:n]
        if n == 1:
            x = int(hist[0])
            pos[0] = x
            slots[0] = int(tables[0, x // bs]) * bs + x % bs
            h["kv_seqlens"][0] = x + 1
        else:
            pos[:] = hist
            np.add(hist, 1, out=h["kv_seqlens"][:n])
            blocks = pos // bs
            np.multiply(tables[h["rows"][:n], blocks], bs, out=slots, casting="unsafe")
            slots += pos - blocks * bs
        width = tables.shape[1]
        bt = h["block_tables"]
        bt[:n, :width] = tables
        bt[:n, width:] = 0
        _pad_host_rows(h, n, p)

    @staticmethod
    def copy_staged(buffers: dict[str, Any], p: int) -> None:
        """Enqueue the one host-to-device transfer of the mirror prefix bucket `p` reads (the int64 fields,
        kv_seqlens, the first `p` block-table rows) on the current stream, then record `_host_copied` (what
        `wait_staged` waits for). The transfer reads the mirror when the stream reaches it, not now."""
        views = buffers["_copy_views"].get(p)
        if views is None:
            b, w = buffers["_host_fields"]["block_tables"].shape
            nbytes = 3 * b * 8 + (b + p * w) * 4
            views = buffers["_copy_views"][p] = (buffers["_staging"].view(torch.uint8)[:nbytes],
                                                 buffers["_host"].view(torch.uint8)[:nbytes])
        views[0].copy_(views[1], non_blocking=True)
        copied = buffers["_host_copied"]
        if copied is not None:
            copied.record()

    def update_context(self, buffers: dict[str, torch.Tensor], step: Any, padded_batch: int) -> Any:
        """A step whose tensors are bucket-shaped views of `buffers` (what the graph is captured on). The views
        and their metadata are made once per (bucket, block size) and reused (they never change)."""
        p, bs = padded_batch, step.attn_metadata.block_size
        ctx = buffers["_contexts"].get((p, bs))
        if ctx is None:
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
                max_kv_seqlen=bt.shape[1] * bs,
                block_size=bs,
            )
            ctx = buffers["_contexts"][(p, bs)] = {"input_ids": buffers["input_ids"][:p],
                                                   "position_ids": buffers["position_ids"][:p], "attn_metadata": meta}
        view = copy.copy(step)
        view.__dict__.update(ctx)
        return view

    def get_outputs(self, output: torch.Tensor, num_tokens: int) -> torch.Tensor:
        return output[:num_tokens]
