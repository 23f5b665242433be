"""Every documented command starts in a clean CI environment, as a new user runs it.

- `graphline serve --model qwen3-tiny` with default options (the Ray executor, `--device auto`: the CPU here) answers
  `/v1/completions` through the official `openai` client, streamed and not, and leaves no process behind after
  SIGTERM;
- `graphline demo`, `graphline generate`, `graphline bench` (against a live server) and `--help` of every subcommand;
- `launch/cluster.sh` (its usage; `up` serves in the `[dp2]` e2e server fixture and in `test_cluster_up_serves`);
- start-up failures print one line naming the cause and the fix, exit non-zero, and put the traceback in a log file.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from e2e_support import REPO, graphline, start_server

openai = pytest.importorskip("openai", reason="the official openai client is a test dependency (pip install openai)")


def _session_processes(sid: int) -> list[str]:
    """Command lines of live processes in session `sid` (a server started with start_new_session)."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[3]) == sid and fields[0] != "Z":
                out.append((d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
        except (OSError, IndexError, ValueError):
            continue
    return out


def _run(cmd: list[str], timeout: float = 240, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def test_serve_with_default_options_answers_the_openai_client_and_leaves_nothing_behind():
    srv = start_server(graphline("serve", "--model", "qwen3-tiny", "--port", "0"), timeout=300)
    sid = srv.proc.pid  # its own session (start_new_session): the leader's pid is the session id
    try:
        assert "executor ray" in srv.output()
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list().data] == ["qwen3-tiny"]
        done = client.completions.create(model="qwen3-tiny", prompt=[1, 2, 3, 4], max_tokens=8, temperature=0)
        assert done.object == "text_completion" and done.choices[0].finish_reason == "length"
        assert done.usage.prompt_tokens == 4 and done.usage.completion_tokens == 8
        streamed = client.completions.create(model="qwen3-tiny", prompt=[1, 2, 3, 4], max_tokens=8, temperature=0,
                                             stream=True)
        chunks = list(streamed)
        assert chunks and chunks[-1].choices[0].finish_reason == "length"
        got = [t for c in chunks for t in (c.choices[0].model_extra or {}).get("token_ids", [])]
        want = (done.choices[0].model_extra or {}).get("token_ids")
        assert want is not None and len(want) == 8 and got == want, (got, want)
        assert len(_session_processes(sid)) > 1  # the server and its Ray processes
    finally:
        code = srv.stop()
    assert code == 0, srv.output()[-4000:]
    deadline = time.monotonic() + 30
    while _session_processes(sid) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _session_processes(sid) == [], srv.output()[-3000:]


def test_demo_and_generate_run():
    demo = _run(graphline("demo", "--max-tokens", "4"))
    assert demo.returncode == 0, demo.stderr[-3000:]
    assert "sequence 0:" in demo.stdout and "decode" in demo.stdout
    gen = _run(graphline("generate", "--model", "qwen3-tiny", "--prompt-ids", "1,2,3", "--max-tokens", "5", "--json"))
    assert gen.returncode == 0, gen.stderr[-3000:]
    out = json.loads(gen.stdout.strip().splitlines()[-1])
    assert out["executor"] == "local" and len(out["outputs"][0]["token_ids"]) == 5


@pytest.mark.parametrize("sub", ["serve", "generate", "bench", "demo"])
def test_every_subcommand_has_help(sub):
    r = _run(graphline(sub, "--help"), timeout=60)
    assert r.returncode == 0 and f"usage: graphline {sub}" in r.stdout, r.stderr[-2000:]


def test_bench_against_a_live_server(tmp_path):
    srv = start_server(graphline("serve", "--model", "qwen3-tiny", "--executor", "local", "--device", "cpu",
                                 "--max-decode-batch", "4", "--pcg-max-tokens", "0", "--no-progress", "--port", "0"))
    try:
        out = tmp_path / "bench.json"
        r = _run(graphline("bench", "--url", srv.url, "--concurrency", "1,2", "--requests-per-client", "1",
                           "--prompt-len", "8", "--max-tokens", "4", "--temperature", "1.0", "--top-p", "0.9",
                           "--out", str(out)))
        assert r.returncode == 0, r.stderr[-3000:]
        result = json.loads(out.read_text())
        assert [lv["clients"] for lv in result["levels"]] == [1, 2]
        assert all(lv["output_tokens"] == 4 * lv["requests"] for lv in result["levels"])
        assert result["config"]["temperature"] == 1.0 and "TPOT" in r.stdout
    finally:
        srv.stop()


def test_cluster_script_usage():
    r = _run(["bash", str(REPO / "launch" / "cluster.sh"), "--help"], timeout=30)
    assert r.returncode == 0 and "launch/cluster.sh up" in r.stdout and "RAY_AUTH_MODE=token" in r.stdout


def test_cluster_up_serves(server):
    if server.kind != "dp2":
        pytest.skip("the [dp2] server is the one `launch/cluster.sh up` started")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    out = client.completions.create(model="qwen3-tiny", prompt=[5, 6, 7], max_tokens=3, temperature=0)
    assert out.usage.completion_tokens == 3


def _one_line_failure(r: subprocess.CompletedProcess, cmd: str) -> str:
    assert r.returncode != 0
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith(f"graphline {cmd}: error:")]
    assert len(lines) == 1, r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    return lines[0]


def test_startup_failures_are_one_line_with_the_fix_and_a_log(tmp_path):
    env = {"GRAPHLINE_LOG_DIR": str(tmp_path)}
    r = _run(graphline("serve", "--model", "qwen3-tiny", "--dp", "3", "--num-cpus", "2", "--port", "0",
                       "--no-progress"), env=env)
    line = _one_line_failure(r, "serve")
    assert "CPU: need 3, cluster has 2" in line and "--num-cpus" in line and "full traceback:" in line
    log = Path(line.rsplit("full traceback: ", 1)[1].rstrip(")"))
    assert log.is_file() and "PlacementError" in log.read_text()

    r = _run(graphline("serve", "--model", "qwen3-tiny", "--device", "cuda", "--port", "0", "--no-progress"), env=env)
    line = _one_line_failure(r, "serve")
    assert "GPU" in line and ("--device cpu" in line or "cpu or auto" in line), line

    r = _run(graphline("serve", "--model", "no-such-model", "--port", "0"), env=env)
    assert "no-such-model" in _one_line_failure(r, "serve")

    # a missing package (blocked in the child process), named with what to install
    block = ("import sys, importlib.abc\n"
             "class Block(importlib.abc.MetaPathFinder):\n"
             "    def find_spec(self, name, path=None, target=None):\n"
             "        if name == 'safetensors' or name.startswith('safetensors.'):\n"
             "            raise ModuleNotFoundError(f\"No module named '{name}'\", name=name)\n"
             "sys.meta_path.insert(0, Block())\n"
             "from launch.cli import main\n"
             "sys.exit(main(sys.argv[1:]))\n")
    r = _run([sys.executable, "-c", block, "generate", "--model", "qwen3-tiny", "--prompt-ids", "1,2", "--max-tokens",
              "2"], env=env)
    line = _one_line_failure(r, "generate")
    assert "'safetensors' is missing" in line and "pip install" in line
