"""`bench.dist_bench.tp_ratios`: TP=2 over TP=1 for every point both runs measured, for every (TP=2 run, TP=1 run)
pair (armed and not on each side), per measure present in both; nothing without a TP=2 run."""
import pytest

from bench.dist_bench import tp_ratios


def _run(tp, wait, **points):
    return {"tp": tp, "armed_wait_ms": wait, "decode": points}


def test_each_tp1_run_is_a_baseline():
    runs = [
        _run(1, 20.0, **{"pipe:b64": {"in_rank_ms": 2.0, "e2e_ms": 2.5, "ahead_ms": 1.6}}),
        _run(1, 0.0, **{"pipe:b64": {"in_rank_ms": 1.8, "e2e_ms": 2.0, "ahead_ms": 1.6},
                        "pipe:b1": {"in_rank_ms": 1.0, "e2e_ms": 1.2}}),
        _run(2, 20.0, **{"pipe:b64": {"in_rank_ms": 1.8, "e2e_ms": 2.0, "ahead_ms": 1.2}}),
    ]
    got = tp_ratios(runs)
    assert [(r["tp2_armed_wait_ms"], r["tp1_armed_wait_ms"], r["point"]) for r in got] == [
        (20.0, 20.0, "pipe:b64"), (20.0, 0.0, "pipe:b64")]
    assert got[0]["in_rank"] == pytest.approx(0.9) and got[0]["e2e"] == pytest.approx(0.8)
    assert got[1]["in_rank"] == pytest.approx(1.0) and got[1]["ahead"] == pytest.approx(0.75)
    runs.append(_run(2, 0.0, **{"pipe:b64": {"in_rank_ms": 2.0, "e2e_ms": 2.2}}))
    got = tp_ratios(runs)
    assert [(r["tp2_armed_wait_ms"], r["tp1_armed_wait_ms"]) for r in got] == [(20.0, 20.0), (20.0, 0.0),
                                                                               (0.0, 20.0), (0.0, 0.0)]
    assert got[3]["in_rank"] == pytest.approx(2.0 / 1.8) and "ahead" not in got[3]


def test_missing_measures_and_runs_are_left_out():
    runs = [_run(1, None, **{"pipe:b1": {"in_rank_ms": 1.0, "e2e_ms": 1.2}}),
            _run(2, None, **{"pipe:b1": {"in_rank_ms": 1.5, "e2e_ms": 1.8, "ahead_ms": 1.4}})]
    (row,) = tp_ratios(runs)
    assert set(row) == {"tp1_armed_wait_ms", "tp2_armed_wait_ms", "point", "in_rank", "e2e"}
    assert tp_ratios(runs[:1]) == []
