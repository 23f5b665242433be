"""`graphline bench --api completions,chat,responses` on the CPU against the real-format Qwen3 fixture checkpoint
(`tests.fixtures.hf_checkpoints`): the benchmark starts `graphline serve`, runs both APIs at each concurrency
against it, and its JSON has a row per API and concurrency (same prompt lengths, the same output token counts,
positive TPOT, the client's templated token counts equal to the server's) and the chat / completions and
responses / completions ratios.
`--api chat` on a model without a chat template is a one-line error before any server starts."""
from __future__ import annotations

import json
import os
import subprocess

import pytest

from e2e_support import REPO, graphline
from tests.fixtures.hf_checkpoints import build_checkpoint

pytest.importorskip("transformers")
pytest.importorskip("aiohttp")

MAX_TOKENS = 8


def _run(cmd: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "RAY_USAGE_STATS_ENABLED": "0"})


def test_bench_chat_and_completions_side_by_side(tmp_path):
    ckpt = build_checkpoint(tmp_path / "qwen3-fixture")
    out = tmp_path / "bench.json"
    r = _run(graphline("bench", "--model", str(ckpt), "--executor", "local", "--api", "completions,chat,responses",
                       "--concurrency", "1,2", "--requests-per-client", "2", "--prompt-len", "48", "--max-tokens",
                       str(MAX_TOKENS), "--max-model-len", "128", "--server-arg=--device", "--server-arg=cpu",
                       "--server-arg=--max-decode-batch=4", "--server-arg=--pcg-max-tokens=0", "--out", str(out)))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    result = json.loads(out.read_text())
    levels = result["levels"]
    assert [(lv["api"], lv["clients"]) for lv in levels] == [(a, c) for c in (1, 2)
                                                             for a in ("completions", "chat", "responses")]
    for lv in levels:
        assert lv["output_tokens"] == MAX_TOKENS * lv["requests"], lv  # ignore_eos: every request runs its length
        assert lv["tpot_ms_median"] > 0 and lv["ttft_ms_median"] > 0 and lv["throughput_tok_s"] > 0, lv
        assert lv["prompt_tokens_mismatch"] == 0, lv  # the client's template = the server's
        assert 40 <= lv["prompt_tokens_mean"] <= 48, lv  # templated conversations of about --prompt-len tokens
    for api in ("chat", "responses"):
        ratios = result[f"{api}_vs_completions"]
        assert [row["clients"] for row in ratios] == [1, 2]
        for row in ratios:
            for key in ("tpot_median_ratio", "tpot_mean_ratio", "ttft_median_ratio", "throughput_ratio"):
                assert row[key] > 0, row
        assert f"{api} / completions" in r.stdout and "TPOT" in r.stdout


def test_bench_chat_needs_a_chat_template():
    r = _run(graphline("bench", "--model", "qwen3-tiny", "--api", "chat"), timeout=60)
    assert r.returncode != 0
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("graphline bench: error:")]
    assert len(lines) == 1 and "--tokenizer" in lines[0], r.stderr[-2000:]
    r = _run(graphline("bench", "--model", "qwen3-tiny", "--api", "chats"), timeout=60)
    assert r.returncode != 0 and "completions,chat" in r.stderr, r.stderr[-2000:]
