"""EP token dispatchers: move routed tokens to the ranks that own their experts, and back.

Interface (used by `modeling.moe.SparseMoeBlock`):
    dispatch(hidden [T, H], ids [T, k] int64 (global expert ids), weights [T, k] fp32)
        -> (hidden_all [N, H], ids_all [N, k'], weights_all [N, k'], handle)
    combine(out_all [N, H], handle) -> out [T, H]   (sum over every expert of this rank's tokens)
    packed_counts(handle) -> None, or int [E_local] on the device when the rows are packed per local expert
        (`[E_local * cap, H]`, expert e's rows first in its block of cap; DeepEP low latency): the expert kernel
        may then skip the grouping, and rows past a count are never combined.
Invalid routing entries carry id -1 and weight 0 (the expert kernels skip them).

`AllGatherDispatcher` (the default, and what CI runs on gloo) has three layouts, chosen
once from the topology:
- replicated (dp == 1, so ep == tp == world): every EP rank already holds the same tokens.
  No gather; local experts on all tokens; combine = all-reduce over the EP group.
- gather (tp == 1): every EP rank has its own tokens. All-gather tokens + routing over the
  EP group, local experts on everything, reduce-scatter back.
- split (tp > 1 and dp > 1): tokens are replicated inside each TP group, distinct across DP
  groups. Each TP rank contributes only its 1/tp chunk of the (padded) tokens, so every
  distinct token is gathered exactly once; after the reduce-scatter the TP group
  all-gathers the chunks back.

Token counts. The gathered collectives need one row count S on every EP rank:
- static (no host sync; what decode CUDA graphs capture): S is known without talking to
  anyone, either because a CUDA stream capture is active (ranks capture the same bucket in
  lock-step, so S = the local count) or because the caller opened `static_tokens(n)`
  (the worker does this in every global decode step and around decode captures, with n =
  the step's batch bucket, so eager decode ranks pad to the same S a replayed graph uses).
- dynamic (eager prefill, inside the MoE eager boundary of piecewise plans): the EP ranks
  all-gather their counts first (one small collective + host sync), then pad to the max.
Every rank of one step is in the same mode: the coordinator gives all of them the same
phase and bucket, so the collective sequences pair up.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F

from parallel import comm
from parallel.options import DEFAULT_DEEPEP_MAX_TOKENS_PER_RANK
from parallel.static_tokens import DispatcherError, StaticTokensMixin

KINDS = ("allgather", "deepep")


@dataclass(frozen=True)
class _Handle:
    num_tokens: int  # T: this rank's real tokens
    padded: int  # S: padded rows per rank (before the TP split)


class AllGatherDispatcher(StaticTokensMixin):
    name = "allgather"

    def __init__(self, *, ep_group: Any, ep_size: int, ep_rank: int, tp_group: Any = None, tp_size: int = 1,
                 tp_rank: int = 0, dp_size: int = 1):
        if ep_size < 2:
            raise DispatcherError("an EP dispatcher needs ep_size >= 2")
        if ep_size != tp_size * dp_size:
            raise DispatcherError(f"ep_size {ep_size} must equal tp {tp_size} * dp {dp_size} (ep = world)")
        self.ep_group, self.ep_size, self.ep_rank = ep_group, ep_size, ep_rank
        self.tp_group, self.tp_size, self.tp_rank = tp_group, tp_size, tp_rank
        self.layout = "replicated" if dp_size == 1 else ("gather" if tp_size == 1 else "split")

    # ---- life cycle (nothing to own: the groups belong to parallel.groups)
    def prepare(self) -> None:
        """Allocate communication state before any capture (nothing for all-gather)."""

    def destroy(self) -> str:
        return "skipped: allgather has no buffer"

    # ---- sizes
    def _padded_rows(self, hidden: torch.Tensor) -> int:
        s = self._static_size(hidden)
        if s is None:  # dynamic: exchange counts (host sync; eager boundaries only)
            count = torch.tensor([hidden.shape[0]], dtype=torch.int64, device=hidden.device)
            s = int(comm.all_gather(count, self.ep_group).max().item())
        return math.ceil(s / self.tp_size) * self.tp_size if self.layout == "split" else s

    # ---- interface
    def dispatch(self, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor):
        t = int(hidden.shape[0])
        if self.layout == "replicated":
            return hidden, ids, weights, _Handle(t, t)
        s = self._padded_rows(hidden)
        if s > t:
            hidden = F.pad(hidden, (0, 0, 0, s - t))
            ids = F.pad(ids, (0, 0, 0, s - t), value=-1)
            weights = F.pad(weights, (0, 0, 0, s - t))
        if self.layout == "split":
            c = s // self.tp_size
            lo = self.tp_rank * c
            hidden, ids, weights = hidden[lo : lo + c], ids[lo : lo + c], weights[lo : lo + c]
        h_all, i_all, w_all = _gather_packed(hidden, ids, weights, self.ep_group)
        return h_all, i_all, w_all, _Handle(t, s)

    def combine(self, out: torch.Tensor, handle: _Handle) -> torch.Tensor:
        if self.layout == "replicated":
            return comm.all_reduce(out, self.ep_group)
        mine = comm.reduce_scatter(out, self.ep_group)
        if self.layout == "split":
            mine = comm.all_gather(mine, self.tp_group)
        return mine[: handle.num_tokens]


def _gather_packed(hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, group: Any):
    """One all-gather for tokens + routing: rows packed as raw bytes [ids | weights | hidden]."""
    parts = [ids.contiguous(), weights.contiguous(), hidden.contiguous()]
    raw = [p.view(torch.uint8).reshape(p.shape[0], -1) for p in parts]
    widths = [r.shape[1] for r in raw]
    gathered = comm.all_gather(torch.cat(raw, dim=1), group)
    out, off = [], 0
    for p, w in zip(parts, widths):
        out.append(gathered[:, off : off + w].contiguous().view(p.dtype).reshape(-1, *p.shape[1:]))
        off += w
    i_all, w_all, h_all = out
    return h_all, i_all, w_all


def make_dispatcher(kind: str, *, ep_group: Any, ep_size: int, ep_rank: int, tp_group: Any = None, tp_size: int = 1,
                    tp_rank: int = 0, dp_size: int = 1, model_config: Any = None, max_decode_tokens: int = 0,
                    barrier_group: Any = None,
                    deepep_max_tokens_per_rank: int = DEFAULT_DEEPEP_MAX_TOKENS_PER_RANK) -> Optional[Any]:
    """The EP dispatcher of `kind` ("allgather" | "deepep"), or None when ep_size == 1. `deepep_max_tokens_per_rank`:
    DeepEP's low-latency cap (`CommOptions.deepep_max_tokens_per_rank`).

    "deepep" raises `parallel.deepep.DeepEPUnavailableError` when `deep_ep` does not import.
    """
    if kind not in KINDS:
        raise DispatcherError(f"unknown EP backend {kind!r}; expected one of {KINDS}")
    if ep_size == 1:
        return None
    if kind == "allgather":
        return AllGatherDispatcher(ep_group=ep_group, ep_size=ep_size, ep_rank=ep_rank, tp_group=tp_group,
                                   tp_size=tp_size, tp_rank=tp_rank, dp_size=dp_size)
    from parallel.deepep import DeepEPDispatcher

    return DeepEPDispatcher(ep_group=ep_group, ep_size=ep_size, ep_rank=ep_rank, tp_group=tp_group, tp_size=tp_size,
                            tp_rank=tp_rank, model_config=model_config, max_decode_tokens=max_decode_tokens,
                            barrier_group=barrier_group, max_tokens_per_rank=deepep_max_tokens_per_rank)
