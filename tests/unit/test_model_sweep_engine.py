"""`bench.model_sweep.engine_decode` (the sweep's decode steps through the engine) runs on CPU with qwen3-tiny over
the local executor: every batch gets a step time from decode-only steps, and requests decode to their length. A
check that the benchmark keeps working, not a timing."""
from bench.model_sweep import engine_decode


def test_engine_decode_reports_every_batch():
    rows = engine_decode("qwen3-tiny", [1, 4], context=24, steps=12, device="cpu")
    assert [r["batch"] for r in rows] == [1, 4]
    for r in rows:
        assert r["context"] == 24 and r["engine_step_s"] > 0
        # 12 tokens: the first from the prefill step, 11 decode-only steps, the first quarter left out
        assert r["steps"] == 11 - 11 // 4
