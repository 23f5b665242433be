"""A loading rank's peak resident memory, measured by the kernel (VmHWM) in a fresh process per load
(`tests.fixtures.load_memory`), on a ~12 MB fp32 checkpoint in ~2 MB shards.

Contract: a TP=2 rank's peak stays below one full copy of the model plus one tensor; any rank's peak is its
shard plus the largest checkpoint file (safetensors maps a whole file while it is read) plus small change.
Two negative controls run the same measurement on loaders that break the contract, so the bound can fail.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from tests.fixtures.hf_checkpoints import build_checkpoint

ROOT = Path(__file__).resolve().parents[2]
SLACK = 1 << 20  # interpreter and allocator noise
SHAPE = dict(hidden_size=256, intermediate_size=1024, vocab_size=2048, head_dim=64)  # 2 MiB embedding / head

if not os.access("/proc/self/clear_refs", os.W_OK):
    pytest.skip("needs a writable /proc/self/clear_refs to reset the peak RSS", allow_module_level=True)


def _measure(ckpt: Path, tp: int, mode: str = "lazy") -> dict:
    out = subprocess.run([sys.executable, "-m", "tests.fixtures.load_memory", str(ckpt), "--tp-size", str(tp),
                          "--mode", mode], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("mem5"), shards=5, **SHAPE)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("mem1"), **SHAPE)


def test_tp2_rank_peak_is_below_model_plus_one_tensor(sharded):
    r = _measure(sharded, tp=2)
    assert r["files"] >= 5 and r["model_bytes"] > 10 << 20
    assert r["param_bytes"] < 0.55 * r["model_bytes"]  # really a half shard
    assert r["peak_growth"] <= r["model_bytes"] + r["largest_tensor_bytes"], r
    assert r["peak_growth"] <= r["param_bytes"] + r["largest_file_bytes"] + SLACK, r


def test_tp1_peak_is_model_plus_one_file(sharded):
    r = _measure(sharded, tp=1)
    assert r["param_bytes"] == r["model_bytes"]
    assert r["peak_growth"] <= r["param_bytes"] + r["largest_file_bytes"] + SLACK, r


def test_single_file_peak_is_shard_plus_the_file(single):
    r = _measure(single, tp=2)
    assert r["files"] == 1
    assert r["peak_growth"] <= r["param_bytes"] + r["largest_file_bytes"] + SLACK, r


@pytest.mark.parametrize("mode", ["materialise", "all_open"])
def test_the_bound_catches_loaders_that_hold_too_much(sharded, mode):
    """Copying every tensor before loading, or holding every file's tensors at once, breaks both bounds."""
    r = _measure(sharded, tp=2, mode=mode)
    assert r["peak_growth"] > r["model_bytes"] + r["largest_tensor_bytes"], r
    assert r["peak_growth"] > r["param_bytes"] + r["largest_file_bytes"] + SLACK, r
