"""The model side of the full prefill graph buffer contract (`graphrunner.prefill_graph`).

A full prefill graph runs a whole non-decode step (prompts, prompt chunks with history, decode rows mixed in) as
one CUDA graph of a (token bucket T, sequence bucket S). Everything that differs between steps lives in static
device buffers the graph reads by address; the attention kernels take every length from them:

    tokens:    input_ids, position_ids (int64 `[T]`), slot_mapping (int64 `[T]`, -1 = store nothing)
    sequences: q_seqlens, kv_seqlens, q_start_loc (int32 `[S]`), last_token_index (int64 `[S]`),
               block_tables (int32 `[S, W]`)

Padding is harmless by construction: padding tokens (rows n..T) are token 0 at position 0 with slot -1 and belong
to no sequence, so attention leaves their rows zero and they write no KV; padding sequences (rows B..S) have no
new tokens (q_seqlen 0: the prefill kernel's programs for them exit at once) and the padding block 0 as table.
The host bounds the kernels see are the bucket's (`max_q_seqlen` = T), never a request's.

Buffers are made once per runner lifetime at the largest buckets and shared by every prefill graph. Filling
copies the live step's device tensors (the rank built them for this step) on the current stream.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from modeling.attn_metadata import HostPrefillMetadata
from modeling.cudagraph import bucket_step
from modeling.moe import SparseMoeBlock

_TOKEN_FIELDS = (("input_ids", 0), ("position_ids", 0), ("slot_mapping", -1))
_SEQ_FIELDS = ("q_seqlens", "kv_seqlens", "q_start_loc", "last_token_index")


class PrefillGraphBuffersMixin:
    """Mixed into the model; needs `self.attn_ops` (capturability), `self.ctx` and `self.layers`."""

    def supports_prefill_graph(self, step: Any) -> bool:
        """Whether a full prefill graph may serve `step`: capturable kernels, TP = EP = 1 (the all-reduce and
        expert-dispatch paths of prefill-sized steps are not validated inside graphs yet), and MoE layers only on
        the routed-expert kernel (device-side grouping at every size; the torch paths sync with the host)."""
        if step.mrope_position_ids is not None or step.state_ids is not None:
            return False
        capable = self.__dict__.get("_prefill_graph_capable")
        if capable is None:  # facts of the model, not of the step: decided once, not on every prefill step
            capable = self._prefill_graph_capable = (
                self.attn_ops.capturable and self.ctx.tp_size == 1 and self.ctx.ep_size == 1
                and all(layer.mlp.routed_kernel is not None for layer in self.layers
                        if isinstance(layer.mlp, SparseMoeBlock)))
        return capable

    def make_prefill_buffers(self, max_tokens: int, max_seqs: int, max_blocks: int,
                             device: torch.device) -> dict[str, Any]:
        """Static buffers for every prefill graph up to (`max_tokens`, `max_seqs`), block tables `max_blocks` wide:
        typed views of ONE int64 device tensor (`_block`; the int64 fields, then the int32 ones), with a host
        mirror of its words (`_mirror`, pinned on CUDA) and the event recorded after each transfer from it."""
        t, s, w = max_tokens, max_seqs, max_blocks
        words = 3 * t + s + -(-(3 * s + s * w) // 2)
        block = torch.zeros(words, dtype=torch.int64, device=device)
        mirror = torch.zeros(words, dtype=torch.int64, pin_memory=device.type == "cuda")
        bufs: dict[str, Any] = {"_block": block, "_mirror": mirror, "_contexts": {},  # (T, S, block size) -> views (`bucket_step`)
                                "_copied": torch.cuda.Event() if device.type == "cuda" else None}
        host: dict[str, Any] = {}
        for src, out in ((block, bufs), (mirror, host)):
            i64, i32 = src[:3 * t + s], src[3 * t + s:].view(torch.int32)
            for name, lo in (("input_ids", 0), ("position_ids", t), ("slot_mapping", 2 * t)):
                out[name] = i64[lo:lo + t]
            out["last_token_index"] = i64[3 * t:3 * t + s]
            for name, lo in (("q_seqlens", 0), ("kv_seqlens", s), ("q_start_loc", 2 * s)):
                out[name] = i32[lo:lo + s]
            out["block_tables"] = i32[3 * s:3 * s + s * w].view(s, w)
        bufs["slot_mapping"].fill_(-1)
        bufs["_host"] = {name: v.numpy() for name, v in host.items()}
        return bufs

    @classmethod
    def fill_prefill_buffers(cls, buffers: dict[str, Any], step: Any, tokens: int, seqs: int) -> None:
        """Copy the live step (n <= `tokens` tokens, B <= `seqs` sequences) into the buffers' bucket prefix and make
        the rest padding (current stream, asynchronous). A step with device tensors is copied field by field; a step
        whose metadata is still on the host (`HostPrefillMetadata`) is written into the mirror and sent in one
        transfer (`stage_host_prefill`)."""
        meta = step.attn_metadata
        n, b = meta.num_tokens, meta.batch_size
        width = meta.block_tables.shape[1]
        bt = buffers["block_tables"]
        if n > tokens or b > seqs or width > bt.shape[1]:
            raise ValueError(f"a step of {n} tokens, {b} sequences, block tables {width} wide does not fit the "
                             f"prefill graph ({tokens}, {seqs}, {bt.shape[1]})")
        if isinstance(meta, HostPrefillMetadata):
            cls.stage_host_prefill(buffers, step, tokens, seqs)
            return
        live = {"input_ids": step.input_ids, "position_ids": step.position_ids, "slot_mapping": meta.slot_mapping}
        for name, pad in _TOKEN_FIELDS:
            buf = buffers[name]
            buf[:n].copy_(live[name], non_blocking=True)
            if tokens > n:
                buf[n:tokens].fill_(pad)
        for name in _SEQ_FIELDS:
            buf = buffers[name]
            buf[:b].copy_(getattr(meta, name), non_blocking=True)
            if seqs > b:
                buf[b:seqs].zero_()
        bt[:b, :width].copy_(meta.block_tables, non_blocking=True)
        if width < bt.shape[1]:
            bt[:b, width:].zero_()
        if seqs > b:
            bt[b:seqs].zero_()

    @staticmethod
    def stage_host_prefill(buffers: dict[str, Any], step: Any, tokens: int, seqs: int) -> None:
        """Write a host step (int64 CPU token ids, `HostPrefillMetadata`) into the mirror's bucket prefix with its
        padding, then copy the whole mirror to the device block in one transfer (current stream) and set
        `meta.last_token_index` to the device rows. The mirror is rewritten only after the previous transfer ran."""
        meta = step.attn_metadata
        h = buffers["_host"]
        copied = buffers["_copied"]
        if copied is not None:
            copied.synchronize()
        q, hist, tables, bs = meta.q_seqlens, meta.num_history, meta.block_tables, meta.block_size
        n, b, w = meta.num_tokens, meta.batch_size, tables.shape[1]
        starts = h["q_start_loc"]
        starts[0] = 0
        np.cumsum(q[:-1], out=starts[1:b])
        seq_of = np.repeat(np.arange(b), q)
        pos = h["position_ids"]
        np.subtract(np.arange(n, dtype=np.int64), np.repeat(starts[:b], q), out=pos[:n])
        pos[:n] += np.repeat(hist, q)
        h["input_ids"][:n] = step.input_ids.numpy()
        h["slot_mapping"][:n] = tables[seq_of, pos[:n] // bs].astype(np.int64) * bs + pos[:n] % bs
        for name, pad in _TOKEN_FIELDS:
            h[name][n:tokens] = pad
        np.add(starts[:b], q - 1, out=h["last_token_index"][:b])
        h["q_seqlens"][:b] = q
        np.add(hist, q, out=h["kv_seqlens"][:b])
        for name in _SEQ_FIELDS:
            h[name][b:seqs] = 0
        bt = h["block_tables"]
        bt[:b, :w] = tables
        bt[:b, w:] = 0
        bt[b:seqs] = 0
        buffers["_block"].copy_(buffers["_mirror"], non_blocking=True)
        if copied is not None:
            copied.record()
        meta.last_token_index = buffers["last_token_index"][:b]

    @staticmethod
    def prefill_context(buffers: dict[str, Any], step: Any, tokens: int, seqs: int) -> Any:
        """A step whose tensors are bucket-shaped views of `buffers` (what the graph is captured on): `tokens`
        tokens, `seqs` sequences, the bucket's host bounds. Views and metadata are made once per (T, S, block
        size) and reused."""
        return bucket_step(buffers, step, tokens, seqs, decoding=False)
