"""A deployment across two Ray nodes with default options (CPU, gloo): `ray.cluster_utils.Cluster` runs a head
and a second node (each its own raylet, one CPU each) on this machine, so the two TP ranks must land one per node.
TP=2 across the nodes equals one rank (tokens and logits); the default step path is one that can serve ranks on
other hosts; a rank killed on the second node is handled like one on the first (the step fails naming the rank,
`rebuild()` serves again with the same tokens)."""
from __future__ import annotations

import os
import signal
import time

import pytest

from actors.batch import StepBatch
from actors.coordinator import Coordinator, DeploymentConfig, RankFailureError
from tests.dist._helpers import (assert_prefill_logits_equal_reference, decode_script, run_scenario,
                                 runtime_cfg)

MODEL = "qwen3-tiny"
PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7], [100, 200, 300, 400, 17]]


@pytest.fixture(scope="module")
def two_nodes():
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, include_dashboard=False)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


@pytest.fixture(scope="module")
def tp2_across(two_nodes):
    # default step path ("auto") and default options but the small CPU model
    coord = Coordinator(DeploymentConfig(runtime=runtime_cfg(MODEL), tp=2, collective_timeout_s=30,
                                         step_timeout_s=30))
    coord.start(progress=False)
    yield coord
    coord.shutdown()


def _nodes_of(coord) -> list[str]:
    return [r["node_id"] for r in coord.status()["ranks"]]


def test_ranks_span_both_nodes_on_a_path_that_serves_them(tp2_across):
    coord = tp2_across
    nodes = _nodes_of(coord)
    assert len(set(nodes)) == 2, nodes
    assert coord.step_path == "plain"  # not the pipe path (same host only), not compiled graphs (a core each)


def test_tp2_across_nodes_equals_one_rank(tp2_across, reference):
    coord = tp2_across
    run_scenario(coord, reference, decode_script(1, PROMPTS, steps=6))
    assert_prefill_logits_equal_reference(coord, reference)


@pytest.mark.parametrize("node", [1, 0], ids=["second-node", "first-node"])
def test_rank_killed_on_either_node_fails_the_step_then_rebuild_serves(tp2_across, reference, node):
    coord = tp2_across
    st = coord.status()
    # rank order is by node id: find the rank on the requested node (0: the node of rank 0, 1: the other one)
    node_ids = sorted({r["node_id"] for r in st["ranks"]})
    victim = next(r for r in st["ranks"] if r["node_id"] == node_ids[node])
    b = StepBatch.from_sequences([[1, 2, 3]], [0], [[60]])
    os.kill(int(victim["pid"]), signal.SIGKILL)
    t0 = time.monotonic()
    try:  # the death is named first, before any peer's collective error it caused
        with pytest.raises(RankFailureError, match=f"step failed: rank {victim['rank']} died"):
            coord.step([b])
        assert time.monotonic() - t0 < 30
    finally:  # the next case starts from a serving group whatever this one saw
        coord.rebuild()
    assert len(set(_nodes_of(coord))) == 2
    run_scenario(coord, reference, decode_script(1, PROMPTS[:2], steps=3))


def test_cpu_ranks_import_no_gpu_kernel_module(tp2_across):
    """A CPU rank never imports Triton or a Triton kernel module, even where triton is installed."""
    import ray

    def gpu_modules(_actor) -> list[str]:
        import sys

        return sorted(m for m in sys.modules if m == "triton" or m.startswith(("triton.", "modeling.ops.triton_", "modeling.sampler.triton_")))

    coord = tp2_across
    assert ray.get([w.__ray_call__.remote(gpu_modules) for w in coord._ranks.workers], timeout=60) == [[], []]
