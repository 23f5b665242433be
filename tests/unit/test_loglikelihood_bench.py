"""`bench.loglikelihood_bench` runs end to end on CPU (qwen3-tiny, the local executor, one server on 127.0.0.1) and
reports both modes and their ratios; its response check rejects a loglikelihood answer without prompt logprobs."""
import json

import pytest

from bench.loglikelihood_bench import check, main, make_prompts


def test_loglikelihood_bench_reports_both_modes(tmp_path):
    out = tmp_path / "ll.json"
    r = main(["--model", "qwen3-tiny", "--executor", "local", "--concurrency", "1", "--requests-per-client", "2",
              "--prompts-per-request", "2", "--prompt-len", "16", "--max-model-len", "64", "--server-arg=--device",
              "--server-arg=cpu", "--startup-timeout-s", "120", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["levels"] == r["levels"]
    assert sorted(lv["mode"] for lv in saved["levels"]) == ["loglik", "plain"]
    for lv in saved["levels"]:
        assert lv["clients"] == 1 and lv["requests"] == 2 and lv["prompts"] == 4 and lv["prompt_tokens"] == 64
        assert lv["requests_per_s"] > 0 and lv["prompt_tok_s"] > 0
        assert 0 < lv["latency_ms_median"] <= lv["latency_ms_p99"]
    (ratio,) = saved["loglik_vs_plain"]
    assert ratio["clients"] == 1
    for key in ("latency_median_ratio", "latency_p99_ratio", "throughput_ratio"):
        assert ratio[key] > 0


def test_plain_prompts_differ_from_loglik_only_in_the_first_token():
    p = make_prompts(3, 2, 3, 2, 8, vocab=5)
    for ll_c, pl_c in zip(p["loglik"], p["plain"]):
        for ll_r, pl_r in zip(ll_c, pl_c):
            for a, b in zip(ll_r, pl_r):
                assert a[1:] == b[1:] and a[0] != b[0] and 1 <= b[0] < 5


def test_check_rejects_a_loglik_answer_without_prompt_logprobs():
    prompts = [[5, 6, 7]]
    good = {"choices": [{"index": 0, "logprobs": {"token_logprobs": [None, -1.0, -2.0, -0.5]}}]}
    check("loglik", good, prompts)
    for lps in ([None, None, None, -0.5], [None, -1.0, -0.5], [-3.0, -1.0, -2.0, -0.5], None):
        with pytest.raises(RuntimeError):
            check("loglik", {"choices": [{"index": 0, "logprobs": {"token_logprobs": lps}}]}, prompts)
    with pytest.raises(RuntimeError):
        check("plain", {"choices": []}, prompts)
