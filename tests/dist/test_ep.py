"""Expert parallelism on Ray + gloo (CPU, 2 ranks, qwen3-moe-tiny) and placement with fake GPUs.

The Ray session advertises 2 fake GPUs, and a coordinator with `use_gpu=True` places its ranks on
`{"GPU": 1, "CPU": 1}` bundles (ordered by GPU id) and steps through a Ray compiled graph; the models still
run on CPU (`device="cpu"`; with `use_gpu=None` a `device="cpu"` deployment claims no GPU).
"""
import time

import numpy as np
import pytest

from actors.batch import StepBatch
from actors.coordinator import DeploymentConfig, RankFailureError
from actors.placement import ActorPlace, order_ranks
from actors.protocol import StepHints, plan_step
from tests.dist._helpers import decode_script, run_scenario, runtime_cfg

MODEL = "qwen3-moe-tiny"
FAKE_GPUS = 2
PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7], [100, 200, 300, 400, 17], [5] * 20]

MIXED = [
    [[("new", "a0", PROMPTS[0])], [("new", "b0", PROMPTS[1])]],  # global prefill
    [[("dec", "a0")], [("dec", "b0"), ("new", "b1", PROMPTS[2])]],  # DP0 decodes inside a global prefill
    [[("dec", "a0"), ("new", "a1", PROMPTS[3])], [("dec", "b0"), ("dec", "b1")]],  # DP1 decodes, DP0 prefills
    [[("dec", "a0"), ("dec", "a1")], [("dec", "b0"), ("dec", "b1")]],  # global decode
    [[("dec", "a0")], None],  # decode, DP1 idle (dummy decode of the bucket)
    [None, [("new", "b2", [4, 4, 4, 4])]],  # prefill, DP0 idle (dummy prefill of the token bucket)
    [[("dec", "a0"), ("dec", "a1")], [("dec", "b2")]],
    [[("dec", "a0"), ("dec", "a1")], [("dec", "b2"), ("dec", "b1")]],
]


def test_order_ranks_by_node_then_gpu():
    places = [ActorPlace(0, "n2", "ip", ("1",), 10), ActorPlace(1, "n1", "ip", ("3",), 11),
              ActorPlace(2, "n1", "ip", ("0",), 12), ActorPlace(3, "n2", "ip", ("0",), 13)]
    assert order_ranks(places) == [2, 1, 3, 0]


def test_plan_step_phases():
    d = StepBatch.from_sequences([[1], [2], [3]], [4, 4, 4], [[1], [2], [3]])
    p = StepBatch.from_sequences([[1, 2, 3, 4, 5]], [0], [[1]])
    kw = dict(decode_buckets=[1, 2, 4, 8], token_buckets=[32, 64])
    assert plan_step([None, None], cross_dp=True, **kw) is None
    dec = plan_step([d, None], cross_dp=True, **kw)
    assert (dec.phase, dec.hints, dec.static_tokens, dec.run_idle) == ("decode", StepHints(True, 4, 0), 4, True)
    assert dec.rank_args(1) == (None, StepHints(True, batch_bucket=4))  # the idle rank's dummy decode
    mix = plan_step([d, p], cross_dp=True, **kw)
    assert (mix.phase, mix.hints, mix.static_tokens) == ("mixed", StepHints(False, token_bucket=32), None)
    assert mix.rank_args(0) == (d, StepHints(False, 0, 32))
    loc = plan_step([d, None], cross_dp=False, **kw)
    assert loc.hints == StepHints() and loc.hints.global_decode is None and loc.rank_args(1) is None
    assert loc.rank_args(0) == (d, StepHints())
    big = plan_step([StepBatch.from_sequences([[1]] * 9, [1] * 9, [[1]] * 9)], cross_dp=True, **kw)
    assert big.hints.batch_bucket == 9




def test_ep2_tp2_moe_equals_ep1(cache, reference):
    cfg = DeploymentConfig(runtime=runtime_cfg("qwen3-moe-tiny"), tp=2, ep=2, use_gpu=False,
                           collective_timeout_s=20, step_timeout_s=20, step_path="plain")
    coord = cache.get("tp2ep2", cfg)
    assert coord.step_path == "plain"
    run_scenario(coord, reference, decode_script(1, PROMPTS, steps=6))


def test_dense_model_with_ep_is_rejected(cache):
    from actors.coordinator import Coordinator

    cache.close()
    c = Coordinator(DeploymentConfig(runtime=runtime_cfg("qwen3-tiny"), dp=2, ep=2, use_gpu=False))
    with pytest.raises(ValueError, match="needs a MoE model"):
        c.start(progress=False)
    c.shutdown()


@pytest.fixture
def dp2ep2(cache):
    cfg = DeploymentConfig(runtime=runtime_cfg("qwen3-moe-tiny"), dp=2, ep=2, use_gpu=True, collective_timeout_s=20,
                           step_timeout_s=8, step_path="compiled")
    return cache.get("dp2ep2", cfg)


def test_dp2_ep2_mixed_local_phases_equal_one_rank(dp2ep2, reference):
    coord = dp2ep2
    assert coord.step_path == "compiled"  # chosen explicitly here (fake GPUs); pipe is the one-host default
    run_scenario(coord, reference, MIXED)
    st = coord.status()
    assert set(st["phases"]) == {"prefill", "mixed", "decode"}
    gpu_ids = [rk["gpu_ids"] for rk in st["ranks"]]
    assert sorted(gpu_ids) == gpu_ids and all(len(g) == 1 for g in gpu_ids)
    assert st["overhead"]["driver_step_ms_mean"] >= st["overhead"]["in_rank_step_ms_mean"] > 0


def test_multi_step_decode_across_ep_with_an_idle_dp_rank(dp2ep2, reference):
    """Collectives cross DP groups: the idle DP rank runs the same number of dummy decode steps, and the
    active rank's tokens equal single steps on one rank."""
    prompt, table = [11, 12, 13, 14, 15], [40, 41]
    first = dp2ep2.step([StepBatch.from_sequences([prompt], [0], [table]), None])[0]
    dec = StepBatch.from_sequences([[int(first[0])]], [len(prompt)], [table])
    got = dp2ep2.step([dec, None], num_steps=4)
    assert got[1] is None and got[0].shape == (1, 4)
    assert dp2ep2.status()["last_phase"] == "decode"
    reference.execute(StepBatch.from_sequences([prompt], [0], [table]))
    b, want = dec, []
    for _ in range(4):
        tok = int(reference.execute(b)[0])
        want.append(tok)
        b = StepBatch.from_sequences([[tok]], [int(b.num_history[0]) + 1], [table])
    assert got[0][0].tolist() == want


def test_hung_rank_raises_within_30s_then_rebuild_serves(dp2ep2, reference):
    import ray

    coord = dp2ep2
    ray.get(coord._ranks.workers[1]._test_set_faults.remote(hang_in_step=coord._ranks.probe()[1]["steps"] + 1),
            timeout=30)
    b = StepBatch.from_sequences([[1, 2, 3]], [0], [[60]])
    t0 = time.monotonic()
    with pytest.raises(RankFailureError, match="rank 1 hung"):
        coord.step([b, b])
    assert time.monotonic() - t0 < 30
    assert coord.status()["state"] == "failed"
    coord.rebuild()
    assert coord.step_path == "compiled"
    run_scenario(coord, reference, MIXED[:4])
    np.testing.assert_equal(coord.status()["failures"], 1)
