"""Tensor-parallel layers: column, row, merged-column, QKV, vocab-parallel embedding and LM head.

Each parameter carries a `weight_loader(param, full_tensor, shard_id=None)` that
copies this rank's slice of the full (unsharded) HF tensor into it, and raises
`WeightShapeError` when the full tensor has the wrong shape. `full_tensor` may be a lazy
checkpoint tensor (`.shape` plus basic indexing, e.g. `modeling.checkpoint_files.CheckpointTensor`):
the loaders only read `.shape` and index out their slice, so only that slice is read. Collectives go through
`parallel.comm` (capturable on NCCL). Weights are `[out, in]` like `nn.Linear`.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from parallel import comm
from parallel.context import ParallelContext


class WeightShapeError(ValueError):
    """A checkpoint tensor does not have the shape the layer expects."""


def _check(name: str, got: torch.Size, want: tuple[int, ...]) -> None:
    if tuple(got) != tuple(want):
        raise WeightShapeError(f"{name}: checkpoint shape {tuple(got)} != expected {tuple(want)}")


def _divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what}={n} is not divisible by tensor-parallel size {d}")
    return n // d


class ColumnParallelLinear(nn.Module):
    """y = x W^T with W split along the output dim; output stays sharded. x: `[T, in]` -> `[T, out/tp]`."""

    gemm = staticmethod(F.linear)  # the model may install a faster `(x, w) -> x @ w.T` (e.g. a skinny decode GEMM)

    def __init__(self, in_features: int, out_features: int, ctx: ParallelContext, dtype: torch.dtype, device=None):
        super().__init__()
        self.ctx = ctx
        self.in_features, self.out_features = in_features, out_features
        self.out_per_rank = _divide(out_features, ctx.tp_size, "output features")
        self.weight = nn.Parameter(torch.empty(self.out_per_rank, in_features, dtype=dtype, device=device), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor, shard_id=None) -> None:
        _check("column-parallel weight", full.shape, (self.out_features, self.in_features))
        r = self.ctx.tp_rank
        param.data.copy_(full[r * self.out_per_rank : (r + 1) * self.out_per_rank])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gemm(x, self.weight)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input fused into one GEMM (e.g. gate+up).

    Output: `[T, sum(sizes)/tp]`, each part sharded separately so rank r holds part_i[r].
    """

    def __init__(self, in_features: int, sizes: Sequence[int], ctx: ParallelContext, dtype: torch.dtype, device=None):
        self.sizes = list(sizes)
        self.parts_per_rank = [_divide(s, ctx.tp_size, "merged part") for s in self.sizes]
        super().__init__(in_features, sum(self.sizes), ctx, dtype, device)

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor, shard_id=None) -> None:
        if shard_id is None:
            raise WeightShapeError("merged linear needs a shard id")
        _check(f"merged part {shard_id}", full.shape, (self.sizes[shard_id], self.in_features))
        n = self.parts_per_rank[shard_id]
        off = sum(self.parts_per_rank[:shard_id])
        r = self.ctx.tp_rank
        param.data[off : off + n].copy_(full[r * n : (r + 1) * n])


class QKVParallelLinear(MergedColumnParallelLinear):
    """Fused q/k/v projection split by heads. KV heads are replicated when tp > kv heads."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, ctx: ParallelContext, dtype, device=None):
        self.head_dim = head_dim
        self.num_heads_local = _divide(num_heads, ctx.tp_size, "attention heads")
        if num_kv_heads >= ctx.tp_size:
            self.num_kv_heads_local = _divide(num_kv_heads, ctx.tp_size, "kv heads")
            self.kv_replicas = 1
        else:
            self.num_kv_heads_local = 1
            self.kv_replicas = _divide(ctx.tp_size, num_kv_heads, "tp size over kv heads")
        self.full_sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        local = [self.num_heads_local * head_dim, self.num_kv_heads_local * head_dim, self.num_kv_heads_local * head_dim]
        nn.Module.__init__(self)
        self.ctx = ctx
        self.in_features, self.out_features = hidden, sum(local)
        self.local_sizes = local
        self.weight = nn.Parameter(torch.empty(sum(local), hidden, dtype=dtype, device=device), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor, shard_id=None) -> None:
        idx = {"q": 0, "k": 1, "v": 2}[shard_id]
        _check(f"{shard_id}_proj", full.shape, (self.full_sizes[idx], self.in_features))
        n = self.local_sizes[idx]
        off = sum(self.local_sizes[:idx])
        r = self.ctx.tp_rank if idx == 0 else self.ctx.tp_rank // self.kv_replicas
        param.data[off : off + n].copy_(full[r * n : (r + 1) * n])


class RowParallelLinear(nn.Module):
    """y = x W^T with W split along the input dim, then summed over the TP group. x: `[T, in/tp]` -> `[T, out]`."""

    gemm = staticmethod(F.linear)

    def __init__(self, in_features: int, out_features: int, ctx: ParallelContext, dtype: torch.dtype, device=None,
                 reduce_results: bool = True):
        super().__init__()
        self.ctx = ctx
        self.in_features, self.out_features = in_features, out_features
        self.in_per_rank = _divide(in_features, ctx.tp_size, "input features")
        self.reduce_results = reduce_results
        self.weight = nn.Parameter(torch.empty(out_features, self.in_per_rank, dtype=dtype, device=device), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor, shard_id=None) -> None:
        _check("row-parallel weight", full.shape, (self.out_features, self.in_features))
        r = self.ctx.tp_rank
        param.data.copy_(full[:, r * self.in_per_rank : (r + 1) * self.in_per_rank])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_with(self.gemm, x)

    def forward_with(self, gemm, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        """`forward` with another `(x, w) -> y [T, out]` product, e.g. one that applies an activation to x first.
        `reduce=False`: this rank's partial product (the caller reduces it, e.g. fused with a norm)."""
        y = gemm(x, self.weight)
        return comm.all_reduce(y, self.ctx.tp_group) if reduce and self.reduce_results else y


class VocabParallelEmbedding(nn.Module):
    """Embedding with the vocabulary split over TP ranks; ids outside this rank's range contribute zero.

    input_ids: int64 `[T]` -> `[T, hidden]`. Ids must already be validated (< vocab).
    """

    def __init__(self, vocab: int, hidden: int, ctx: ParallelContext, dtype: torch.dtype, device=None):
        super().__init__()
        self.ctx = ctx
        self.vocab, self.hidden = vocab, hidden
        self.vocab_per_rank = -(-vocab // ctx.tp_size)
        self.start = ctx.tp_rank * self.vocab_per_rank
        self.weight = nn.Parameter(torch.zeros(self.vocab_per_rank, hidden, dtype=dtype, device=device), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, full: torch.Tensor, shard_id=None) -> None:
        _check("vocab-parallel weight", full.shape, (self.vocab, self.hidden))
        part = full[self.start : self.start + self.vocab_per_rank]
        param.data.zero_()
        param.data[: part.shape[0]].copy_(part)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.ctx.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        mask = (local < 0) | (local >= self.vocab_per_rank)
        out = F.embedding(local.masked_fill(mask, 0), self.weight)
        out = out.masked_fill(mask.unsqueeze(-1), 0)
        return comm.all_reduce(out, self.ctx.tp_group)


class ParallelLMHead(VocabParallelEmbedding):
    """LM head with the vocabulary split over TP ranks: hidden `[B, H]` -> fp32 logits `[B, vocab]`."""

    gemm = staticmethod(F.linear)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        local = self.gemm(hidden, self.weight)
        if self.ctx.tp_size > 1:
            local = comm.all_gather(local.contiguous(), self.ctx.tp_group, dim=-1)
        return local[..., : self.vocab].float()

    @property
    def shard_width(self) -> int:
        """Columns of this rank's logits shard that are real tokens (the last shard may be narrower)."""
        return max(0, min(self.vocab_per_rank, self.vocab - self.start))

    def shard_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 `[B, shard_width]`: this rank's vocabulary shard of `logits(hidden)` (global ids
        [start, start + shard_width)), with no collective; the whole row without TP."""
        local = self.gemm(hidden, self.weight)
        return local[..., : self.shard_width].float()

    def greedy(self, hidden: torch.Tensor) -> torch.Tensor:
        """int64 `[B]`: the argmax of `logits(hidden)` (first index on ties) without forming them: each rank takes
        the argmax of its vocabulary shard in the GEMM's dtype, and the ranks exchange one (value, index) pair
        per row instead of their `[B, vocab / tp]` logits. Capturable on NCCL."""
        local = self.gemm(hidden, self.weight)
        valid = min(self.vocab_per_rank, self.vocab - self.start)
        if valid < local.shape[-1]:
            local = local[..., :valid]
        idx = local.argmax(dim=-1)
        if self.ctx.tp_size == 1:
            return idx
        val = local.gather(-1, idx.unsqueeze(-1)).squeeze(-1).float()
        # one exchange: values and shard-global indices as fp32 rows (indices below 2^24 are exact)
        pair = torch.stack([val, (idx + self.start).float()]).unsqueeze(0)  # [1, 2, B]
        both = comm.all_gather(pair.contiguous(), self.ctx.tp_group, dim=0)  # [tp, 2, B]
        return pick_global_argmax(both[:, 0], both[:, 1])


def pick_global_argmax(values: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """values / indices fp32 `[tp, B]`: each vocabulary shard's max and its global index (shards in rank order,
    so lower rank = lower indices) -> int64 `[B]` the index of the overall max, the lowest one on ties (what
    `argmax` over the whole row returns)."""
    best = values.argmax(dim=0, keepdim=True)  # first max: the lowest rank on ties
    return indices.gather(0, best).squeeze(0).long()


def tie_weights(head: ParallelLMHead, embedding: VocabParallelEmbedding, tied: bool) -> Optional[ParallelLMHead]:
    """Share the embedding matrix with the LM head when the model ties them."""
    if tied:
        head.weight = embedding.weight
    return head
