"""`bench.model_sweep.engine_runs` (the sweep's decode steps and first tokens through the engine) runs on CPU with
qwen3-tiny over the local executor: every batch gets a step time from decode-only steps, requests decode to their
length, and every prompt length gets a first-token time. A check that the benchmark keeps working, not a timing."""
from bench.model_sweep import engine_runs


def test_engine_runs_report_every_batch_and_prompt_length():
    runs = engine_runs("qwen3-tiny", [1, 4], context=24, steps=12, ttft_tokens=(40, 90), repeats=2, device="cpu")
    assert [r["batch"] for r in runs["decode"]] == [1, 4]
    for r in runs["decode"]:
        assert r["context"] == 24 and r["engine_step_s"] > 0
        # 12 tokens: the first from the prefill step, 11 decode-only steps, the first quarter left out
        assert r["steps"] == 11 - 11 // 4
    assert [(r["tokens"], r["repeats"]) for r in runs["ttft"]] == [(40, 2), (90, 2)]
    assert all(r["ttft_s"] > 0 for r in runs["ttft"])
