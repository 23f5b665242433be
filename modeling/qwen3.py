"""Qwen3 and Qwen3-MoE causal language models on a paged KV cache.

`forward(input_ids [T], position_ids [T], kv_caches, attn_metadata) -> hidden [T, H]`
over flattened tokens; `compute_logits(hidden, last_token_index [B]) -> fp32 [B, V]`.
The model implements the graph runner's buffer contract through `DecodeGraphBuffersMixin`
and opts into piecewise prefill graphs by installing its operators' eager boundaries.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from modeling.attention import AttentionImpl
from modeling.config import ModelConfig
from modeling.cudagraph import DecodeGraphBuffersMixin
from modeling.layers import Qwen3Attention, Qwen3MLP, RMSNorm, RotaryEmbedding, project_add_norm
from modeling.moe import SparseMoeBlock
from modeling.ops import KernelOps, get_kernel_ops
from parallel.context import ParallelContext
from parallel.layers import ParallelLMHead, VocabParallelEmbedding


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, idx: int, ctx: ParallelContext, attn: AttentionImpl, rope: RotaryEmbedding,
                 ops: KernelOps, device=None):
        super().__init__()
        self.self_attn = Qwen3Attention(cfg, idx, ctx, attn, rope, ops, device)
        self.mlp = (
            SparseMoeBlock(cfg, ctx, device) if cfg.layer_is_moe(idx)
            else Qwen3MLP(cfg.hidden_size, cfg.intermediate_size, ctx, cfg.dtype, ops, device)
        )
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype, ops, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype, ops, device)
        self.ops = ops

    def forward(self, positions, hidden, residual, kv_caches, attn_metadata, next_norm: RMSNorm):
        """hidden: this layer's input, already normed by its `input_layernorm`; residual: the stream it was normed
        from. Returns (next_norm(stream'), stream'): the next layer's normed input (or, with the model's final
        norm, the output) and the new stream. Each residual add + norm rides on the projection before it."""
        o = self.self_attn.attend(positions, hidden, kv_caches, attn_metadata)
        hidden, residual = project_add_norm(self.self_attn.o_proj, o, residual, self.post_attention_layernorm, self.ops)
        if isinstance(self.mlp, Qwen3MLP):
            up = self.mlp.gate_up_proj(hidden)
            return project_add_norm(self.mlp.down_proj, up, residual, next_norm, self.ops, gated=True)
        return next_norm(self.mlp(hidden), residual)


class Qwen3ForCausalLM(DecodeGraphBuffersMixin, nn.Module):
    """Qwen3 dense or MoE (by `cfg.num_experts`). Parameters are created on `device` uninitialised;
    fill them with `modeling.loader` (checkpoint) or `modeling.weights.init_random`."""

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext | None = None, device: torch.device | str = "cpu",
                 ops: KernelOps | None = None):
        super().__init__()
        self.config = cfg
        self.ctx = ctx or ParallelContext()
        dev = torch.device(device)
        self.kernels = ops or get_kernel_ops(dev)
        self.attn_impl = AttentionImpl(self.kernels)
        rope = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, dev)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, self.ctx, cfg.dtype, dev)
        self.layers = nn.ModuleList(
            Qwen3DecoderLayer(cfg, i, self.ctx, self.attn_impl, rope, self.kernels, dev) for i in range(cfg.num_layers)
        )
        self.rope = rope
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype, self.kernels, dev)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, self.ctx, cfg.dtype, dev)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        for m in self.modules():  # dense projections and the LM head use the backend's GEMM
            if hasattr(type(m), "gemm"):
                m.gemm = self.kernels.linear

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def attn_ops(self) -> KernelOps:
        return self.kernels

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, kv_caches: Sequence[Any], attn_metadata: Any,
                **constants: Any) -> torch.Tensor:
        if constants:
            raise TypeError(f"Qwen3ForCausalLM.forward takes no extra arguments, got {sorted(constants)}")
        residual = self.embed_tokens(input_ids)
        hidden = self.layers[0].input_layernorm(residual)
        for i, layer in enumerate(self.layers):
            next_norm = self.layers[i + 1].input_layernorm if i + 1 < len(self.layers) else self.norm
            hidden, residual = layer(position_ids, hidden, residual, kv_caches, attn_metadata, next_norm)
        return hidden

    def warm_up_kernels(self, kv_caches: Sequence[Any]) -> int:
        """Compile every attention kernel variant serving can pick over these caches (`KernelOps.warm_up_attention`:
        side by side on threads), on the current stream, outside graph capture; returns the number of launches (0
        for the torch backend)."""
        attn = self.layers[0].self_attn
        k_cache, v_cache = kv_caches[0]
        return self.kernels.warm_up_attention(k_cache, v_cache, attn.num_heads, attn.scale)

    def compute_logits(self, hidden: torch.Tensor, last_token_index: torch.Tensor) -> torch.Tensor:
        """hidden `[T, H]`, last_token_index int64 `[B]` -> fp32 logits `[B, vocab]`."""
        return self.lm_head.logits(hidden.index_select(0, last_token_index))

    def greedy_tokens(self, hidden: torch.Tensor, last_token_index: torch.Tensor) -> torch.Tensor:
        """hidden `[T, H]`, last_token_index int64 `[B]` -> int64 `[B]`, equal to `compute_logits(...).argmax(-1)`
        without the fp32 logits (and under TP without gathering them)."""
        return self.lm_head.greedy(hidden.index_select(0, last_token_index))

    # ---- piecewise CUDA graph opt-in: every request-dependent operator installs its eager boundary, all or none
    def _boundary_operators(self) -> list:
        ops: list = [self.attn_impl]
        ops += [layer.mlp for layer in self.layers if isinstance(layer.mlp, SparseMoeBlock)]
        return ops

    def supports_piecewise_cuda_graph(self) -> bool:
        return all(op.supports_piecewise_cuda_graph() for op in self._boundary_operators())

    def enable_piecewise_cuda_graph(self) -> bool:
        if not self.supports_piecewise_cuda_graph():
            return False
        for op in self._boundary_operators():
            op.enable_piecewise_cuda_graph()
        return True
