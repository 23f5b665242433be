"""Token sampling: greedy, or temperature / top-k / top-p with a per-request seed.

Seeded sampling is the Gumbel-max trick with noise drawn from a generator keyed by
(seed, position of the token being sampled), so a sequence samples the same tokens
whatever batch it runs in, and again after a preemption and recompute.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch


class SamplingParamsError(ValueError):
    """Sampling parameters out of range."""


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 = greedy. top_k 0 = off. top_p 1.0 = off. seed None = nondeterministic."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: Optional[int] = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise SamplingParamsError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise SamplingParamsError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingParamsError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _mask_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set logits outside the top-k / nucleus to -inf. logits fp32 `[V]`."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        drop = torch.cumsum(probs, dim=-1) - probs > top_p  # keep the token that crosses p
        logits = logits.clone()
        logits[order[drop]] = float("-inf")
    return logits


def sample(logits: torch.Tensor, params: Sequence[SamplingParams], positions: Sequence[int]) -> torch.Tensor:
    """logits fp32 `[B, V]`; params and positions (index of the token being sampled) per row -> int64 `[B]`."""
    out = torch.argmax(logits, dim=-1)
    for i, p in enumerate(params):
        if p.greedy:
            continue
        row = _mask_top_k_top_p(logits[i] / p.temperature, p.top_k, p.top_p)
        g = torch.Generator(device=logits.device)
        if p.seed is None:
            g.seed()
        else:
            g.manual_seed((p.seed * 1_000_003 + positions[i]) & ((1 << 63) - 1))
        u = torch.rand(row.shape, generator=g, device=logits.device).clamp_(1e-20, 1.0)
        out[i] = torch.argmax(row - torch.log(-torch.log(u)))
    return out
