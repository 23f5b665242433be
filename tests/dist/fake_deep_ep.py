"""A CPU fake of `deep_ep` (gloo collectives) that enforces the real library's limits.

Semantics (DeepEP's documentation): normal dispatch returns the tokens routed to this rank with local expert ids,
-1 elsewhere; normal combine sums back unweighted; low-latency dispatch packs `[E_local, cap * ranks, H]` per local
expert with per-expert counts; low-latency combine applies the routing weights.

Limits, as the real library's host asserts (`EP_HOST_ASSERT`) raise them, written down here independently of
`parallel.deepep_checks` so that the tests compare two sources (deepseek-ai/DeepEP, csrc/kernels/launch.cuh):
- `SWITCH_RANKS`: intranode kernels for 2, 4 and 8 ranks (checked when a buffer is made; this fake is intranode).
- `SWITCH_TYPES`: bfloat16 only (normal combine, low-latency dispatch / combine).
- `SWITCH_HIDDEN`: the low-latency kernels exist for these hidden sizes only.
- `kNumMaxTopK = 9` (csrc/kernels/internode_ll.cu), and at most `num_max_dispatch_tokens_per_rank` tokens.
"""
from __future__ import annotations

import types

import torch
import torch.distributed as dist

RANKS = (2, 4, 8)
HIDDEN = (2048, 2560, 3072, 4096, 5120, 6144, 7168, 8192)
MAX_TOPK = 9


class FakeDeepEPError(RuntimeError):
    """What the real library raises from EP_HOST_ASSERT (a RuntimeError with the failed condition)."""


def _assert(ok: bool, what: str) -> None:
    if not ok:
        raise FakeDeepEPError(f"Failed: Assertion error {what}")


def check_ranks(n: int) -> None:
    _assert(n in RANKS, f"Unsupported ranks ({n})")


def check_type(dtype: torch.dtype) -> None:
    _assert(dtype == torch.bfloat16, f"Unsupported type ({dtype})")


def check_hidden(hidden: int) -> None:
    _assert(hidden in HIDDEN, f"Unsupported hidden ({hidden})")


def check_low_latency(x: torch.Tensor, topk_idx: torch.Tensor, cap: int, num_experts: int, n: int) -> None:
    check_type(x.dtype)
    check_hidden(int(x.shape[1]))
    _assert(topk_idx.shape[1] <= MAX_TOPK, f"num_topk <= kNumMaxTopK ({topk_idx.shape[1]} > {MAX_TOPK})")
    _assert(x.shape[0] <= cap, f"x.size(0) <= num_max_dispatch_tokens_per_rank ({x.shape[0]} > {cap})")
    _assert(num_experts % n == 0, "num_experts % num_ranks == 0")


def make_fake_deep_ep() -> types.ModuleType:
    """A fresh module (its `Buffer.calls` counts constructor calls, `Buffer.log` what ran)."""

    class _Cfg:
        def get_nvl_buffer_size_hint(self, hidden_bytes, size):
            return 1 << 20

        def get_rdma_buffer_size_hint(self, hidden_bytes, size):
            return 0

    def _gather(t, group, rows):
        pad = torch.zeros((rows - t.shape[0], *t.shape[1:]), dtype=t.dtype)
        parts = [torch.empty((rows, *t.shape[1:]), dtype=t.dtype) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, torch.cat([t, pad]), group=group)
        return parts

    def _max_rows(t, group):
        n = torch.tensor([t.shape[0]])
        dist.all_reduce(n, op=dist.ReduceOp.MAX, group=group)
        return int(n)

    class Buffer:
        calls: list = []
        log: list = []

        def __init__(self, group, num_nvl_bytes=0, num_rdma_bytes=0, low_latency_mode=False, num_qps_per_rank=1,
                     explicitly_destroy=False):
            Buffer.calls.append(dist.get_world_size(group))
            check_ranks(dist.get_world_size(group))
            assert explicitly_destroy and low_latency_mode
            self.group, self.r, self.n = group, dist.get_rank(group), dist.get_world_size(group)
            Buffer.log.append("create")

        get_dispatch_config = staticmethod(lambda n: _Cfg())
        get_combine_config = staticmethod(lambda n: _Cfg())
        get_low_latency_rdma_size_hint = staticmethod(lambda cap, hidden, n, e: 0)

        def get_dispatch_layout(self, topk_idx, num_experts):
            _assert(num_experts % self.n == 0, "num_experts % num_ranks == 0")
            owner = torch.where(topk_idx >= 0, topk_idx // (num_experts // self.n), -1)
            in_rank = torch.stack([(owner == r).any(1) for r in range(self.n)], 1)
            self._num_experts = num_experts
            return in_rank.sum(0).int(), None, torch.bincount(topk_idx[topk_idx >= 0], minlength=num_experts), \
                in_rank, None

        def dispatch(self, x, topk_idx=None, topk_weights=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                     is_token_in_rank=None, num_tokens_per_expert=None, **kw):
            _assert(x.shape[1] * x.element_size() % 16 == 0, "hidden bytes are a multiple of int4")
            rows = _max_rows(x, self.group)
            xs, ids, ws = (_gather(t, self.group, rows) for t in (x, topk_idx, topk_weights))
            ins = _gather(is_token_in_rank, self.group, rows)
            e_local = self._num_experts // self.n
            lo = self.r * e_local
            src = [(s, t) for s in range(self.n) for t in range(rows) if bool(ins[s][t, self.r])]
            rx = torch.stack([xs[s][t] for s, t in src])
            ri = torch.stack([ids[s][t] for s, t in src])
            ri = torch.where((ri >= lo) & (ri < lo + e_local), ri - lo, -1)
            rw = torch.stack([ws[s][t] for s, t in src])
            Buffer.log.append("normal")
            return rx, ri, rw, [], (src, rows, x.shape[0]), None

        def combine(self, x, handle):
            check_type(x.dtype)
            src, rows, mine = handle
            contrib = torch.zeros(self.n, rows, x.shape[1], dtype=torch.float32)
            for (s, t), row in zip(src, x.float()):
                contrib[s, t] += row
            dist.all_reduce(contrib, group=self.group)
            return contrib[self.r, :mine].to(x.dtype), None, None

        def clean_low_latency_buffer(self, cap, hidden, num_experts):
            check_hidden(hidden)
            Buffer.log.append("clean")

        def low_latency_dispatch(self, x, topk_idx, cap, num_experts, use_fp8=True, **kw):
            check_low_latency(x, topk_idx, cap, num_experts, self.n)
            assert not use_fp8
            xs, ids = _gather(x, self.group, cap), _gather(topk_idx, self.group, cap)
            allc = [torch.zeros(1, dtype=torch.int64) for _ in range(self.n)]
            dist.all_gather(allc, torch.tensor([x.shape[0]]), group=self.group)
            e_local = num_experts // self.n
            recv = torch.zeros(e_local, cap * self.n, x.shape[1], dtype=x.dtype)
            count = torch.zeros(e_local, dtype=torch.int32)
            where = []
            for e in range(e_local):
                g = self.r * e_local + e
                for s in range(self.n):
                    for t in range(int(allc[s])):
                        if bool((ids[s][t] == g).any()):
                            recv[e, count[e]] = xs[s][t]
                            where.append((e, int(count[e]), s, t))
                            count[e] += 1
            Buffer.log.append("low_latency")
            return recv, count, (where, cap, x.shape[0], num_experts), None, None

        def low_latency_combine(self, x, topk_idx, topk_weights, handle, **kw):
            check_type(x.dtype)
            check_hidden(int(x.shape[2]))
            where, cap, mine, num_experts = handle
            e_local = num_experts // self.n
            ws, ids = _gather(topk_weights, self.group, cap), _gather(topk_idx, self.group, cap)
            contrib = torch.zeros(self.n, cap, x.shape[2], dtype=torch.float32)
            for e, j, s, t in where:
                g = self.r * e_local + e
                w = float(ws[s][t][ids[s][t] == g].sum())
                contrib[s, t] += w * x[e, j].float()
            dist.all_reduce(contrib, group=self.group)
            return contrib[self.r, :mine].to(x.dtype), None, None

        def destroy(self):
            Buffer.log.append("destroy")

    mod = types.ModuleType("deep_ep")
    mod.Buffer = Buffer
    return mod
