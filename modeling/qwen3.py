"""Qwen3 and Qwen3-MoE causal language models on a paged KV cache.

`forward(input_ids [T], position_ids [T], kv_caches, attn_metadata) -> hidden [T, H]`
over flattened tokens; `compute_logits(hidden, last_token_index [B]) -> fp32 [B, V]`.
The model implements the graph runner's buffer contract through `DecodeGraphBuffersMixin`
and opts into piecewise prefill graphs by installing its operators' eager boundaries.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import nn

from modeling.attention import AttentionImpl
from modeling.config import ModelConfig
from modeling.cudagraph import DecodeGraphBuffersMixin
from modeling.layers import Qwen3Attention, Qwen3MLP, RMSNorm, RotaryEmbedding, project_add_norm
from modeling.ops.warm_up import prime_kernel_caches, run_side_by_side
from modeling.prefill_buffers import PrefillGraphBuffersMixin
from modeling.moe import SparseMoeBlock
from modeling.ops import KernelOps, get_kernel_ops
from modeling.ops.projection_choice import merge_forms, projection_shapes
from parallel.context import ParallelContext
from parallel.layers import (ParallelLMHead, QKVParallelLinear, RowParallelLinear, VocabParallelEmbedding)


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, idx: int, ctx: ParallelContext, attn: AttentionImpl, rope: RotaryEmbedding,
                 ops: KernelOps, device=None):
        super().__init__()
        self.self_attn = Qwen3Attention(cfg, idx, ctx, attn, rope, ops, device)
        self.mlp = (
            SparseMoeBlock(cfg, ctx, device, ops=ops) if cfg.layer_is_moe(idx)
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

    def forward_norm_first(self, positions, pending, residual, kv_caches, attn_metadata):
        """The same layer with each residual add + norm riding on the projection AFTER it (`KernelOps.norm_linear`:
        the GEMV's prologue at up to `prologue_norm_max_tokens` tokens; TP = 1 only). pending: the previous layer's
        output, not yet added to residual (None before the first layer, where residual is the embedding). Returns (this layer's output,
        not yet added; the stream it is to be added to)."""
        attn = self.self_attn
        norm = self.input_layernorm
        if pending is None:
            qkv, residual = self.ops.norm_linear(residual, None, norm.weight, norm.eps, attn.qkv_proj.weight)
        else:
            qkv, residual = self.ops.norm_linear(pending, residual, norm.weight, norm.eps, attn.qkv_proj.weight)
        y = attn.o_proj(attn.attend_projected(positions, qkv, kv_caches, attn_metadata))
        norm = self.post_attention_layernorm
        if isinstance(self.mlp, Qwen3MLP):
            act, residual = self.ops.norm_linear(y, residual, norm.weight, norm.eps, self.mlp.gate_up_proj.weight,
                                                 gated=True)
            return self.mlp.down_proj(act), residual
        if self.ops.options.moe_router_gemv:  # the router's GEMV carries the add + norm and keeps the normed rows
            logits, hidden, residual = self.ops.norm_linear_normed(y, residual, norm.weight, norm.eps,
                                                                   self.mlp.gate.weight)
            return self.mlp.forward_routed(hidden, logits), residual
        hidden, residual = norm(y, residual)
        return self.mlp(hidden), residual


class Qwen3ForCausalLM(DecodeGraphBuffersMixin, PrefillGraphBuffersMixin, nn.Module):
    """Qwen3 dense or MoE (by `cfg.num_experts`). Parameters are created on `device` uninitialised;
    fill them with `modeling.loader` (`load_checkpoint` or `init_random`)."""

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext | None = None, device: torch.device | str = "cpu",
                 ops: KernelOps | None = None):
        super().__init__()
        self.config = cfg
        self.ctx = ctx or ParallelContext()
        dev = torch.device(device)
        self.kernels = ops or get_kernel_ops(dev)
        self.attn_impl = AttentionImpl(self.kernels)
        rope = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, dev, cfg.rope_scaling)
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
        if self.ctx.tp_size == 1 and input_ids.shape[0] <= self.kernels.prologue_norm_max_tokens:
            pending = None
            for layer in self.layers:
                pending, residual = layer.forward_norm_first(position_ids, pending, residual, kv_caches, attn_metadata)
            return self.norm(pending, residual)[0]
        hidden = self.layers[0].input_layernorm(residual)
        for i, layer in enumerate(self.layers):
            next_norm = self.layers[i + 1].input_layernorm if i + 1 < len(self.layers) else self.norm
            hidden, residual = layer(position_ids, hidden, residual, kv_caches, attn_metadata, next_norm)
        return hidden

    def warm_up_kernels(self, kv_caches: Sequence[Any]) -> int:
        """Compile every attention kernel variant serving can pick over these caches (`KernelOps.warm_up_attention`)
        and every projection variant of the decode graphs (`decode_projection_warm_up_calls`), each side by side on
        threads, on the current stream, outside graph capture; then choose the decode projection fallbacks of every
        (N, K) this model has that the tuning table lacks (`KernelOps.measure_projections`, from the disk cache or
        measured: `modeling.ops.projection_choice`). Returns the number of warm-up launches (0 for the torch
        backend)."""
        attn = self.layers[0].self_attn
        k_cache, v_cache = kv_caches[0]
        launches = self.kernels.warm_up_attention(k_cache, v_cache, attn.num_heads, attn.scale)
        mlp = next((layer.mlp for layer in self.layers if isinstance(layer.mlp, Qwen3MLP)), None)
        moe = next((layer.mlp for layer in self.layers if isinstance(layer.mlp, SparseMoeBlock)), None)
        calls = decode_projection_warm_up_calls(attn.qkv_proj, attn.o_proj, mlp, self.layers[0].input_layernorm,
                                                self.ctx.tp_size, self.kernels,
                                                router_weight=None if moe is None else moe.gate.weight)
        launches += run_projection_warm_up(calls, self.device, self.kernels.options.compile_threads)
        self.kernels.measure_projections(projection_shapes(self), self.device, self.config.dtype,
                                         forms=self.projection_forms())
        return launches

    def projection_forms(self) -> dict[tuple[int, int], str]:
        """{(N, K): form} of the attention and dense MLP projections as the decode steps run them
        (`projection_choice.FORMS`): without TP the output and down projections carry the residual add + RMSNorm
        after them (`project_add_norm`), and down the SiLU-gate before it."""
        fused = self.ctx.tp_size == 1
        uses = []
        for layer in self.layers:
            attn = layer.self_attn
            uses += [(tuple(attn.qkv_proj.weight.shape), "plain"),
                     (tuple(attn.o_proj.weight.shape), "add_norm" if fused else "plain")]
            if isinstance(layer.mlp, Qwen3MLP):
                uses += [(tuple(layer.mlp.gate_up_proj.weight.shape), "plain"),
                         (tuple(layer.mlp.down_proj.weight.shape), "gated_add_norm" if fused else "gated")]
        return merge_forms(uses)

    def compute_logits(self, hidden: torch.Tensor, last_token_index: torch.Tensor) -> torch.Tensor:
        """hidden `[T, H]`, last_token_index int64 `[B]` -> fp32 logits `[B, vocab]`."""
        return self.lm_head.logits(hidden.index_select(0, last_token_index))

    def compute_logits_shard(self, hidden: torch.Tensor, last_token_index: torch.Tensor) -> torch.Tensor:
        """hidden `[T, H]`, last_token_index int64 `[B]` -> fp32 `[B, w]`: this TP rank's vocabulary shard of
        `compute_logits` (global ids from `logits_shard()[0]`), gathered from nobody."""
        return self.lm_head.shard_logits(hidden.index_select(0, last_token_index))

    def logits_shard(self) -> tuple[int, int, int]:
        """(first global token id of this rank's logits shard, its width, the widest shard's width)."""
        head = self.lm_head
        return head.start, head.shard_width, head.vocab_per_rank

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


def decode_projection_warm_up_calls(qkv_proj: QKVParallelLinear, o_proj: RowParallelLinear, mlp: Qwen3MLP | None,
                                    norm: RMSNorm, tp_size: int, ops: KernelOps,
                                    router_weight: torch.Tensor | None = None) -> list[Callable[[], Any]]:
    """One call per projection kernel variant a decode graph of 1..`ops.prologue_norm_max_tokens` tokens launches
    through these modules (the norm-first layout at TP = 1, with the first layer's norm-only prologue; the plain
    projections under TP; a MoE router `[E, H]` through `ops.moe_router_linear` where the backend has it), so a cold
    Triton cache compiles them side by side instead of one by one inside the
    capture. Triton specialises on dtypes, constants and divisibility, not on values: the modules' weights may be
    uninitialised. Each call allocates its inputs and discards its outputs: call outside capture, on any thread
    bound to the weights' device (`modeling.ops.warm_up.run_side_by_side`). Empty for the torch backend."""
    calls: list[Callable[[], Any]] = []
    weight = norm.weight
    hidden, dev, dtype = weight.shape[0], weight.device, weight.dtype
    attn_out = o_proj.weight.shape[1]
    for t in range(1, ops.prologue_norm_max_tokens + 1):
        def rows(width: int, t: int = t) -> torch.Tensor:
            return torch.zeros((t, width), dtype=dtype, device=dev)

        if tp_size == 1:
            calls += [lambda r=rows: ops.norm_linear(r(hidden), None, weight, norm.eps, qkv_proj.weight),
                      lambda r=rows: ops.norm_linear(r(hidden), r(hidden), weight, norm.eps, qkv_proj.weight),
                      lambda r=rows: ops.linear(r(attn_out), o_proj.weight)]
            if mlp is not None:
                calls += [lambda r=rows: ops.norm_linear(r(hidden), r(hidden), weight, norm.eps,
                                                         mlp.gate_up_proj.weight, gated=True),
                          lambda r=rows: ops.linear(r(mlp.down_proj.weight.shape[1]), mlp.down_proj.weight)]
        else:  # under TP the down projection takes the SiLU-gate as `project_add_norm` calls it
            calls += [lambda r=rows: ops.linear(r(hidden), qkv_proj.weight),
                      lambda r=rows: ops.linear(r(attn_out), o_proj.weight)]
            if mlp is not None:
                calls += [lambda r=rows: ops.linear(r(hidden), mlp.gate_up_proj.weight),
                          lambda r=rows: ops.silu_mul_linear(r(2 * mlp.down_proj.weight.shape[1]),
                                                             mlp.down_proj.weight)]
        if router_weight is not None and ops.options.moe_router_gemv:  # as `forward_norm_first` / the MoE block
            if tp_size == 1:
                calls.append(lambda r=rows: ops.norm_linear_normed(r(hidden), r(hidden), weight, norm.eps,
                                                                   router_weight))
            elif ops.moe_router_linear is not None:
                calls.append(lambda r=rows: ops.moe_router_linear(r(hidden), router_weight))
    return calls


def config_projection_warm_up_calls(cfg: ModelConfig, ctx: ParallelContext, ops: KernelOps,
                                    device: torch.device) -> list[Callable[[], Any]]:
    """`decode_projection_warm_up_calls` before the model exists: over one layer's projections of this rank's
    shapes (`ctx`: tp_rank / tp_size only), uninitialised, on `device`. Lifetime: the calls hold those weights."""
    if ops.prologue_norm_max_tokens == 0:
        return []
    qkv = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, ctx, cfg.dtype, device)
    o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, ctx, cfg.dtype, device)
    dense = any(not cfg.layer_is_moe(i) for i in range(cfg.num_layers))
    mlp = Qwen3MLP(cfg.hidden_size, cfg.intermediate_size, ctx, cfg.dtype, ops, device) if dense else None
    norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.dtype, ops, device)
    sparse = any(cfg.layer_is_moe(i) for i in range(cfg.num_layers))
    router = torch.empty(cfg.num_experts, cfg.hidden_size, dtype=cfg.dtype, device=device) if sparse else None
    return decode_projection_warm_up_calls(qkv, o_proj, mlp, norm, ctx.tp_size, ops, router_weight=router)


def run_projection_warm_up(calls: list[Callable[[], Any]], device: torch.device, threads: int | None = None) -> int:
    """Run projection warm-up calls (`decode_projection_warm_up_calls`) side by side on `threads` threads (None:
    `compile_threads()`), after creating the GEMM kernels' per-device cache entries on this thread; returns the
    number of launches."""
    if calls:
        from modeling.ops import triton_gemm, triton_gemv

        prime_kernel_caches([triton_gemv, triton_gemm], device)
        run_side_by_side(calls, threads)
    return len(calls)
