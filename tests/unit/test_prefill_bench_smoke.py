"""`bench.prefill_bench --smoke` runs end to end on CPU (qwen3-tiny, the local executor) and reports every
scenario: a check that the benchmark the prefill figures come from keeps working, not a timing."""
from bench.prefill_bench import main


def test_prefill_bench_smoke_reports_every_scenario(tmp_path):
    out = tmp_path / "prefill.json"
    r = main(["--smoke", "--out", str(out)])
    assert out.exists()
    sizes = r["sizes"]
    for n in (sizes["short"], sizes["long"]):
        assert r["ttft"][f"chunked_{n}_ms"] > 0 and r["ttft"][f"unchunked_{n}_ms"] > 0
    assert r["prefix"]["hit_ms"] > 0 and r["prefix"]["no_cache_ms"] > 0
    tput = r["throughput"]
    assert tput["cache_on_no_hits_output_tok_s"] > 0 and tput["cache_off_output_tok_s"] > 0
    assert len(tput["cache_on_no_hits_rounds_output_tok_s"]) == len(tput["cache_off_rounds_output_tok_s"]) == 2
    for kind in ("chunked", "unchunked"):
        c = r["clients"][kind]
        assert 0 < c["ttft_p50_ms"] <= c["ttft_p99_ms"]
    assert r["decode"]["batch"] == sizes["clients"] and r["decode"]["steps"] > 0
