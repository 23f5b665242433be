"""`bench.ttft_trace` on CPU: the in-process server over the local executor answers streamed completions and every
hand-off point of the first token is reached in order (the segments are non-negative and sum to the TTFT)."""
from bench.ttft_trace import SEGMENTS, main


def test_ttft_trace_segments_cover_the_first_token(tmp_path):
    r = main(["--model", "qwen3-tiny", "--device", "cpu", "--max-model-len", "256", "--requests", "6", "--warmup", "1",
              "--prompt-len", "32", "--out", str(tmp_path / "t.json")])
    assert len(r["rows"]) == 5
    for row in r["rows"]:
        assert all(row[k] >= 0 for k in SEGMENTS if k != "engine_overhead"), row
        parts = row["http_in"] + row["to_engine"] + row["step"] + row["engine_overhead"] + row["to_dispatch"] \
            + row["to_client"]
        assert abs(parts - row["ttft"]) < 1e-6 and row["step"] > 0
    assert (tmp_path / "t.json").exists()
