"""`DeepEPDispatcher` against a fake `deep_ep` (gloo, 2 processes): routing-index conversion, the TP
chunking, normal vs low-latency modes, the low-latency clean after normal ops, and the buffer life cycle.

The fake implements the documented semantics of `deep_ep.Buffer` (normal dispatch returns the
tokens routed to this rank with local expert ids, -1 elsewhere; combine sums back unweighted;
low-latency dispatch packs `[E_local, cap * ranks, H]` per expert; low-latency combine applies
the routing weights) with gloo collectives. The real library never ran here (not installed).
"""
import sys
import types

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from parallel.groups import serve_rendezvous
from parallel.topology import Topology

E, K, H, I, CAP = 8, 2, 16, 8, 8


def _fake_deep_ep() -> types.ModuleType:
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
        log: list = []

        def __init__(self, group, num_nvl_bytes=0, num_rdma_bytes=0, low_latency_mode=False, num_qps_per_rank=1,
                     explicitly_destroy=False):
            assert explicitly_destroy and low_latency_mode
            self.group, self.r, self.n = group, dist.get_rank(group), dist.get_world_size(group)
            Buffer.log.append("create")

        get_dispatch_config = staticmethod(lambda n: _Cfg())
        get_combine_config = staticmethod(lambda n: _Cfg())
        get_low_latency_rdma_size_hint = staticmethod(lambda cap, hidden, n, e: 0)

        def get_dispatch_layout(self, topk_idx, num_experts):
            owner = torch.where(topk_idx >= 0, topk_idx // (num_experts // self.n), -1)
            in_rank = torch.stack([(owner == r).any(1) for r in range(self.n)], 1)
            return in_rank.sum(0).int(), None, torch.bincount(topk_idx[topk_idx >= 0], minlength=num_experts), \
                in_rank, None

        def dispatch(self, x, topk_idx=None, topk_weights=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                     is_token_in_rank=None, num_tokens_per_expert=None, **kw):
            rows = _max_rows(x, self.group)
            xs, ids, ws = (_gather(t, self.group, rows) for t in (x, topk_idx, topk_weights))
            ins = _gather(is_token_in_rank, self.group, rows)
            e_local = E // self.n
            lo = self.r * e_local
            src = [(s, t) for s in range(self.n) for t in range(rows) if bool(ins[s][t, self.r])]
            rx = torch.stack([xs[s][t] for s, t in src])
            ri = torch.stack([ids[s][t] for s, t in src])
            ri = torch.where((ri >= lo) & (ri < lo + e_local), ri - lo, -1)
            rw = torch.stack([ws[s][t] for s, t in src])
            Buffer.log.append("normal")
            return rx, ri, rw, [], (src, rows, x.shape[0]), None

        def combine(self, x, handle):
            src, rows, mine = handle
            contrib = torch.zeros(self.n, rows, x.shape[1], dtype=torch.float32)
            for (s, t), row in zip(src, x.float()):
                contrib[s, t] += row
            dist.all_reduce(contrib, group=self.group)
            return contrib[self.r, :mine].to(x.dtype), None, None

        def clean_low_latency_buffer(self, cap, hidden, num_experts):
            Buffer.log.append("clean")

        def low_latency_dispatch(self, x, topk_idx, cap, num_experts, use_fp8=True, **kw):
            assert not use_fp8 and x.shape[0] <= cap
            xs, ids = _gather(x, self.group, cap), _gather(topk_idx, self.group, cap)
            counts_per_rank = torch.tensor([x.shape[0]])
            allc = [torch.zeros(1, dtype=torch.int64) for _ in range(self.n)]
            dist.all_gather(allc, counts_per_rank, group=self.group)
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


def _worker(rank, topo, rv, counts, out_q):
    torch.set_num_threads(1)
    sys.modules["deep_ep"] = fake = _fake_deep_ep()
    try:
        from modeling.config import get_preset
        from modeling.moe import _experts_static, route
        from parallel import deepep
        from parallel.groups import RankGroups

        cfg = get_preset("qwen3-moe-tiny").with_dtype(torch.bfloat16)
        from parallel.options import CommOptions

        groups = RankGroups(topo, rank, torch.device("cpu"), timeout_s=30,
                            options=CommOptions(deepep_max_tokens_per_rank=CAP))
        groups.init(rv)
        ctx = groups.build_context("deepep", cfg, max_decode_tokens=CAP)
        d = ctx.ep_dispatcher
        assert d.name == "deepep"
        d.prepare()
        g = torch.Generator().manual_seed(3)
        w13 = (torch.randn(E, 2 * I, H, generator=g) * 0.3).bfloat16()
        w2 = (torch.randn(E, H, I, generator=g) * 0.3).bfloat16()
        e_local = E // topo.ep
        lo = ctx.ep_rank * e_local
        g = torch.Generator().manual_seed(10 + ctx.dp_rank)
        hidden = torch.randn(counts[ctx.dp_rank], H, generator=g).bfloat16()
        weights, ids = route(torch.randn(counts[ctx.dp_rank], E, generator=g), K, True)
        ref = _experts_static(hidden.float(), ids, weights, w13.float(), w2.float(), 0)
        errs = {}
        for mode in ("normal", "low_latency", "normal"):
            import contextlib

            cm = d.static_tokens(CAP) if mode == "low_latency" else contextlib.nullcontext()
            with cm:
                h_all, i_all, w_all, handle = d.dispatch(hidden, ids, weights)
                out = _experts_static(h_all, i_all, w_all, w13[lo : lo + e_local], w2[lo : lo + e_local], lo)
                got = d.combine(out, handle)
            errs[mode] = float((got.float() - ref).abs().max() / ref.abs().max())
        status = [deepep.destroy_deepep_buffer(), deepep.destroy_deepep_buffer()]
        log = list(fake.Buffer.log)
        groups.destroy()
        out_q.put((rank, errs, log, status))
    except BaseException as e:  # noqa: BLE001
        import traceback

        out_q.put((rank, "error", traceback.format_exc(), repr(e)))


def test_deepep_dispatcher_with_fake_library():
    topo = Topology.of(tp=1, dp=2, ep=2)
    store, rv = serve_rendezvous(2, 30, host="127.0.0.1")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, topo, rv, [5, 3], q)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = [q.get(timeout=120) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    for rank, errs, log, status in got:
        assert errs != "error", log
        for mode, err in errs.items():
            assert err < 2e-2, (rank, mode, err)
        assert log == ["create", "normal", "clean", "low_latency", "normal", "destroy"], log
        assert status == ["destroyed", "skipped: no buffer"]


def test_deepep_cap_check():
    from parallel import deepep

    saved = deepep.HAVE_DEEP_EP
    try:
        deepep.HAVE_DEEP_EP = True
        from modeling.config import get_preset

        cfg = get_preset("qwen3-moe-tiny").with_dtype(torch.bfloat16)
        with pytest.raises(deepep.DeepEPConfigError, match="cap 256 tokens/rank < 512"):
            deepep.DeepEPDispatcher(ep_group=None, ep_size=2, ep_rank=0, model_config=cfg, max_decode_tokens=512)
        with pytest.raises(deepep.DeepEPConfigError, match="bfloat16"):
            deepep.DeepEPDispatcher(ep_group=None, ep_size=2, ep_rank=0, model_config=get_preset("qwen3-moe-tiny"),
                                    max_decode_tokens=8)
    finally:
        deepep.HAVE_DEEP_EP = saved
