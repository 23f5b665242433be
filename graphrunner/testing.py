"""A tiny real decoder implementing the runner's model contract, for the runner's own tests.

Not used by the runner (which is model-blind). It exercises every boundary policy:
attention + KV store (PADDED_TOKENS), routing (EAGER_ONLY), experts (BRIDGE with
`reuse_bridge_after_next_step`), a combine that returns a view into a module-owned
buffer (PADDED_VIEW). All operators are vectorized without host syncs, so the same
code is captured whole inside full decode graphs. Runs on CPU and CUDA.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .boundary import OutputPolicy, eager_boundary
from .step import ForwardStep, GraphMeta


@dataclass
class ToyAttnMetadata:
    """Per-step metadata. token_seq/token_pos: each flat token's sequence row and absolute position."""

    is_decoding: bool
    q_seqlens: torch.Tensor
    kv_seqlens: torch.Tensor
    q_start_loc: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    token_seq: torch.Tensor
    token_pos: torch.Tensor
    max_q_seqlen: int
    block_size: int

    @property
    def batch_size(self) -> int:
        return int(self.q_seqlens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])


def _store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """Write rows with slot >= 0; rows with slot -1 rewrite slot 0 (reserved padding block) with its own value."""
    n = slots.shape[0]
    valid = (slots >= 0)[:, None, None]
    idx = torch.where(slots >= 0, slots, torch.zeros_like(slots))
    for src, cache in ((k[:n], k_cache), (v[:n], v_cache)):
        flat = cache.view(-1, *cache.shape[2:])
        flat.index_copy_(0, idx, torch.where(valid, src.to(cache.dtype), flat.index_select(0, idx)))


def toy_attention(q, k, v, kv_caches, layer_idx: int, attn_metadata: ToyAttnMetadata, scale: float) -> torch.Tensor:
    """q `[T, Hq, D]`, k/v `[T, Hkv, D]` (T >= real tokens n) -> `[n, Hq, D]`; stores the real tokens' K/V."""
    meta = attn_metadata
    n = meta.num_tokens
    k_cache, v_cache = kv_caches[layer_idx]
    _store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    q = q[:n].float()
    tables = meta.block_tables.index_select(0, meta.token_seq).long()  # [n, W]
    bs, hkv, d = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    length = tables.shape[1] * bs
    keys = k_cache[tables].reshape(n, length, hkv, d).float()
    vals = v_cache[tables].reshape(n, length, hkv, d).float()
    group = q.shape[1] // hkv
    keys = keys.repeat_interleave(group, dim=2)
    vals = vals.repeat_interleave(group, dim=2)
    kpos = torch.arange(length, device=q.device)
    kvlen = meta.kv_seqlens.index_select(0, meta.token_seq).long()
    mask = (kpos[None, :] <= meta.token_pos[:, None]) & (kpos[None, :] < kvlen[:, None])  # [n, L]
    scores = torch.einsum("nhd,nlhd->nhl", q, keys) * scale
    scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
    out = torch.einsum("nhl,nlhd->nhd", torch.softmax(scores, dim=-1), vals)
    return out.to(k.dtype)


toy_attention_boundary = eager_boundary(output=OutputPolicy.PADDED_TOKENS, token_axis=0)(toy_attention)


@eager_boundary(output=OutputPolicy.EAGER_ONLY)
def toy_route(router_logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights fp32 `[T, k]`, expert ids `[T, k]`) — consumed only by the experts boundary."""
    weights, ids = torch.topk(torch.softmax(router_logits.float(), dim=-1), top_k, dim=-1)
    return weights / weights.sum(dim=-1, keepdim=True), ids


class ToyExperts(nn.Module):
    def __init__(self, hidden: int, inter: int, experts: int, gen: torch.Generator, dtype, device):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(experts, inter, hidden, generator=gen).to(device, dtype) * hidden**-0.5,
                               requires_grad=False)
        self.w2 = nn.Parameter(torch.randn(experts, hidden, inter, generator=gen).to(device, dtype) * inter**-0.5,
                               requires_grad=False)
        self.fail_with: Optional[BaseException] = None  # tests inject a failure here
        self.fail_after_calls = 0  # calls of `run` that still succeed before `fail_with` is raised

    @eager_boundary(reuse_bridge_after_next_step=True)
    def run(self, hidden: torch.Tensor, routing: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Every expert on every token, combined by dense routing weights (static shapes, no host sync)."""
        if self.fail_with is not None:
            if self.fail_after_calls > 0:
                self.fail_after_calls -= 1
            else:
                raise self.fail_with
        weights, ids = routing
        dense = torch.zeros(hidden.shape[0], self.w1.shape[0], dtype=torch.float32, device=hidden.device)
        dense.scatter_(1, ids, weights)
        h = F.silu(torch.einsum("th,eih->eti", hidden, self.w1))
        y = torch.einsum("eti,ehi->eth", h, self.w2)
        return torch.einsum("eth,te->th", y.float(), dense).to(hidden.dtype)


class ToyCombine(nn.Module):
    """Copies into a module-owned buffer and returns a view of its real rows (like a DeepEP combine buffer)."""

    def __init__(self, hidden: int, max_tokens: int, dtype, device):
        super().__init__()
        self.register_buffer("combine_buffer", torch.zeros(max_tokens, hidden, dtype=dtype, device=device), persistent=False)

    @eager_boundary(output=OutputPolicy.PADDED_VIEW, token_axis=0)
    def run(self, y: torch.Tensor, attn_metadata: ToyAttnMetadata) -> torch.Tensor:
        n = attn_metadata.num_tokens
        self.combine_buffer[: y.shape[0]].copy_(y)
        return self.combine_buffer[:n]


class ToyLayer(nn.Module):
    def __init__(self, cfg: dict, gen: torch.Generator, dtype, device):
        super().__init__()
        h, hq, hkv, d = cfg["hidden"], cfg["heads"], cfg["kv_heads"], cfg["head_dim"]

        def lin(i, o):
            layer = nn.Linear(i, o, bias=False, device=device, dtype=dtype)
            layer.weight.data.copy_(torch.randn(o, i, generator=gen) * i**-0.5)
            layer.weight.requires_grad_(False)
            return layer

        self.qkv = lin(h, (hq + 2 * hkv) * d)
        self.o = lin(hq * d, h)
        self.router = lin(h, cfg["experts"])
        self.experts = ToyExperts(h, 2 * h, cfg["experts"], gen, dtype, device)
        self.combine = ToyCombine(h, cfg["max_tokens"], dtype, device)
        self.gate_scale = nn.Parameter(torch.ones(h, dtype=dtype, device=device) * 0.5, requires_grad=False)


def _rms(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype)


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    return x if x.shape[0] == rows else F.pad(x, (0, 0) * (x.dim() - 1) + (0, rows - x.shape[0]))


class ToyDecoder(nn.Module):
    """embed + positions -> layers of (attention boundary, router, routing/experts/combine boundaries) -> norm."""

    def __init__(self, vocab: int = 96, hidden: int = 32, heads: int = 4, kv_heads: int = 2, head_dim: int = 8,
                 layers: int = 2, experts: int = 4, top_k: int = 2, max_tokens: int = 4096, max_positions: int = 8192,
                 dtype: torch.dtype = torch.float32, device: Any = "cpu", seed: int = 0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.cfg = dict(hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=head_dim, experts=experts,
                        max_tokens=max_tokens)
        self.top_k = top_k
        self.max_positions = max_positions
        self.scale = head_dim**-0.5
        self.embed = nn.Parameter((torch.randn(vocab, hidden, generator=gen)).to(device, dtype), requires_grad=False)
        self.pos = nn.Parameter((torch.randn(max_positions, hidden, generator=gen) * 0.1).to(device, dtype),
                                requires_grad=False)
        self.layers = nn.ModuleList(ToyLayer(self.cfg, gen, dtype, device) for _ in range(layers))
        self.pcg_enabled = False
        self.dtype = dtype
        self._failure: Optional[tuple[int, Optional[BaseException], bool]] = None

    def inject_forward_failure(self, call: int, error: Optional[BaseException] = None, sync: bool = False) -> None:
        """Make the `call`-th next forward (1 = the next one) fail after its first layer: raise `error`, or
        with `sync=True` call torch.cuda.synchronize() (illegal during capture; invalidates it)."""
        self._failure = (call, error, sync)

    def _maybe_fail(self) -> None:
        if self._failure is None:
            return
        call, error, sync = self._failure
        if call > 1:
            self._failure = (call - 1, error, sync)
            return
        self._failure = None
        if sync:
            torch.cuda.synchronize()
        if error is not None:
            raise error

    # ---- forward (standard decoder contract)
    def forward(self, input_ids, position_ids, kv_caches, attn_metadata, **constants) -> torch.Tensor:
        c = self.cfg
        t = input_ids.shape[0]
        x = self.embed[input_ids] + self.pos[position_ids % self.max_positions]
        for i, layer in enumerate(self.layers):
            q, k, v = layer.qkv(_rms(x)).split([c["heads"] * c["head_dim"], c["kv_heads"] * c["head_dim"],
                                                c["kv_heads"] * c["head_dim"]], dim=-1)
            a = toy_attention_boundary(q.view(t, c["heads"], c["head_dim"]), k.view(t, c["kv_heads"], c["head_dim"]),
                                       v.view(t, c["kv_heads"], c["head_dim"]), kv_caches, i, attn_metadata, self.scale)
            x = x + layer.o(_pad_rows(a, t).reshape(t, -1))
            h = _rms(x)
            routing = toy_route(layer.router(h), self.top_k)
            y = layer.experts.run(h, routing) * layer.gate_scale
            x = x + _pad_rows(layer.combine.run(y, attn_metadata), t)
            if i == 0:
                self._maybe_fail()
        return _rms(x) * constants.get("output_scale", 1.0)

    # ---- full decode graph buffer contract
    def supports_cuda_graph(self, step: ForwardStep) -> bool:
        return bool(step.is_decoding)

    def graph_extra_key(self, step: ForwardStep) -> tuple:
        return ()

    def make_buffers(self, meta: GraphMeta, staging: Any = None) -> dict[str, torch.Tensor]:
        # the toy declares no `decode_staging`: the runner passes None and the toy fills device buffers itself
        dev, b, w = meta.device, meta.max_batch_size, meta.max_blocks_per_seq
        return {
            "input_ids": torch.zeros(b, dtype=torch.int64, device=dev),
            "position_ids": torch.zeros(b, dtype=torch.int64, device=dev),
            "slot_mapping": torch.full((b,), -1, dtype=torch.int64, device=dev),
            "q_seqlens": torch.ones(b, dtype=torch.int32, device=dev),
            "kv_seqlens": torch.ones(b, dtype=torch.int32, device=dev),
            "q_start_loc": torch.arange(b, dtype=torch.int32, device=dev),
            "block_tables": torch.zeros(b, w, dtype=torch.int32, device=dev),
            "token_seq": torch.arange(b, dtype=torch.int64, device=dev),
            "token_pos": torch.zeros(b, dtype=torch.int64, device=dev),
        }

    def fill_buffers(self, buffers: dict[str, torch.Tensor], step: ForwardStep, padded_batch: int) -> None:
        meta: ToyAttnMetadata = step.attn_metadata
        n, width = step.batch_size, meta.block_tables.shape[1]
        for name, src in (("input_ids", step.input_ids), ("position_ids", step.position_ids),
                          ("slot_mapping", meta.slot_mapping), ("kv_seqlens", meta.kv_seqlens),
                          ("token_pos", meta.token_pos)):
            buffers[name][:n].copy_(src)
        buffers["block_tables"][:n, :width].copy_(meta.block_tables)
        buffers["block_tables"][:n, width:].zero_()
        if padded_batch > n:
            for name, value in (("input_ids", 0), ("position_ids", 0), ("slot_mapping", -1), ("kv_seqlens", 1),
                                ("token_pos", 0), ("block_tables", 0)):
                buffers[name][n:padded_batch].fill_(value)

    def update_context(self, buffers: dict[str, torch.Tensor], step: ForwardStep, padded_batch: int) -> ForwardStep:
        p = padded_batch
        meta = ToyAttnMetadata(
            is_decoding=True, q_seqlens=buffers["q_seqlens"][:p], kv_seqlens=buffers["kv_seqlens"][:p],
            q_start_loc=buffers["q_start_loc"][:p], block_tables=buffers["block_tables"][:p],
            slot_mapping=buffers["slot_mapping"][:p], token_seq=buffers["token_seq"][:p],
            token_pos=buffers["token_pos"][:p], max_q_seqlen=1, block_size=step.attn_metadata.block_size,
        )
        return dataclasses.replace(step, input_ids=buffers["input_ids"][:p], position_ids=buffers["position_ids"][:p],
                                   attn_metadata=meta)

    def get_outputs(self, output: torch.Tensor, num_tokens: int) -> torch.Tensor:
        return output[:num_tokens]

    # ---- piecewise opt-in (the toy's operators are always decorated; they are transparent outside builds)
    def supports_piecewise_cuda_graph(self) -> bool:
        return True

    def enable_piecewise_cuda_graph(self) -> bool:
        self.pcg_enabled = True
        return True


# ---------------------------------------------------------------------------------------------
# steps


def toy_kv_caches(model: ToyDecoder, num_blocks: int, block_size: int, device: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (num_blocks, block_size, model.cfg["kv_heads"], model.cfg["head_dim"])
    return [(torch.zeros(shape, dtype=model.dtype, device=device), torch.zeros(shape, dtype=model.dtype, device=device))
            for _ in model.layers]


def toy_step(seqs: Sequence[tuple[Sequence[int], int, Sequence[int]]], kv_caches: Any, block_size: int, width: int,
             device: Any, slots: bool = True, **step_fields: Any) -> ForwardStep:
    """seqs: (new tokens, num_history, block table). slots=False -> every slot -1 (a harmless dummy)."""
    ids, pos, tseq, slot_map, qlens, kvlens, starts = [], [], [], [], [], [], []
    tables = torch.zeros(len(seqs), width, dtype=torch.int32)
    for i, (tokens, hist, table) in enumerate(seqs):
        starts.append(len(ids))
        tables[i, : len(table)] = torch.tensor(list(table), dtype=torch.int32)
        for j, tok in enumerate(tokens):
            p = hist + j
            ids.append(int(tok))
            pos.append(p)
            tseq.append(i)
            slot_map.append(int(table[p // block_size]) * block_size + p % block_size if slots else -1)
        qlens.append(len(tokens))
        kvlens.append(hist + len(tokens))
    dev = torch.device(device)
    meta = ToyAttnMetadata(
        is_decoding=all(q == 1 for q in qlens),
        q_seqlens=torch.tensor(qlens, dtype=torch.int32, device=dev),
        kv_seqlens=torch.tensor(kvlens, dtype=torch.int32, device=dev),
        q_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
        block_tables=tables.to(dev),
        slot_mapping=torch.tensor(slot_map, dtype=torch.int64, device=dev),
        token_seq=torch.tensor(tseq, dtype=torch.int64, device=dev),
        token_pos=torch.tensor(pos, dtype=torch.int64, device=dev),
        max_q_seqlen=max(qlens),
        block_size=block_size,
    )
    return ForwardStep(torch.tensor(ids, dtype=torch.int64, device=dev), torch.tensor(pos, dtype=torch.int64, device=dev),
                       kv_caches, meta, **step_fields)


def toy_dummy_factory(kv_caches: Any, block_size: int, width: int, device: Any, created: Optional[list] = None):
    """A `dummy_step_factory`: `batch_size` sequences sharing `num_tokens`, all slots -1, tables at block 0.

    `created`, when given, receives every dummy step built (tests take weakrefs).
    """

    def factory(num_tokens: int, batch_size: int, is_decoding: bool) -> ForwardStep:
        base, extra = divmod(num_tokens, batch_size)
        lens = [base + (1 if i < extra else 0) for i in range(batch_size)]
        seqs = [([0] * n, 0, [0]) for n in lens]
        step = toy_step(seqs, kv_caches, block_size, width, device, slots=False)
        step.attn_metadata.is_decoding = is_decoding
        if created is not None:
            created.append(step)
        return step

    return factory


# ---------------------------------------------------------------------------------------------
# references


def bucket_shaped_eager(model: Any, step: ForwardStep, bucket: int) -> torch.Tensor:
    """What a piecewise plan must equal exactly: the plain forward on graph inputs zero-padded to `bucket`
    (live frame inputs), sliced to the real tokens."""
    n = step.num_tokens
    ids = torch.zeros(bucket, dtype=step.input_ids.dtype, device=step.input_ids.device)
    pos = torch.zeros(bucket, dtype=step.position_ids.dtype, device=step.position_ids.device)
    ids[:n] = step.input_ids
    pos[:n] = step.position_ids
    out = model(ids, pos, step.kv_caches, step.attn_metadata, **dict(step.extras))
    return model.get_outputs(out, n)


def decode_bucket_eager(model: Any, step: ForwardStep, bucket: int, graph_meta: GraphMeta) -> torch.Tensor:
    """What a full decode graph must equal exactly: the forward on the model's own padded buffers."""
    from .forward_args import model_kwargs
    from .staging import staging_for

    buffers = model.make_buffers(graph_meta, staging_for(model, graph_meta))
    model.fill_buffers(buffers, step, bucket)
    ctx = model.update_context(buffers, step, bucket)
    return model.get_outputs(model(**model_kwargs(ctx)), step.num_tokens)


class NoopPiece:
    """Stands in for torch.cuda.CUDAGraph when a piecewise plan is built on CPU (`graph_factory=NoopPiece`): the
    "captured" code already ran eagerly during the build, so capture and replay do nothing."""

    def capture_begin(self, pool=None, capture_error_mode="global"):
        pass

    def capture_end(self):
        pass

    def replay(self):
        pass
