"""Coordinator on Ray + gloo (CPU, 2 ranks, dense qwen3-tiny): TP=2 and DP=2 equal one rank,
the lock-step capture and reset protocols, a rank killed mid-step, a failed start-up capture."""
import dataclasses
import json
import threading
import time

import numpy as np
import pytest

from actors.batch import BatchError, StepBatch, prev_token
from actors.coordinator import (MAX_IN_FLIGHT, Coordinator, CoordinatorStateError, DeploymentConfig,
                                RankFailureError, StartupCaptureError, StepTicket)
from tests.dist._helpers import (BLOCK, assert_prefill_logits_equal_reference, decode_script,
                                 greedy_with_and_without_logits_observer, run_scenario, run_submitted_ahead,
                                 runtime_cfg)

MODEL = "qwen3-tiny"
PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7], [100, 200, 300, 400, 17], [5] * 20]




@pytest.fixture
def tp2(cache):
    cfg = DeploymentConfig(runtime=runtime_cfg("qwen3-tiny"), tp=2, collective_timeout_s=20, step_timeout_s=20)
    c = cache.get("tp2", cfg)
    return c, cache.timings


def test_state_errors_and_config_validation(ray_mod):
    with pytest.raises(ValueError, match="ep must be 1"):
        DeploymentConfig(tp=2, dp=2, ep=2 + 1)
    with pytest.raises(ValueError, match="ep_backend"):
        DeploymentConfig(ep_backend="nccl")
    c = Coordinator(DeploymentConfig(runtime=runtime_cfg(), tp=2))
    with pytest.raises(CoordinatorStateError, match="call start"):
        c.step([None])


def test_tp2_greedy_and_logits_equal_tp1(tp2, reference):
    coord, timings = tp2
    for k in ("ray_s", "groups_s", "weights_s", "kv_s", "runner_s", "capture_s", "per_bucket"):
        assert k in timings
    assert coord.step_path == "pipe"  # the one-host default (compiled and plain are covered in test_ep.py)
    run_scenario(coord, reference, decode_script(1, PROMPTS, steps=12))
    # logits (full vocab, all-gathered over TP) of one prefill step equal one rank's
    assert_prefill_logits_equal_reference(coord, reference)


def test_bad_batch_is_rejected_before_any_rank_runs(tp2):
    coord, _ = tp2
    steps = coord.status()["steps"]
    bad = StepBatch.from_sequences([[1, 2, 3]], [0], [[10_000]])
    with pytest.raises(BatchError, match="DP rank 0: a block id"):
        coord.step([bad])
    with pytest.raises(ValueError, match="one batch"):
        coord.step([bad, bad])
    assert coord.status()["steps"] == steps and coord.status()["state"] == "serving"


def test_startup_capture_is_lock_step_in_the_same_order(tp2):
    coord, timings = tp2
    logs = coord.event_logs()
    decode, prefill = coord._sizes
    want = [f"decode:{b}" for b in decode] + [f"prefill:{t}" for t in prefill]
    assert [k for k in timings["per_bucket"]] == want
    starts = {r: [e for e in ev if e["kind"] == "capture_start"][: len(want)] for r, ev in logs.items()}
    ends = {r: [e for e in ev if e["kind"] == "capture_end"][: len(want)] for r, ev in logs.items()}
    assert sorted(logs) == [0, 1]
    for r in logs:
        assert [e["bucket"] for e in starts[r]] == want
        assert [e["bucket"] for e in ends[r]] == want
    for i in range(len(want) - 1):  # every rank finished bucket i before any rank started bucket i + 1
        assert max(ends[r][i]["t"] for r in logs) <= min(starts[r][i + 1]["t"] for r in logs)


def test_reset_order_then_recapture_serves(tp2, reference):
    coord, _ = tp2
    out = coord.reset(recapture=True, num_kv_blocks=48, reload_weights=True)
    for r in (0, 1):
        assert out["events"][r] == ["reset_graphs", "reset_deepep", "reset_barrier"]
    logs = coord.event_logs()
    resets = {r: [e for e in ev if e["kind"].startswith("reset_")][-3:] for r, ev in logs.items()}
    for r, ev in resets.items():
        assert "skipped" in ev[1]["status"] and "deep_ep" in ev[1]["status"] or ev[1]["status"] == "destroyed"
        assert ev[0]["t"] <= ev[1]["t"] <= ev[2]["t"]
    # the barrier: nobody left it before everybody destroyed its DeepEP buffer
    assert min(ev[2]["t"] for ev in resets.values()) >= max(ev[1]["t"] for ev in resets.values())
    assert coord.num_kv_blocks == 48 and "capture_s" in out and "weights_s" in out and "kv_s" in out
    st = coord.status()
    json.dumps(st)
    assert st["resets"] == 1 and st["last_reset_events"]["1"][-1] == "reset_barrier"
    for rk in st["ranks"]:
        assert rk["alive"] and rk["runner"] is not None and rk["kv_blocks"] == 48  # reload rebuilt the runner
    run_scenario(coord, reference, decode_script(1, PROMPTS[:2], steps=3))


@pytest.fixture
def dp2(cache):
    cfg = DeploymentConfig(runtime=runtime_cfg("qwen3-tiny"), dp=2, collective_timeout_s=20, step_timeout_s=20)
    return cache.get("dp2", cfg)


def test_dp2_different_batches_equal_one_rank_each(dp2, reference):
    script = decode_script(2, PROMPTS, steps=4)
    script.append([[("dec", "d0s0")], None])  # DP rank 1 idle: without EP it does not run at all
    script.append([None, [("dec", "d1s1"), ("new", "late", [7, 7, 7])]])
    run_scenario(dp2, reference, script)
    assert dp2.status()["last_phase"] == "local"


def test_multi_step_decode_equals_single_steps(dp2, reference):
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8]]
    tables = [[30, 31, 32], [33, 34, 35]]
    pre = [StepBatch.from_sequences([p], [0], [t]) for p, t in zip(prompts, tables)]
    first = dp2.step(pre)
    dec = [StepBatch.from_sequences([[int(f[0])]], [len(p)], [t]) for f, p, t in zip(first, prompts, tables)]
    got = dp2.step(dec, num_steps=5)
    assert dp2.status()["last_phase"] == "local"
    for d in range(2):
        assert got[d].shape == (1, 5)
        want, b = [], pre[d]
        reference.execute(b)
        b = dec[d]
        for _ in range(5):
            tok = int(reference.execute(b)[0])
            want.append(tok)
            b = StepBatch.from_sequences([[tok]], [int(b.num_history[0]) + 1], [tables[d]])
        assert got[d][0].tolist() == want
    with pytest.raises(BatchError, match="DP rank 1: multi-step decode needs a decode batch"):
        dp2.step([dec[0], pre[1]], num_steps=2)
    short = StepBatch.from_sequences([[1]], [BLOCK - 1], [[30]])
    with pytest.raises(BatchError, match="DP rank 0: a block table is too short for 2 decode steps"):
        dp2.step([short, None], num_steps=2)
    with pytest.raises(ValueError, match="GRAPHLINE_STEP_PATH must be one of"):
        dp2._switch_step_path("bogus")
    assert dp2.step_path == "pipe" and dp2.step(dec)[0].shape == (1,)  # the live step path was kept


def test_tp2_steps_submitted_ahead_with_previous_step_references_equal_one_rank(tp2, reference):
    coord, _ = tp2
    gen = run_submitted_ahead(coord, reference, [PROMPTS[:3]], steps=6)
    assert all(len(g) == 7 for g in gen[0])
    assert coord.status()["steps"] > 0


def test_tp2_disarm_frames_between_arm_next_steps_keep_every_reply_in_order(tp2, reference, monkeypatch):
    """The driver side of collective arming on the real pipe path: strict steps carry `arm_next`, and a disarm frame
    goes to every rank whenever the driver stays idle past `disarm_after_s` after one, racing the next step's
    requests (one lock orders them). A rank answering a disarm, or reading it as a step, would shift every later
    reply (CPU ranks never arm: the frames only have to be consumed)."""
    coord, _ = tp2
    monkeypatch.setattr(Coordinator, "_arms_collectively", property(lambda self: True))
    stepper = coord._stepper
    monkeypatch.setattr(stepper, "disarm_after_s", 0.0005)
    sent = []
    real_send = stepper.send
    monkeypatch.setattr(stepper, "send", lambda plan: (sent.append(plan.arm_next), real_send(plan))[1])
    before = stepper.disarms_sent
    run_scenario(coord, reference, decode_script(1, PROMPTS, steps=6))
    deadline = time.monotonic() + 5  # the driver idle after the scenario's last strict step: a disarm follows (the
    while stepper.disarms_sent == before and time.monotonic() < deadline:  # scenario's own gaps may all be short)
        time.sleep(0.005)
    ticket = coord.submit([StepBatch.from_sequences([[7, 7]], [0], [[50]])])  # not strict: no arm_next
    coord.collect(ticket)
    assert sent[:-1] and all(sent[:-1]) and sent[-1] is False
    assert stepper.disarms_sent > before
    time.sleep(0.05)  # a disarm after the last strict step, then a step
    run_scenario(coord, reference, decode_script(1, PROMPTS[:1], steps=2))


def test_tp2_greedy_head_equals_the_logits_head(tp2):
    """Without a logits observer greedy steps take the greedy LM head (per-shard argmax, one (value, index)
    exchange over gloo); with one, the gathered fp32 logits. The same batches give the same tokens."""
    coord, _ = tp2
    tables = [[1 + 4 * i + k for k in range(4)] for i in range(len(PROMPTS))]
    runs = greedy_with_and_without_logits_observer(coord, PROMPTS, tables, steps=8, timeout_s=30)
    assert runs[0] == runs[1]


def test_an_engine_going_idle_disarms_every_rank_once_and_later_requests_still_equal_one_rank(dp2, reference):
    """Whenever a step leaves the engine nothing to run, `Coordinator.idle` sends every rank a disarm frame at once
    (on GPUs a rank armed behind its last decode step cancels it while nothing waits, instead of the next request
    waiting behind that padded replay; CPU ranks never arm and only consume the frame): one per idle transition,
    and the requests after it are answered in order, equal to the single rank."""
    from engine import EngineConfig, LLMEngine, SamplingParams

    eng = LLMEngine(dp2, EngineConfig(max_num_seqs=8))
    greedy = SamplingParams(temperature=0.0)
    before = dp2._stepper.disarms_sent
    first = [o.token_ids for o in eng.generate(PROMPTS[:2], greedy, max_tokens=5)]
    assert dp2._stepper.disarms_sent == before + 1
    again = [o.token_ids for o in eng.generate(PROMPTS[:2], greedy, max_tokens=5)]
    assert dp2._stepper.disarms_sent == before + 2 and again == first
    for prompt, got in zip(PROMPTS[:2], first):
        table = [40, 41, 42, 43]
        want, b = [], StepBatch.from_sequences([prompt], [0], [table])
        for _ in range(5):
            tok = int(reference.execute(b)[0])
            want.append(tok)
            b = StepBatch.from_sequences([[tok]], [len(prompt) + len(want) - 1], [table])
        assert list(got) == want


def test_dp2_submitted_ahead_gathers_permuted_references(dp2, reference):
    run_submitted_ahead(dp2, reference, [PROMPTS[:2], PROMPTS[2:]], steps=5, permute=True)


def test_submit_ahead_rejects_bad_references_and_misuse(dp2):
    coord = dp2
    coord.reset()  # the ranks drop their previous-step tokens: nothing to refer to
    ref = StepBatch.from_sequences([[prev_token(0)]], [3], [[50]])
    with pytest.raises(BatchError, match="DP rank 0: token ids must be in .*there is none"):
        coord.submit([ref, None])
    pre = StepBatch.from_sequences([[1, 2, 3]], [0], [[50]])
    t = coord.submit([pre, None])
    beyond = StepBatch.from_sequences([[prev_token(1)]], [3], [[50]])
    with pytest.raises(BatchError, match="DP rank 0: token id -2 refers to row 1 of the previous step, which had 1"):
        coord.submit([beyond, None])
    with pytest.raises(BatchError, match="DP rank 1: token ids must be in"):  # DP rank 1 ran nothing since reset
        coord.submit([None, ref])
    t2 = coord.submit([ref, None])
    assert MAX_IN_FLIGHT == 2
    with pytest.raises(CoordinatorStateError, match="2 steps are in flight"):
        coord.submit([StepBatch.from_sequences([[prev_token(0)]], [4], [[50]]), None])
    with pytest.raises(CoordinatorStateError, match="collect\\(\\) the oldest submitted step first"):
        coord.collect(t2)
    first = coord.collect(t)[0]
    second = coord.collect(t2)[0]
    with pytest.raises(CoordinatorStateError, match="not in flight"):
        coord.collect(StepTicket(None, (True, False)))
    # the same two steps through the host: the reference is the previous step's token
    coord.reset()
    again = coord.step([pre, None])[0]
    assert again.tolist() == first.tolist()
    assert coord.step([StepBatch.from_sequences([[int(first[0])]], [3], [[50]]), None])[0].tolist() == second.tolist()
    # a reset drains what is in flight; the tickets keep their tokens
    t3 = coord.submit([StepBatch.from_sequences([[prev_token(0)]], [4], [[50]]), None])
    idle = coord.submit([None, None])
    coord.reset()
    assert coord.collect(t3)[0].shape == (1,)
    assert coord.collect(idle) == [None, None]  # a drained step where every DP rank was idle


def test_polling_driver_gives_the_same_tokens_and_learns_step_shapes(dp2, reference):
    from actors.options import DriverOptions

    cfg = dp2.cfg
    dp2.cfg = dataclasses.replace(cfg, driver=DriverOptions(poll_s=0.002))  # CPU ranks block by default: poll
    dp2._switch_step_path("pipe")
    try:
        assert dp2._stepper.poll_s == 0.002
        run_scenario(dp2, reference, decode_script(2, PROMPTS[:2], steps=3))
        shapes = dp2._stepper._expected
        assert shapes and all(0.0 < s < 20.0 for s in shapes.values())
        assert {k[0] for k in shapes} == {"local"} and any(k[3] == ((1, 1), (1, 1)) for k in shapes)
    finally:
        dp2.cfg = cfg
        dp2._switch_step_path("pipe")
    assert dp2._stepper.poll_s == 0.0


def test_rank_killed_mid_step_raises_then_rebuild_serves(dp2, reference):
    import ray

    coord = dp2
    victim = coord._ranks.workers[1]
    ray.get(victim._test_set_faults.remote(step_delay_s=3.0), timeout=30)
    b = StepBatch.from_sequences([[1, 2, 3]], [0], [[60]])

    def killer():
        time.sleep(1.0)
        ray.kill(victim, no_restart=True)

    threading.Thread(target=killer, daemon=True).start()
    t0 = time.monotonic()
    with pytest.raises(RankFailureError, match="rank 1 died"):
        coord.step([b, b])
    assert time.monotonic() - t0 < 30
    st = coord.status()
    assert st["state"] == "failed" and st["failures"] == 1 and "rank 1" in st["last_failure"]
    with pytest.raises(CoordinatorStateError, match="rebuild"):
        coord.step([b, b])
    coord.rebuild()
    assert coord.status()["state"] == "serving"
    run_scenario(coord, reference, decode_script(2, PROMPTS[:2], steps=2))


def test_rank_error_and_hang_on_the_pipe_path_raise_then_rebuild(dp2, reference):
    import ray

    coord = dp2
    assert coord.step_path == "pipe"
    b = StepBatch.from_sequences([[1, 2, 3]], [0], [[60]])
    steps = coord._ranks.probe()[1]["steps"]
    ray.get(coord._ranks.workers[1]._test_set_faults.remote(raise_in_step=steps + 1), timeout=30)
    with pytest.raises(RankFailureError, match="rank 1 error: .*injected failure in step"):
        coord.step([b, b])
    coord.rebuild()
    ray.get(coord._ranks.workers[0]._test_set_faults.remote(hang_in_step=1), timeout=30)
    coord.cfg = dataclasses.replace(coord.cfg, step_timeout_s=3.0)
    t0 = time.monotonic()
    with pytest.raises(RankFailureError, match="rank 0 hung: no answer after 3.0s; alive, in 'execute'"):
        coord.step([b, b])
    assert time.monotonic() - t0 < 15
    coord.cfg = dataclasses.replace(coord.cfg, step_timeout_s=20.0)
    coord.rebuild()
    run_scenario(coord, reference, decode_script(2, PROMPTS[:2], steps=2))


def test_failed_startup_capture_aborts_every_rank(cache):
    cache.close()
    c = Coordinator(DeploymentConfig(runtime=runtime_cfg("qwen3-tiny"), tp=2, collective_timeout_s=4,
                                     step_timeout_s=10))
    c._test_faults = {1: {"fail_capture_at": 2}}
    try:
        with pytest.raises(StartupCaptureError, match="rank 1 error.*injected failure.*nothing published"):
            c.start(progress=False)
        st = c.status()
        assert st["state"] == "failed"
        for rk in st["ranks"]:
            assert rk["alive"]
            assert rk["capture"]["decode"] == {} and rk["capture"]["prefill"] == {}
            assert rk["runner"]["captured_decode"] == 0 and rk["runner"]["captured_prefill"] == 0
        logs = c.event_logs()
        for r, ev in logs.items():
            kinds = [e["kind"] for e in ev]
            assert kinds[-1] == "capture_aborted" and "capture_failed" in kinds
        with pytest.raises(CoordinatorStateError):
            c.step([None])
    finally:
        c.shutdown()


def test_ranks_with_different_options_fail_before_any_collective(cache):
    """Every rank cross-checks its kernel and communication options over the gloo control group right after it
    exists (`RankGroups.init`), before any other group or collective: rank 1 holding other kernel options (the
    worker's test override) stops the start-up with an error naming each field and the ranks."""
    from modeling.ops.options import KernelOptions

    cache.close()
    c = Coordinator(DeploymentConfig(runtime=runtime_cfg("qwen3-tiny"), tp=2, collective_timeout_s=10,
                                     step_timeout_s=10))
    c._test_faults = {1: {"kernels_override": KernelOptions(pdl="0", gemv=False)}}
    try:
        with pytest.raises(RankFailureError, match=r"start-up failed: .*OptionsMismatchError: the ranks hold "
                                                   r"different options.*kernels\.gemv: rank 0 True; rank 1 False \| "
                                                   r"kernels\.pdl: rank 0 'early'; rank 1 '0'"):
            c.start(progress=False)
        assert c.status()["state"] == "failed"
    finally:
        c.shutdown()


def test_tp2_sampled_rows_draw_the_same_token_on_both_ranks_and_equal_one_rank(tp2, reference):
    """Seeded sampling (temperature, top-p, top-k, penalties, logprobs) under TP=2: both ranks hold the same
    tokens (the driver's seeds, counter-based noise), equal to one rank's, each rank sampling its own vocabulary
    shard's logits (the sampler's collectives combine statistics, never the logits)."""
    import ray

    from actors.batch import SampledTokens, SamplerExtras

    coord, _ = tp2
    b = StepBatch.from_sequences([[1, 2, 3, 4], [9, 8, 7]], [0, 0], [[44], [45]], temperature=[1.0, 0.7],
                                 top_k=[0, 40], top_p=[0.9, 1.0], seeds=[123, 2**62 + 7])
    outs = coord.step([b])[0]

    def last(actor) -> list:
        return actor.runtime._last_tokens.tolist()

    per_rank = ray.get([w.__ray_call__.remote(last) for w in coord._ranks.workers], timeout=60)
    assert per_rank[0] == per_rank[1] == outs.tolist() == reference.execute(b).tolist()

    def shard(actor) -> tuple:  # each rank sampled its own vocabulary shard (no fp32 logits gathered)
        sh = actor.runtime.sampler().shard
        return sh.offset, sh.width, actor.runtime.model_config.vocab_size

    shards = ray.get([w.__ray_call__.remote(shard) for w in coord._ranks.workers], timeout=60)
    assert shards[0][0] == 0 and shards[1][0] == shards[0][1] and shards[0][1] + shards[1][1] == shards[0][2]
    ex = SamplerExtras(min_p=np.array([0.05, 0.0], np.float32), penalties=np.array([[0.5, 0.2, 1.3], [0, 0, 1]],
                                                                                     np.float32),
                       bias_ids=np.array([[5], [-1]], np.int32), bias_vals=np.array([[3.0], [0.0]], np.float32),
                       ban_ids=np.array([[-1], [2]], np.int32), pen_ids=np.array([[1, 2, 3, 4], [-1, -1, -1, -1]],
                                                                                 np.int32),
                       pen_counts=np.zeros((2, 4), np.int32), num_logprobs=3)
    b2 = StepBatch.from_sequences([[1, 2, 3, 4], [9, 8, 7]], [0, 0], [[46], [47]], temperature=[1.0, 0.0],
                                  seeds=[5, -1])
    b2.extras = ex
    got = coord.step([b2])[0]
    want = reference.execute(b2)
    assert isinstance(got, SampledTokens) and isinstance(want, SampledTokens)
    per_rank = ray.get([w.__ray_call__.remote(last) for w in coord._ranks.workers], timeout=60)
    assert per_rank[0] == per_rank[1] == got.tokens.tolist() == want.tokens.tolist()
    np.testing.assert_allclose(got.logprobs.chosen, want.logprobs.chosen, atol=1e-4)
    assert got.logprobs.top_ids.tolist() == want.logprobs.top_ids.tolist()


def test_tp2_prompt_logprobs_over_the_pipe_equal_one_rank(tp2, reference):
    """A step asking for prompt log-probabilities (`StepBatch.prompt_lp`) under TP=2 on the pipe path: the ask
    crosses the wire to both ranks, each gathers the logits of the asked rows in lock-step, and TP rank 0's answer
    equals one rank's, beside the step's own logprobs."""
    from actors.batch import SampledTokens, SamplerExtras
    from actors.prompt_logprobs import PromptLogprobsAsk

    coord, _ = tp2
    b = StepBatch.from_sequences([[1, 2, 3, 4, 5], [9, 8, 7]], [0, 0], [[48], [49]], temperature=[0.0, 1.0],
                                 seeds=[-1, 11])
    b.prompt_lp = PromptLogprobsAsk(np.array([0, 1, 2, 3, 5, 6], np.int64), np.array([2, 3, 4, 5, 8, 7], np.int64), 3)
    for extras in (None, SamplerExtras.off(2, 2)):
        b.extras = extras
        got, want = coord.step([b])[0], reference.execute(b)
        assert isinstance(got, SampledTokens) and got.tokens.tolist() == want.tokens.tolist()
        assert (got.logprobs is None) == (extras is None)
        np.testing.assert_allclose(got.prompt.chosen, want.prompt.chosen, atol=1e-4)
        assert got.prompt.ranks.tolist() == want.prompt.ranks.tolist()
        assert got.prompt.top_ids.tolist() == want.prompt.top_ids.tolist() and got.prompt.top_ids.shape == (6, 3)
        np.testing.assert_allclose(got.prompt.top_logprobs, want.prompt.top_logprobs, atol=1e-4)
