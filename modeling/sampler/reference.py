"""The torch path of the sampler (CPU logits; it also runs on CUDA tensors): the specification the Triton
kernels match bitwise for tokens. Whole-row tensor ops per vocabulary shard, the same collectives as the
kernels' launcher. Exact selection without sorting: radix select over int64 histograms built
with scatter_add (integer sums: deterministic on every device)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from . import numerics as nx
from .collectives import ShardGroup
from .host import SamplerVariant
from .params import SamplerParams

# (shift, width) of the radix digits, most significant first. The kernels use 11 / 11 / 10 bits; the threshold
# found does not depend on the digit layout, and 4-bit digits keep the torch path's histograms [B, 16].
LEVELS = tuple((28 - 4 * i, 4) for i in range(8))


@dataclass
class SampleOutput:
    """tokens int64 `[B]`; chosen_logprob fp32 `[B]` (raw log_softmax of the chosen token); top_ids int64
    `[B, N]` and top_logprobs fp32 `[B, N]` (the N most probable tokens of the raw logits, descending, lower
    id first on ties). On the logits' device; under TP identical on every rank."""

    tokens: torch.Tensor
    chosen_logprob: torch.Tensor
    top_ids: torch.Tensor
    top_logprobs: torch.Tensor


def _local(ids: torch.Tensor, voff: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    loc = ids.to(torch.int64) - voff
    ok = (ids >= 0) & (loc >= 0) & (loc < width)
    return torch.where(ok, loc, torch.full_like(loc, width)), ok


def allowed_columns(bits: torch.Tensor, voff: int, v: int) -> torch.Tensor:
    """bits int32 `[B, W]` (an allow mask: bit (j & 31) of word j >> 5 for global id j) -> bool `[B, v]`: whether
    columns [0, v) of a shard starting at global id `voff` may be drawn."""
    gid = torch.arange(voff, voff + v, dtype=torch.int64, device=bits.device)
    words = bits.index_select(1, gid >> 5)
    return ((words >> (gid & 31).to(torch.int32)) & 1) != 0


def processed_logits(raw: torch.Tensor, p: SamplerParams, voff: int) -> torch.Tensor:
    """raw fp32 `[B, V]` -> new fp32 `[B, V]`: -inf off the allow mask (when the step has one), + logit bias, banned
    ids -> -inf, then repetition (x > 0: x * (1/r), else x * r), frequency (x - f * count) and presence
    (x - p * (count > 0)) on the listed ids."""
    b, v = raw.shape
    if p.masked:
        raw = raw.masked_fill(~allowed_columns(p.allow_bits[:b], voff, v), float("-inf"))
    w = torch.cat([raw, raw.new_zeros(b, 1)], dim=1)  # column v: where unused / off-shard entries land
    loc, ok = _local(p.bias_ids[:b], voff, v)
    w.scatter_add_(1, loc, torch.where(ok, p.bias_vals[:b], torch.zeros_like(p.bias_vals[:b])))
    loc, _ = _local(p.ban_ids[:b], voff, v)
    w.scatter_(1, loc, float("-inf"))
    loc, ok = _local(p.pen_ids[:b], voff, v)
    x = w.gather(1, loc)
    cnt = p.pen_counts[:b]
    x = torch.where(x > 0, x * p.inv_repetition[:b, None], x * p.repetition[:b, None])
    x = x - p.frequency[:b, None] * cnt.to(torch.float32)
    x = x - p.presence[:b, None] * (cnt > 0).to(torch.float32)
    w.scatter_(1, loc, torch.where(ok, x, w.gather(1, loc)))
    return w[:, :v]


def radix_select(keys: torch.Tensor, weights: Optional[torch.Tensor], need: torch.Tensor, active: torch.Tensor,
                 group: ShardGroup) -> torch.Tensor:
    """keys int64 `[B, V]` in [0, 2^32); weights int64 `[B, V]` (None = 1 each); need int64 `[B]` >= 1 on active
    rows -> int64 `[B]`: the largest t with sum(weight[key >= t]) >= need over all shards (0 on inactive rows)."""
    b = keys.shape[0]
    prefix = torch.zeros(b, dtype=torch.int64, device=keys.device)
    need = torch.where(active, need, torch.ones_like(need))
    w_all = torch.ones_like(keys) if weights is None else weights
    for shift, width in LEVELS:
        nb = 1 << width
        digit = (keys >> shift) & (nb - 1)
        inb = ((keys >> (shift + width)) == prefix.unsqueeze(1)) & active.unsqueeze(1)
        hist = torch.zeros(b, nb, dtype=torch.int64, device=keys.device)
        hist.scatter_add_(1, digit, torch.where(inb, w_all, torch.zeros_like(w_all)))
        group.sum_(hist)
        suf = hist.flip(1).cumsum(1).flip(1)
        d = ((suf >= need.unsqueeze(1)).sum(1) - 1).clamp(min=0)
        need = need - (suf.gather(1, d[:, None]) - hist.gather(1, d[:, None])).squeeze(1)
        prefix = (prefix << width) | d
    return torch.where(active, prefix, torch.zeros_like(prefix))


def sample_torch(logits: torch.Tensor, p: SamplerParams, variant: SamplerVariant, num_logprobs: int,
                 vocab_offset: int, group: ShardGroup) -> SampleOutput:
    """See `modeling.sampler.sample`; rows use only the stages `variant` enables."""
    b, v = logits.shape
    dev = logits.device
    raw = logits.float()
    x = processed_logits(raw, p, vocab_offset) if variant.processed else raw
    greedy = p.temperature[:b] == 0
    z = x * p.inv_temperature[:b, None]

    raw_max = raw.amax(1)
    safe = torch.where(torch.isinf(raw_max), torch.zeros_like(raw_max), raw_max)
    stats = group.gather(torch.stack([raw_max, torch.exp(raw - safe[:, None]).sum(1), safe, z.amax(1)], 1))
    big = stats[:, :, 0].amax(0)
    lse = big + torch.log((stats[:, :, 1] * torch.exp(stats[:, :, 2] - big)).sum(0))
    m = stats[:, :, 3].amax(0)

    keys = nx.ordered_key(z)
    key_lo = torch.full((b,), nx.KEY_NEG_INF + 1, dtype=torch.int64, device=dev)
    sampled = ~greedy
    if variant.top_k:
        on = sampled & (p.top_k[:b] > 0)
        key_k = radix_select(keys, None, p.top_k[:b].to(torch.int64), on, group)
        key_lo = torch.where(on, torch.maximum(key_lo, key_k), key_lo)
    minp_on = sampled & (p.log_min_p[:b] > float("-inf"))
    key_m = nx.ordered_key(m + p.log_min_p[:b])
    key_lo = torch.where(minp_on, torch.maximum(key_lo, key_m), key_lo)
    allowed = keys >= key_lo.unsqueeze(1)
    if variant.top_p:
        on = sampled & (p.top_p_fixed[:b] > 0)
        q = nx.mass(z, m, allowed)
        total = group.sum_(q.sum(1))
        target = nx.top_p_target(total, p.top_p_fixed[:b])
        key_p = radix_select(keys, q, target, on & (total > 0), group)
        allowed = allowed & (keys >= key_p.unsqueeze(1))

    gid = torch.arange(vocab_offset, vocab_offset + v, dtype=torch.int64, device=dev).unsqueeze(0)
    noise = nx.gumbel(p.seed[:b], p.position[:b], vocab_offset, v)
    score = torch.where(greedy.unsqueeze(1), z, z + noise)
    packed = torch.where(allowed, nx.pack(score, gid), torch.full_like(gid, nx.SENTINEL))
    best = packed.amax(1)
    loc = (nx.unpack_id(best) - vocab_offset).clamp(0, v - 1)
    raw_at = raw.gather(1, loc[:, None]).squeeze(1)
    cand = group.gather(torch.stack([best, raw_at.view(torch.int32).to(torch.int64)], 1))  # [tp, B, 2]
    win = cand[:, :, 0].argmax(0, keepdim=True)
    best = cand[:, :, 0].gather(0, win).squeeze(0)
    chosen_raw = cand[:, :, 1].gather(0, win).squeeze(0).to(torch.int32).view(torch.float32)
    tokens = torch.where(best == nx.SENTINEL, torch.zeros_like(best), nx.unpack_id(best))

    n = num_logprobs
    if n:
        if n > v:
            raise ValueError(f"num_logprobs {n} exceeds the shard width {v}")
        local = nx.pack(raw, gid).topk(n, dim=1).values
        allc = group.gather(local).permute(1, 0, 2).reshape(b, -1)
        top = allc.topk(n, dim=1).values
        top_ids, top_lp = nx.unpack_id(top), nx.unpack_value(top) - lse.unsqueeze(1)
    else:
        top_ids = torch.zeros((b, 0), dtype=torch.int64, device=dev)
        top_lp = torch.zeros((b, 0), dtype=torch.float32, device=dev)
    return SampleOutput(tokens, chosen_raw - lse, top_ids, top_lp)
