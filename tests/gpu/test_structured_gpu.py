"""Structured outputs on one GPU: the chat fixture (`tests.fixtures.hf_checkpoints`: real BPE tokenizer, random
weights) served by `graphline serve --device cuda` with CUDA graphs, so the allowed-token masks go through the rank's
Triton sampler (the processed path) beside free-text rows in the same decode steps.

- constrained chat answers (greedy, sampled `n` = 4, streamed) all end with `stop` and parse into the schema's
  finite shape (`tests/e2e/test_structured_outputs.py`'s `ANSWER`), which a random-weight model never writes alone;
- free-text completions sent together with constrained ones give the text they give alone (greedy and seeded).
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from e2e_support import graphline, openai_client, start_server  # noqa: E402

pytestmark = pytest.mark.gpu
pytest.importorskip("llguidance")
pytest.importorskip("openai")

SERVE_ARGS = ["--device", "cuda", "--dtype", "float32", "--max-model-len", "256", "--num-kv-blocks", "128",
              "--max-decode-batch", "16", "--pcg-max-tokens", "256", "--pcg-token-stride", "128", "--no-progress",
              "--port", "0"]


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    from tests.fixtures.hf_checkpoints import build_checkpoint

    d = build_checkpoint(tmp_path_factory.mktemp("structured_gpu") / "tiny-chat")
    s = start_server(graphline("serve", "--model", str(d), *SERVE_ARGS), timeout=400)
    yield s
    s.stop()


def test_constrained_rows_through_the_triton_sampler(srv):
    from test_structured_outputs import check_constrained_chat

    check_constrained_chat(openai_client(srv), top_p=0.9)


def test_free_rows_beside_constrained_rows_are_unchanged(srv):
    from test_structured_outputs import check_free_beside_constrained

    check_free_beside_constrained(srv.url, free_tokens=32, constrained_rows=4)
