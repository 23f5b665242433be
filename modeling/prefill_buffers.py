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

import torch

from modeling.attn_metadata import AttentionMetadata
from modeling.cudagraph import redirected
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
        """Static buffers for every prefill graph up to (`max_tokens`, `max_seqs`), block tables `max_blocks` wide."""
        i32, i64 = torch.int32, torch.int64
        bufs: dict[str, Any] = {
            "input_ids": torch.zeros(max_tokens, dtype=i64, device=device),
            "position_ids": torch.zeros(max_tokens, dtype=i64, device=device),
            "slot_mapping": torch.full((max_tokens,), -1, dtype=i64, device=device),
            "q_seqlens": torch.zeros(max_seqs, dtype=i32, device=device),
            "kv_seqlens": torch.zeros(max_seqs, dtype=i32, device=device),
            "q_start_loc": torch.zeros(max_seqs, dtype=i32, device=device),
            "last_token_index": torch.zeros(max_seqs, dtype=i64, device=device),
            "block_tables": torch.zeros(max_seqs, max_blocks, dtype=i32, device=device),
            "_contexts": {},  # (T, S, block size) -> the step fields `prefill_context` redirects
        }
        return bufs

    @staticmethod
    def fill_prefill_buffers(buffers: dict[str, Any], step: Any, tokens: int, seqs: int) -> None:
        """Copy the live step (n <= `tokens` tokens, B <= `seqs` sequences, device tensors) into the buffers'
        bucket prefix and make the rest padding (current stream, asynchronous)."""
        meta = step.attn_metadata
        n, b = meta.num_tokens, meta.batch_size
        width = meta.block_tables.shape[1]
        bt = buffers["block_tables"]
        if n > tokens or b > seqs or width > bt.shape[1]:
            raise ValueError(f"a step of {n} tokens, {b} sequences, block tables {width} wide does not fit the "
                             f"prefill graph ({tokens}, {seqs}, {bt.shape[1]})")
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
    def prefill_context(buffers: dict[str, Any], step: Any, tokens: int, seqs: int) -> Any:
        """A step whose tensors are bucket-shaped views of `buffers` (what the graph is captured on): `tokens`
        tokens, `seqs` sequences, the bucket's host bounds. Views and metadata are made once per (T, S, block
        size) and reused."""
        bs = step.attn_metadata.block_size
        ctx = buffers["_contexts"].get((tokens, seqs, bs))
        if ctx is None:
            bt = buffers["block_tables"][:seqs]
            meta = AttentionMetadata(
                is_decoding=False,
                q_seqlens=buffers["q_seqlens"][:seqs],
                kv_seqlens=buffers["kv_seqlens"][:seqs],
                q_start_loc=buffers["q_start_loc"][:seqs],
                block_tables=bt,
                slot_mapping=buffers["slot_mapping"][:tokens],
                last_token_index=buffers["last_token_index"][:seqs],
                max_q_seqlen=tokens,
                max_kv_seqlen=bt.shape[1] * bs,
                block_size=bs,
            )
            ctx = buffers["_contexts"][(tokens, seqs, bs)] = {
                "input_ids": buffers["input_ids"][:tokens], "position_ids": buffers["position_ids"][:tokens],
                "attn_metadata": meta}
        return redirected(step, ctx)
