"""The all-gather EP dispatcher on gloo (no Ray): every layout equals all experts on one rank.

Spawns world-size processes that join through a TCPStore served by the test process on
port 0 (the same rendezvous the Ray workers use), build their groups with
`parallel.groups.RankGroups`, and run dispatch -> local experts -> combine with different
token counts per DP rank (dynamic sizes) and inside `static_tokens` (decode padding).
"""

import pytest
import torch
import torch.multiprocessing as mp

from modeling.moe import _experts_grouped, _experts_static, route
from parallel.groups import RankGroups, serve_rendezvous
from parallel.topology import Topology

E, K, H, I = 8, 2, 16, 8


def _problem(dp_rank: int, n: int):
    g = torch.Generator().manual_seed(100 + dp_rank)
    hidden = torch.randn(n, H, generator=g)
    weights, ids = route(torch.randn(n, E, generator=g), K, True)
    return hidden, ids, weights


def _experts():
    g = torch.Generator().manual_seed(7)
    return torch.randn(E, 2 * I, H, generator=g) * 0.3, torch.randn(E, H, I, generator=g) * 0.3


def _run_layout(rank, topo, rv, counts):
    import contextlib

    groups = RankGroups(topo, rank, torch.device("cpu"), timeout_s=30)
    groups.init(rv)
    ctx = groups.build_context("allgather")
    d = ctx.ep_dispatcher
    w13, w2 = _experts()
    e_local = E // topo.ep
    lo = ctx.ep_rank * e_local
    results = {}
    hidden, ids, weights = _problem(ctx.dp_rank, counts[ctx.dp_rank])
    ref = _experts_static(hidden, ids, weights, w13, w2, 0)
    for mode in ("dynamic", "static", "grouped"):
        cm = d.static_tokens(max(counts) + 1) if mode == "static" else contextlib.nullcontext()
        with cm:
            h_all, i_all, w_all, handle = d.dispatch(hidden, ids, weights)
            fn = _experts_grouped if mode == "grouped" else _experts_static
            out = fn(h_all, i_all, w_all, w13[lo : lo + e_local], w2[lo : lo + e_local], lo)
            got = d.combine(out, handle)
        results[mode] = float((got - ref).abs().max()) if got.shape == ref.shape else f"shape {tuple(got.shape)}"
    layout = d.layout
    groups.destroy()
    groups.destroy()  # idempotent
    return layout, results


def _worker(rank, cases, out_q):
    torch.set_num_threads(1)
    for topo, rv, counts in cases:
        try:
            out_q.put((topo.describe(), rank) + _run_layout(rank, topo, rv, counts))
        except BaseException as e:  # noqa: BLE001
            out_q.put((topo.describe(), rank, "error", repr(e)))


LAYOUTS = {"gather": (1, 4), "replicated": (4, 1), "split": (2, 2)}


def test_allgather_dispatch_equals_all_experts():
    """One group of 4 processes runs every layout in turn (process start-up dominates on CI)."""
    world = 4
    stores, cases, want = [], [], {}
    for layout, (tp, dp) in LAYOUTS.items():
        topo = Topology.of(tp=tp, dp=dp, ep=world)
        store, rv = serve_rendezvous(world, 30, host="127.0.0.1")
        stores.append(store)
        cases.append((topo, rv, [5, 2, 3, 1][:dp]))  # different token counts per DP rank
        want[topo.describe()] = layout
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, cases, q)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        got = [q.get(timeout=180) for _ in range(world * len(cases))]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert len(got) == world * len(cases)
    for desc, rank, layout, res in got:
        assert layout == want[desc], (desc, rank, layout, res)
        for mode, err in res.items():
            assert isinstance(err, float) and err < 1e-5, (desc, rank, mode, err)


def test_unknown_backend_and_cap():
    from parallel.dispatch import DispatcherError, make_dispatcher

    with pytest.raises(DispatcherError, match="unknown EP backend"):
        make_dispatcher("nope", ep_group=None, ep_size=2, ep_rank=0)
    assert make_dispatcher("allgather", ep_group=None, ep_size=1, ep_rank=0) is None
    from parallel.deepep import HAVE_DEEP_EP, DeepEPUnavailableError, destroy_deepep_buffer

    if not HAVE_DEEP_EP:
        with pytest.raises(DeepEPUnavailableError):
            make_dispatcher("deepep", ep_group=None, ep_size=2, ep_rank=0, dp_size=2)
        assert destroy_deepep_buffer().startswith("skipped")
