"""`DeepEPDispatcher` against a fake `deep_ep` (`tests.dist.fake_deep_ep`: gloo, 2 processes) that enforces the
real library's limits: routing-index conversion, normal vs low-latency modes, the low-latency clean after normal
ops, the buffer life cycle, and the start-up checks (`parallel.deepep_checks`), which must refuse, before any
buffer exists, everything the library would refuse later. The real library never ran here (not installed).

The dispatcher runs at hidden 2048 in bf16 (`qwen3-moe-2048`'s shape), a configuration the real library accepts.
"""
import contextlib
import dataclasses
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from parallel.deepep_checks import (DEEPEP_EP_SIZES, DEEPEP_HIDDEN_SIZES, DEEPEP_MAX_TOPK, DeepEPConfigError,
                                    deepep_problems)
from parallel.groups import serve_rendezvous
from parallel.topology import Topology
from tests.dist import fake_deep_ep

MODEL = "qwen3-moe-2048"
I, CAP = 8, 8
# name -> (ModelConfig change, largest decode bucket): one broken limit each
BAD = {
    "dtype": (dict(dtype=torch.float32), CAP),
    "hidden": (dict(hidden_size=1024), CAP),
    "topk": (dict(num_experts_per_tok=10), CAP),
    "cap": ({}, 2 * CAP),
}
FIX = {  # what each message must name
    "dtype": ["float32", "--dtype bfloat16"],
    "hidden": ["1024", "2048, 2560, 3072, 4096, 5120, 6144, 7168, 8192", "--ep-backend allgather"],
    "topk": ["at most 9 experts", "routes 10"],
    "cap": ["deepep_max_tokens_per_rank=8", "16 tokens per rank", "largest decode bucket 16",
            "GRAPHLINE_DEEPEP_MAX_TOKENS_PER_RANK to at least 16"],
    "ep": ["ep is 16", "--ep 2, 4 or 8"],
}


def _cfg(**change):
    from modeling.config import get_preset

    return dataclasses.replace(get_preset(MODEL), **change)


def _raised(fn) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test compares type and message
        return f"{type(e).__name__}: {e}"
    return "no error"


def _fake_rejections(d, buf, own_group) -> dict:
    """The fake's own limits, hit directly (each raises before any collective, on every rank alike)."""
    h, e = d.hidden, d.num_experts
    ids = torch.zeros(4, 4, dtype=torch.int64)
    x = torch.zeros(4, h, dtype=torch.bfloat16)
    return {
        "dtype": _raised(lambda: buf.low_latency_dispatch(x.float(), ids, CAP, e, use_fp8=False)),
        "hidden": _raised(lambda: buf.low_latency_dispatch(torch.zeros(4, 1024, dtype=torch.bfloat16), ids, CAP, e,
                                                           use_fp8=False)),
        "topk": _raised(lambda: buf.low_latency_dispatch(x, torch.zeros(4, 10, dtype=torch.int64), CAP, e,
                                                         use_fp8=False)),
        "cap": _raised(lambda: buf.low_latency_dispatch(torch.zeros(CAP + 1, h, dtype=torch.bfloat16),
                                                        torch.zeros(CAP + 1, 4, dtype=torch.int64), CAP, e,
                                                        use_fp8=False)),
        "ep": _raised(lambda: fake_deep_ep.make_fake_deep_ep().Buffer(own_group, low_latency_mode=True,
                                                                     explicitly_destroy=True)),
        "combine_dtype": _raised(lambda: buf.combine(torch.zeros(2, h), None)),
    }


def _worker(rank, topo, rv, counts, out_q):
    torch.set_num_threads(1)
    sys.modules["deep_ep"] = fake = fake_deep_ep.make_fake_deep_ep()
    try:
        from modeling.moe import _experts_static, route
        from parallel import deepep
        from parallel.groups import RankGroups
        from parallel.options import CommOptions

        groups = RankGroups(topo, rank, torch.device("cpu"), timeout_s=30,
                            options=CommOptions(deepep_max_tokens_per_rank=CAP))
        groups.init(rv)
        own = [dist.new_group([r], backend="gloo") for r in range(topo.world)][rank]  # a 1-rank group
        startup = {}
        for name, (change, bucket) in BAD.items():  # every rank refuses; no buffer is made
            startup[name] = _raised(lambda: groups.build_context("deepep", _cfg(**change), max_decode_tokens=bucket))
        calls_after_checks = list(fake.Buffer.calls)
        cfg = _cfg()
        ctx = groups.build_context("deepep", cfg, max_decode_tokens=CAP)
        d = ctx.ep_dispatcher
        assert d.name == "deepep"
        d.prepare()
        rejected = _fake_rejections(d, deepep._BUFFER, own)
        E, K, H = cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size
        g = torch.Generator().manual_seed(3)
        w13 = (torch.randn(E, 2 * I, H, generator=g) * 0.05).bfloat16()
        w2 = (torch.randn(E, H, I, generator=g) * 0.3).bfloat16()
        e_local = E // topo.ep
        lo = ctx.ep_rank * e_local
        g = torch.Generator().manual_seed(10 + ctx.dp_rank)
        hidden = torch.randn(counts[ctx.dp_rank], H, generator=g).bfloat16()
        weights, ids = route(torch.randn(counts[ctx.dp_rank], E, generator=g), K, True)
        ref = _experts_static(hidden.float(), ids, weights, w13.float(), w2.float(), 0)
        errs = {}
        for mode in ("normal", "low_latency", "normal"):
            cm = d.static_tokens(CAP) if mode == "low_latency" else contextlib.nullcontext()
            with cm:
                h_all, i_all, w_all, handle = d.dispatch(hidden, ids, weights)
                out = _experts_static(h_all, i_all, w_all, w13[lo : lo + e_local], w2[lo : lo + e_local], lo)
                got = d.combine(out, handle)
            errs[mode] = float((got.float() - ref).abs().max() / ref.abs().max())
        status = [deepep.destroy_deepep_buffer(), deepep.destroy_deepep_buffer()]
        log = list(fake.Buffer.log)
        groups.destroy()
        out_q.put((rank, dict(errs=errs, log=log, status=status, startup=startup, calls=calls_after_checks,
                              rejected=rejected)))
    except BaseException as e:  # noqa: BLE001
        import traceback

        out_q.put((rank, dict(error=traceback.format_exc() + repr(e))))


@pytest.fixture(scope="module")
def two_ranks():
    topo = Topology.of(tp=1, dp=2, ep=2)
    store, rv = serve_rendezvous(2, 30, host="127.0.0.1")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, topo, rv, [5, 3], q)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = dict(q.get(timeout=180) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    for rank, res in got.items():
        assert "error" not in res, res.get("error")
    return [got[0], got[1]]


def test_dispatch_and_combine_through_the_fake(two_ranks):
    for rank, res in enumerate(two_ranks):
        for mode, err in res["errs"].items():
            assert err < 2e-2, (rank, mode, err)
        assert res["log"] == ["create", "normal", "clean", "low_latency", "normal", "destroy"], res["log"]
        assert res["status"] == ["destroyed", "skipped: no buffer"]


@pytest.mark.parametrize("name", sorted(BAD))
def test_startup_check_refuses_on_every_rank_before_any_buffer(two_ranks, name):
    for res in two_ranks:
        msg = res["startup"][name]
        assert msg.startswith("DeepEPConfigError: ep_backend=deepep cannot run this deployment"), msg
        for part in FIX[name]:
            assert part in msg, (part, msg)
        assert res["calls"] == [], res["calls"]  # the fake's Buffer constructor never ran


@pytest.mark.parametrize("name,what", [("dtype", "Unsupported type"), ("hidden", "Unsupported hidden (1024)"),
                                       ("topk", "kNumMaxTopK"), ("cap", "num_max_dispatch_tokens_per_rank (9 > 8)"),
                                       ("ep", "Unsupported ranks (1)"), ("combine_dtype", "Unsupported type")])
def test_the_fake_refuses_what_the_library_refuses(two_ranks, name, what):
    for res in two_ranks:
        msg = res["rejected"][name]
        assert msg.startswith("FakeDeepEPError") and what in msg, msg


def _fake_accepts(dtype, hidden, top_k, ep) -> bool:
    try:
        fake_deep_ep.check_ranks(ep)
        fake_deep_ep.check_low_latency(torch.zeros(1, hidden, dtype=dtype), torch.zeros(1, top_k, dtype=torch.int64),
                                       CAP, 16, ep)
    except fake_deep_ep.FakeDeepEPError:
        return False
    return True


def test_the_checks_accept_exactly_what_the_fake_accepts():
    assert DEEPEP_HIDDEN_SIZES == fake_deep_ep.HIDDEN and DEEPEP_EP_SIZES == fake_deep_ep.RANKS
    assert DEEPEP_MAX_TOPK == fake_deep_ep.MAX_TOPK
    seen = set()
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for hidden in range(1024, 9216, 512):
            for top_k in (1, 8, 9, 10):
                for ep in (1, 2, 3, 4, 8, 16):
                    ok = not deepep_problems(dtype=dtype, hidden=hidden, num_experts=16, top_k=top_k, ep_size=ep,
                                             tp_size=1, largest_decode_bucket=CAP, max_tokens_per_rank=CAP)
                    assert ok == _fake_accepts(dtype, hidden, top_k, ep), (dtype, hidden, top_k, ep)
                    seen.add(ok)
    assert seen == {True, False}


def _dispatcher(monkeypatch, **kw):
    """A `DeepEPDispatcher` in this process over a fresh fake (no group: the checks come first)."""
    from parallel import deepep

    fake = fake_deep_ep.make_fake_deep_ep()
    monkeypatch.setattr(deepep, "HAVE_DEEP_EP", True)
    monkeypatch.setattr(deepep, "deep_ep", fake)
    args = dict(ep_group=None, ep_size=2, ep_rank=0, model_config=_cfg(), max_decode_tokens=CAP,
                max_tokens_per_rank=CAP)
    args.update(kw)
    return fake, lambda: deepep.DeepEPDispatcher(**args)


@pytest.mark.parametrize("name", sorted(BAD) + ["ep"])
def test_dispatcher_refuses_with_the_fix_named(monkeypatch, name):
    change, bucket = BAD.get(name, ({}, CAP))
    kw = dict(model_config=_cfg(**change), max_decode_tokens=bucket)
    if name == "ep":
        kw["ep_size"] = 16
    fake, build = _dispatcher(monkeypatch, **kw)
    with pytest.raises(DeepEPConfigError) as info:
        build()
    for part in FIX[name]:
        assert part in str(info.value), (part, str(info.value))
    assert fake.Buffer.calls == []


def test_every_problem_in_one_line(monkeypatch):
    fake, build = _dispatcher(monkeypatch, model_config=_cfg(dtype=torch.float16, hidden_size=64), ep_size=3,
                              max_decode_tokens=CAP)  # dtype, hidden, ep: three problems
    with pytest.raises(DeepEPConfigError) as info:
        build()
    msg = str(info.value)
    assert "\n" not in msg and msg.count("; ") == 2, msg
    assert fake.Buffer.calls == []


def test_a_supported_deployment_passes_the_checks(monkeypatch):
    fake, build = _dispatcher(monkeypatch, tp_size=2, max_decode_tokens=2 * CAP)  # tp 2: 8 of 16 rows per rank
    d = build()
    assert (d.hidden, d.e_local, d.max_tokens_per_rank) == (2048, 8, CAP)
    assert fake.Buffer.calls == []  # construction allocates nothing; prepare() does
