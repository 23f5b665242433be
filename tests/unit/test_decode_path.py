"""`bench.decode_path` counts what decode steps cross: a real `graphline serve --executor local` on CPU (qwen3-tiny)
in a child process, one streamed request over 127.0.0.1, two decode steps traced. The counted set must be
non-empty, come from this checkout, hold files of engine/, actors/, modeling/ and graphrunner/ (the path from the
engine loop down to the model) and of launch/ (the HTTP stream), and cover decode steps only."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_decode_steps_cross_engine_actors_modeling_graphrunner(tmp_path):
    out = tmp_path / "decode_path.json"
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "bench.decode_path", "--steps", "2", "--max-tokens", "8",
                           "--timeout-s", "60", "--out", str(out)],
                          check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    rep = json.loads(out.read_text())
    assert Path(rep["root"]) == ROOT
    assert rep["problems"] == [] and rep["window_complete"]
    assert rep["step_kinds"][0] == "prefill" and rep["step_kinds"][2:4] == ["decode", "decode"]
    files = rep["files"]
    assert files and rep["totals"]["executed_lines"] > 0
    for pkg in ("engine", "actors", "modeling", "graphrunner", "launch"):
        assert any(f.startswith(pkg + "/") for f in files), (pkg, sorted(files))
    # the decode path's anchors: the engine step, the rank's step, the runner and the model's forward
    for f in ("engine/llm_engine.py", "actors/rank.py", "graphrunner/runner.py", "modeling/qwen3.py"):
        assert files.get(f, {}).get("executed_lines", 0) > 0, (f, sorted(files))
    for f, v in files.items():
        assert 0 < v["executed_lines"] <= v["file_lines"] == (ROOT / f).read_bytes().count(b"\n"), f
    assert rep["totals"]["files"] == len(files)
    assert rep["totals"]["file_lines"] == sum(v["file_lines"] for v in files.values())
