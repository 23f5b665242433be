"""`bench.ttft_trace` on CPU (the client in its own process, or in the server's event loop): the in-process server
over the local executor answers streamed completions and every hand-off point of the first token is reached in order
(the segments are non-negative and sum to the TTFT; the server-side splits sum to their segments)."""
import pytest

from bench.ttft_trace import SEGMENTS, SPLITS, main


@pytest.mark.parametrize("client", ["process", "loop"])
def test_ttft_trace_segments_cover_the_first_token(tmp_path, client):
    r = main(["--model", "qwen3-tiny", "--device", "cpu", "--max-model-len", "256", "--requests", "6", "--warmup", "1",
              "--prompt-len", "32", "--client", client, "--out", str(tmp_path / "t.json")])
    assert len(r["rows"]) == 5
    for row in r["rows"]:
        assert all(row[k] >= 0 for k in SEGMENTS if k != "engine_overhead"), row
        parts = row["http_in"] + row["to_engine"] + row["step"] + row["engine_overhead"] + row["to_dispatch"] \
            + row["to_client"]
        assert abs(parts - row["ttft"]) < 1e-6 and row["step"] > 0
        # the server-side marks split http_in and to_client (in order: each part but the client's read is >= 0)
        assert abs(row["client_send"] + row["parse"] + row["to_submit"] - row["http_in"]) < 1e-6
        assert abs(row["sse_write"] + row["client_read"] - row["to_client"]) < 1e-6
        assert all(row[k] >= 0 for k in SPLITS if k != "client_read"), row
    assert (tmp_path / "t.json").exists()
