"""DeepEP EP backend (optional: used only when `import deep_ep` succeeds) and its buffer life cycle.

The one piece of global mutable state in the project: `_BUFFER`, the process-wide
`deep_ep.Buffer` of this rank (DeepEP allocates NVLink/RDMA memory and registers it with
every peer, so there is exactly one per process). It is created with
`explicitly_destroy=True` before any capture (`DeepEPDispatcher.prepare()`), and destroyed
collectively by `destroy_deepep_buffer()` (buffer.destroy(), then a barrier) during
every reset, after the graph runner dropped the graphs that captured its addresses.

Modes (as in DeepEP's documentation):
- normal `dispatch` / `combine`: prefill, inside the MoE eager boundary (host sync on counts).
- `low_latency_dispatch` / `low_latency_combine`: decode (static step, or a CUDA capture);
  fixed shapes, capturable. The per-rank token cap must cover the largest decode bucket.
  After a normal op the low-latency buffer is cleaned before the next low-latency use
  (`clean_low_latency_buffer`).
Construction checks every DeepEP limit (`parallel.deepep_checks`: bf16, hidden size, 2/4/8 ranks,
top-k, token cap) before any buffer exists; the driver runs the same check (`actors.deepep_config`).
With tp > 1 each TP rank sends only its 1/tp chunk of the (replicated) tokens and the TP
group all-gathers the combined chunks, as in the all-gather backend's split layout.

Not verified on hardware here: `deep_ep` is not installed on the development or GPU
machines. The low-latency path hands the expert kernel the packed
[E_local * cap * ep, H] layout (one id per row, weight 1, combine applies the routing
weights) with its per-expert counts (`packed_counts`), which `modeling.moe` computes with the
packed routed-expert kernel (`modeling.ops.triton_moe.packed_experts`, capturable); rows past a
count are left unspecified there, and low-latency combine reads only the received rows.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from parallel import comm
from parallel.deepep_checks import DeepEPConfigError, check_deepep_config
from parallel.options import DEEPEP_MAX_TOKENS_ENV, DEFAULT_DEEPEP_MAX_TOKENS_PER_RANK
from parallel.static_tokens import StaticTokensMixin

try:  # optional dependency
    import deep_ep  # type: ignore

    HAVE_DEEP_EP = True
except Exception:  # noqa: BLE001 - ImportError, or a broken CUDA extension
    deep_ep = None
    HAVE_DEEP_EP = False

DEFAULT_LL_TOKEN_CAP = DEFAULT_DEEPEP_MAX_TOKENS_PER_RANK  # low-latency tokens per rank (`CommOptions`)

# The process-wide DeepEP buffer (documented global; see module doc).
_BUFFER: Optional[Any] = None
_BARRIER_GROUP: Optional[Any] = None


class DeepEPUnavailableError(RuntimeError):
    """ep_backend="deepep" was asked for but `deep_ep` does not import on this rank."""


__all__ = ["DeepEPConfigError", "DeepEPDispatcher", "DeepEPUnavailableError", "deepep_available",
           "destroy_deepep_buffer", "get_deepep_buffer"]


def deepep_available() -> bool:
    return HAVE_DEEP_EP


def get_deepep_buffer(group: Any, *, hidden: int, num_experts: int, max_tokens_per_rank: int, hidden_bytes: int,
                      barrier_group: Any = None) -> Any:
    """Create (once) and return the process-wide buffer, sized for normal and low-latency mode."""
    global _BUFFER, _BARRIER_GROUP
    if not HAVE_DEEP_EP:
        raise DeepEPUnavailableError("deep_ep is not installed on this rank")
    if _BUFFER is not None:
        return _BUFFER
    size = dist.get_world_size(group)
    nvl, rdma = 0, 0
    for cfg in (deep_ep.Buffer.get_dispatch_config(size), deep_ep.Buffer.get_combine_config(size)):
        nvl = max(nvl, cfg.get_nvl_buffer_size_hint(hidden_bytes, size))
        rdma = max(rdma, cfg.get_rdma_buffer_size_hint(hidden_bytes, size))
    rdma = max(rdma, deep_ep.Buffer.get_low_latency_rdma_size_hint(max_tokens_per_rank, hidden, size, num_experts))
    _BUFFER = deep_ep.Buffer(group, num_nvl_bytes=nvl, num_rdma_bytes=rdma, low_latency_mode=True,
                             num_qps_per_rank=max(1, num_experts // size), explicitly_destroy=True)
    _BARRIER_GROUP = barrier_group if barrier_group is not None else group
    return _BUFFER


def destroy_deepep_buffer() -> str:
    """Collectively destroy this process's buffer (every EP rank calls it), then barrier.

    Returns what happened, for the reset event log. Idempotent.
    """
    global _BUFFER, _BARRIER_GROUP
    if not HAVE_DEEP_EP:
        return "skipped: deep_ep not installed"
    if _BUFFER is None:
        return "skipped: no buffer"
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    _BUFFER.destroy()
    _BUFFER = None
    group, _BARRIER_GROUP = _BARRIER_GROUP, None
    dist.barrier(group=group)
    return "destroyed"


@dataclass(frozen=True)
class _Handle:
    mode: str  # "normal" | "low_latency"
    inner: Any
    num_tokens: int
    padded: int
    ids: Optional[torch.Tensor] = None
    weights: Optional[torch.Tensor] = None
    counts: Optional[torch.Tensor] = None  # low latency: received rows per local expert, int [E_local]


class DeepEPDispatcher(StaticTokensMixin):
    name = "deepep"

    def __init__(self, *, ep_group: Any, ep_size: int, ep_rank: int, tp_group: Any = None, tp_size: int = 1,
                 tp_rank: int = 0, model_config: Any, max_decode_tokens: int, barrier_group: Any = None,
                 max_tokens_per_rank: int = DEFAULT_DEEPEP_MAX_TOKENS_PER_RANK):
        if not HAVE_DEEP_EP:
            raise DeepEPUnavailableError("ep_backend='deepep' needs the deep_ep package on every rank")
        if model_config is None:
            raise DeepEPConfigError("the DeepEP backend needs the model config (a MoE model)")
        # Every DeepEP limit, before any buffer exists (`parallel.deepep_checks`).
        check_deepep_config(dtype=model_config.dtype, hidden=model_config.hidden_size,
                            num_experts=model_config.num_experts, top_k=model_config.num_experts_per_tok,
                            ep_size=ep_size, tp_size=tp_size, largest_decode_bucket=max_decode_tokens,
                            max_tokens_per_rank=int(max_tokens_per_rank))
        self.ep_group, self.ep_size, self.ep_rank = ep_group, ep_size, ep_rank
        self.tp_group, self.tp_size, self.tp_rank = tp_group, tp_size, tp_rank
        self.barrier_group = barrier_group
        self.hidden = model_config.hidden_size
        self.num_experts = model_config.num_experts
        self.e_local = self.num_experts // ep_size
        self.first_expert = ep_rank * self.e_local
        # Per-rank cap of the low-latency kernels (every rank must use the same value; it sizes the RDMA buffer).
        self.max_tokens_per_rank = int(max_tokens_per_rank)
        self._need_ll_clean = False

    def _buffer(self) -> Any:
        return get_deepep_buffer(self.ep_group, hidden=self.hidden, num_experts=self.num_experts,
                                 max_tokens_per_rank=self.max_tokens_per_rank, hidden_bytes=self.hidden * 2,
                                 barrier_group=self.barrier_group)

    @contextlib.contextmanager
    def static_tokens(self, n: Optional[int]) -> Iterator[None]:
        """As the base, and clean the low-latency buffer when normal ops ran since its last use
        (collective: every rank enters the same global decode step; replayed graphs cannot do it)."""
        if n is not None and self._need_ll_clean and _BUFFER is not None:
            _BUFFER.clean_low_latency_buffer(self.max_tokens_per_rank, self.hidden, self.num_experts)
            self._need_ll_clean = False
        with super().static_tokens(n):
            yield

    def prepare(self) -> None:
        """Create the buffer before any capture (a capture must never allocate it)."""
        self._buffer()

    def destroy(self) -> str:
        return destroy_deepep_buffer()

    # ---- chunking over the TP group (tokens are replicated inside it)
    def _chunk(self, x: torch.Tensor, s: int, fill: float) -> torch.Tensor:
        if s > x.shape[0]:
            x = F.pad(x, (0, 0, 0, s - x.shape[0]), value=fill)
        c = s // self.tp_size
        return x[self.tp_rank * c : (self.tp_rank + 1) * c].contiguous()

    def dispatch(self, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor):
        t = int(hidden.shape[0])
        static = self._static_size(hidden)
        rows = static if static is not None else t
        s = math.ceil(rows / self.tp_size) * self.tp_size
        x, i, w = self._chunk(hidden, s, 0.0), self._chunk(ids, s, -1), self._chunk(weights, s, 0.0)
        buf = self._buffer()
        if static is not None:  # low-latency: fixed shapes, capturable
            if x.shape[0] > self.max_tokens_per_rank:
                raise DeepEPConfigError(f"{x.shape[0]} tokens exceed the DeepEP low-latency cap "
                                        f"{self.max_tokens_per_rank} of this rank: raise {DEEPEP_MAX_TOKENS_ENV}")
            if self._need_ll_clean and not _capturing_any(hidden):
                buf.clean_low_latency_buffer(self.max_tokens_per_rank, self.hidden, self.num_experts)
                self._need_ll_clean = False
            recv, count, inner, _, _ = buf.low_latency_dispatch(x, i, self.max_tokens_per_rank, self.num_experts,
                                                                 use_fp8=False)
            e, m, h = recv.shape
            valid = torch.arange(m, device=recv.device)[None, :] < count[:, None]
            gids = torch.where(valid, torch.arange(e, device=recv.device)[:, None] + self.first_expert,
                               torch.full_like(valid, -1, dtype=torch.int64))
            return (recv.reshape(e * m, h), gids.reshape(-1, 1), valid.float().reshape(-1, 1),
                    _Handle("low_latency", inner, t, s, i, w, count))
        self._need_ll_clean = True
        n_rank, n_rdma, n_expert, in_rank, _ = buf.get_dispatch_layout(i, self.num_experts)
        recv_x, recv_ids, recv_w, _, inner, _ = buf.dispatch(
            x, topk_idx=i, topk_weights=w, num_tokens_per_rank=n_rank, num_tokens_per_rdma_rank=n_rdma,
            is_token_in_rank=in_rank, num_tokens_per_expert=n_expert)
        gids = torch.where(recv_ids >= 0, recv_ids + self.first_expert, torch.full_like(recv_ids, -1))
        return recv_x, gids, recv_w, _Handle("normal", inner, t, s)

    def packed_counts(self, handle: _Handle) -> Optional[torch.Tensor]:
        return handle.counts if handle.mode == "low_latency" else None

    def combine(self, out: torch.Tensor, handle: _Handle) -> torch.Tensor:
        buf = self._buffer()
        if handle.mode == "low_latency":
            e = self.e_local
            mine, _, _ = buf.low_latency_combine(out.view(e, -1, out.shape[-1]), handle.ids, handle.weights,
                                                 handle.inner)
        else:
            mine, _, _ = buf.combine(out, handle.inner)
        if self.tp_size > 1:
            mine = comm.all_gather(mine.contiguous(), self.tp_group)
        return mine[: handle.num_tokens]


def _capturing_any(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.is_current_stream_capturing()
