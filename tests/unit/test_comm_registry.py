"""The fast all-reduce registry of `parallel.comm` and the CPU-side behaviour of its users (no GPU needed).

Real torch.distributed only (a gloo group of one rank, created and destroyed here); the
fast implementation is a plain fake object whose `can_reduce` answer the test chooses.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from actors.environment import options_from_environ
from parallel import comm
from parallel.groups import RankGroups, serve_rendezvous
from parallel.options import CommOptions, CommOptionsError, options_record
from parallel.symm_allreduce import SymmMemAllReduce, SymmMemError
from parallel.symm_setup import try_create_for_group
from parallel.topology import Topology


class FakeFast:
    """Doubles its input into a new tensor when it accepts it; counts calls."""

    def __init__(self, accept: bool):
        self.accept = accept
        self.asked = 0
        self.reduced = 0

    def can_reduce(self, x: torch.Tensor) -> bool:
        self.asked += 1
        return self.accept

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.reduced += 1
        return x * 2


@pytest.fixture
def clean_registry():
    yield
    comm._FAST.clear()


@pytest.fixture
def gloo_world_one():
    if dist.is_initialized():
        pytest.skip("torch.distributed already initialised in this process")
    store, _ = serve_rendezvous(1, 30.0, host="127.0.0.1")
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        comm._FAST.clear()
        dist.destroy_process_group()


def test_no_registration_group_none_is_identity(clean_registry):
    x = torch.arange(4.0)
    assert comm.all_reduce(x, None) is x
    assert comm.fast_all_reduce(None) is None


def test_accepting_impl_returns_its_new_tensor(clean_registry):
    fake = FakeFast(accept=True)
    comm.register_fast_all_reduce(None, fake)
    x = torch.arange(4.0)
    got = comm.all_reduce(x, None)
    assert got is not x and torch.equal(got, torch.arange(4.0) * 2)
    assert torch.equal(x, torch.arange(4.0)), "input untouched by the fast path"
    assert (fake.asked, fake.reduced) == (1, 1)


def test_refusing_impl_falls_back(clean_registry):
    fake = FakeFast(accept=False)
    comm.register_fast_all_reduce(None, fake)
    x = torch.arange(4.0)
    assert comm.all_reduce(x, None) is x
    assert (fake.asked, fake.reduced) == (1, 0)


def test_clear_and_replace(clean_registry):
    first, second = FakeFast(True), FakeFast(True)
    comm.register_fast_all_reduce(None, first)
    comm.register_fast_all_reduce(None, second)
    assert comm.fast_all_reduce(None) is second
    assert comm.clear_fast_all_reduce(None) is second
    assert comm.clear_fast_all_reduce(None) is None
    x = torch.ones(2)
    assert comm.all_reduce(x, None) is x
    assert first.asked == second.asked == 0


def test_register_rejects_objects_without_the_protocol(clean_registry):
    with pytest.raises(TypeError):
        comm.register_fast_all_reduce(None, object())


def test_gloo_registry_is_keyed_by_group(gloo_world_one):
    world = gloo_world_one
    other = dist.new_group([0], backend="gloo")
    fake = FakeFast(accept=True)
    comm.register_fast_all_reduce(other, fake)
    x = torch.arange(3.0)
    assert comm.all_reduce(x, world) is x, "another group's impl must not be used"
    assert fake.asked == 0
    got = comm.all_reduce(x, other)
    assert torch.equal(got, x * 2) and fake.reduced == 1
    fake.accept = False
    assert comm.all_reduce(x, other) is x  # gloo group of one: the identity
    assert comm.clear_fast_all_reduce(other) is fake
    assert comm.fast_all_reduce(other) is None


def test_symm_create_declines_cleanly_on_cpu(gloo_world_one):
    impl, why = try_create_for_group(None, torch.device("cpu"))
    assert impl is None and "no process group" in why
    impl, why = try_create_for_group(gloo_world_one, torch.device("cpu"))
    assert impl is None and "not CUDA" in why
    with pytest.raises(SymmMemError):
        SymmMemAllReduce(gloo_world_one, torch.device("cpu"))


def test_tp_allreduce_mode_parsing():
    assert options_from_environ({}).comm.tp_allreduce == "auto"
    assert options_from_environ({"GRAPHLINE_TP_ALLREDUCE": " NCCL "}).comm.tp_allreduce == "nccl"
    assert options_from_environ({"GRAPHLINE_TP_ALLREDUCE": "symm"}).comm.tp_allreduce == "symm"
    with pytest.raises(CommOptionsError, match="GRAPHLINE_TP_ALLREDUCE"):
        options_from_environ({"GRAPHLINE_TP_ALLREDUCE": "fast"})
    with pytest.raises(CommOptionsError, match="GRAPHLINE_TP_ALLREDUCE='fast': expected one of auto, nccl, symm"):
        CommOptions(tp_allreduce="fast")
    assert RankGroups(Topology.of(tp=1), 0, torch.device("cpu"), 30.0, CommOptions(tp_allreduce="nccl")
                      ).tp_allreduce_mode == "nccl"


def test_bad_fused_kind_is_refused_before_any_group():
    with pytest.raises(ValueError, match="GRAPHLINE_TP_FUSED_KIND='sideways'"):
        options_from_environ({"GRAPHLINE_TP_FUSED_KIND": "sideways"})
    assert not dist.is_initialized()
    comm_opts = options_from_environ({"GRAPHLINE_TP_FUSED_KIND": "pull"}).comm
    assert RankGroups(Topology.of(tp=2), 0, torch.device("cpu"), 30.0, comm_opts).tp_fused_kind == "pull"
    with pytest.raises(ValueError, match="fused all-reduce kind 'sideways'"):
        try_create_for_group(None, torch.device("cpu"), fused_kind="sideways")


def test_comm_options_from_the_environment():
    opts = options_from_environ({"GRAPHLINE_TP_FUSED_NORM": "0", "GRAPHLINE_DEEPEP_MAX_TOKENS_PER_RANK": "64"}).comm
    assert opts == CommOptions(tp_fused_norm=False, deepep_max_tokens_per_rank=64)
    for name, raw in (("GRAPHLINE_TP_FUSED_NORM", "off"), ("GRAPHLINE_DEEPEP_MAX_TOKENS_PER_RANK", "many"),
                      ("GRAPHLINE_DEEPEP_MAX_TOKENS_PER_RANK", "0")):
        with pytest.raises(ValueError, match=name):
            options_from_environ({name: raw})


def test_one_rank_cross_checks_and_mismatches_name_field_and_ranks():
    from parallel.options import describe_mismatch

    a = options_record(comm=CommOptions())
    b = options_record(comm=CommOptions(tp_fused_kind="pull"))
    assert describe_mismatch([a, a]) == []
    assert describe_mismatch([a, b, b]) == ["comm.tp_fused_kind: rank 0 'push'; ranks 1, 2 'pull'"]


def test_rank_groups_records_the_tp_allreduce():
    if dist.is_initialized():
        pytest.skip("torch.distributed already initialised in this process")
    store, rv = serve_rendezvous(1, 30.0, host="127.0.0.1")
    groups = RankGroups(Topology.of(tp=1), 0, torch.device("cpu"), 30.0, CommOptions(tp_allreduce="symm"))
    groups.init(rv, store=store)
    try:
        info = groups.tp_allreduce_info()
        assert info["impl"] == "none" and info["mode"] == "symm"
        assert not comm._FAST
    finally:
        groups.destroy()
    assert not dist.is_initialized()


def test_pick_global_argmax_takes_the_lowest_index_on_ties():
    from parallel.layers import pick_global_argmax

    # 3 shards x 4 rows: shard maxima and their global indices (shard r covers [10 r, 10 r + 10))
    values = torch.tensor([[5.0, 1.0, 2.0, -1.0], [7.0, 1.0, 2.0, -3.0], [7.0, 0.5, 9.0, -1.0]])
    indices = torch.tensor([[3.0, 0.0, 9.0, 4.0], [12.0, 15.0, 11.0, 19.0], [21.0, 22.0, 29.0, 20.0]])
    got = pick_global_argmax(values, indices)
    assert got.dtype == torch.int64
    assert got.tolist() == [12, 0, 29, 4]
    full = torch.full((4, 30), -100.0)  # the same rows as whole logits: argmax agrees
    for r in range(3):
        for b in range(4):
            full[b, int(indices[r, b])] = values[r, b]
    assert full.argmax(dim=-1).tolist() == got.tolist()


def test_lm_head_greedy_equals_argmax_of_logits_on_one_rank():
    from parallel.context import ParallelContext
    from parallel.layers import ParallelLMHead

    head = ParallelLMHead(1000, 64, ParallelContext(), torch.float32)
    head.weight.data.copy_(torch.randn(1000, 64, generator=torch.Generator().manual_seed(0)))
    hidden = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    assert head.greedy(hidden).tolist() == head.logits(hidden).argmax(dim=-1).tolist()
