"""Run every documented command and option (README.md, launch/README.md, `graphline <command> --help`) the way a
new user would on this machine, and print one row per command with its result.

    python -m bench.doc_commands --out docs/results/doc_commands.md    # CPU: qwen3-tiny; a few minutes

Options of `serve` and `generate` are exercised through `graphline generate` (they build the same deployment)
plus one `graphline serve` per serve-only option, answering one request on 127.0.0.1. Commands that need a GPU
or another machine are listed as such and not run here. Exit code 1 when any row failed.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

TINY = ["--model", "qwen3-tiny", "--device", "cpu", "--no-progress"]
GEN = [sys.executable, "-m", "launch", "generate", "--prompt-ids", "1,2,3", "--max-tokens", "4", "--json"]


def run(cmd: list[str], timeout: float = 300, env: dict | None = None) -> tuple[bool, str]:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})
    tail = (p.stdout + p.stderr).strip().splitlines()
    return p.returncode == 0, (tail[-1] if tail else "")[:160]


def expect_fail(cmd: list[str], needle: str, timeout: float = 300) -> tuple[bool, str]:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    line = next((ln for ln in p.stderr.splitlines() if "error:" in ln), p.stderr.strip()[-160:])
    return p.returncode != 0 and needle in line, line[:160]


def serve_once(extra: list[str], body: dict | None = None, timeout: float = 240, path: str = "/v1/completions",
               env: dict | None = None, headers: dict | None = None) -> tuple[bool, str]:
    cmd = [sys.executable, "-m", "launch", "serve", "--port", "0", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    url, t0 = None, time.monotonic()
    try:
        for line in proc.stdout:
            m = re.search(r"serving \S+ on (http://\S+)", line)
            if m:
                url = m.group(1)
                break
            if time.monotonic() - t0 > timeout:
                break
        if url is None:
            return False, "did not start"
        data = json.dumps(body or {"prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0}).encode()
        req = urllib.request.Request(url.replace("0.0.0.0", "127.0.0.1") + path, data=data,
                                     headers={"Content-Type": "application/json", **(headers or {})})
        with urllib.request.urlopen(req, timeout=120) as r:
            out = json.loads(r.read())
        if out.get("object") == "response":
            return True, f"{url}: {out['usage']['output_tokens']} tokens: {out['output'][0]['content'][0]['text']!r}"
        ch = out["choices"][0]
        got = f"{len(ch['token_ids'])} tokens" if "token_ids" in ch else f"{out['usage']['completion_tokens']} tokens: " \
            f"{ch['message']['content']!r}"
        return True, f"{url}: {got}"
    except Exception as exc:  # noqa: BLE001 - reported in the row
        return False, f"{type(exc).__name__}: {exc}"[:160]
    finally:
        stop(proc)


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the command, then SIGKILL to its process group after 60 s."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


def rows(ckpt: Path, token_file: Path) -> list[tuple[str, callable]]:
    g = lambda *a: (lambda: run(GEN + [*TINY, *a]))  # noqa: E731
    s = lambda *a, **kw: (lambda: serve_once([*TINY, *a], **kw))  # noqa: E731
    py = sys.executable
    return [
        ("graphline demo", lambda: run([py, "-m", "launch", "demo"])),
        ("graphline demo --max-tokens 4 --batch 3 --prompt-len 5 --device cpu --eager",
         lambda: run([py, "-m", "launch", "demo", "--max-tokens", "4", "--batch", "3", "--prompt-len", "5",
                      "--device", "cpu", "--eager"])),
        ("graphline demo --model qwen3-moe-tiny", lambda: run([py, "-m", "launch", "demo", "--model", "qwen3-moe-tiny"])),
        ("graphline generate --model qwen3-tiny --prompt-ids 1,2,3 --max-tokens 8",
         lambda: run([py, "-m", "launch", "generate", "--model", "qwen3-tiny", "--prompt-ids", "1,2,3", "--max-tokens",
                      "8"])),
        ("generate --executor ray --dp 2", g("--executor", "ray", "--dp", "2")),
        ("generate --executor ray --tp 2", g("--executor", "ray", "--tp", "2")),
        ("generate --model qwen3-moe-tiny --executor ray --dp 2 --ep 2",
         lambda: run(GEN + ["--model", "qwen3-moe-tiny", "--device", "cpu", "--no-progress", "--executor", "ray",
                            "--dp", "2", "--ep", "2"])),
        ("generate --executor ray --num-cpus 2 --ray-listen node", g("--executor", "ray", "--num-cpus", "2",
                                                                     "--ray-listen", "node")),
        ("generate --executor local --seed 3 --dtype float32 --eager", g("--executor", "local", "--seed", "3",
                                                                        "--dtype", "float32", "--eager")),
        ("generate --block-size 8 --num-kv-blocks 32 --kv-cache-memory-fraction 0.3 --max-model-len 64",
         g("--block-size", "8", "--num-kv-blocks", "32", "--kv-cache-memory-fraction", "0.3", "--max-model-len", "64")),
        ("generate --max-num-seqs 2 --max-num-batched-tokens 8 --random 4 --prompt-len 6",
         g("--max-num-seqs", "2", "--max-num-batched-tokens", "8", "--random", "4", "--prompt-len", "6")),
        ("generate --max-decode-batch 8 --pcg-max-tokens 64 --pcg-token-stride 32 --pcg-min-tokens 16",
         g("--max-decode-batch", "8", "--pcg-max-tokens", "64", "--pcg-token-stride", "32", "--pcg-min-tokens", "16")),
        ("generate --prefill-graph-max-tokens 64 --prefill-graph-max-seqs 2",
         g("--prefill-graph-max-tokens", "64", "--prefill-graph-max-seqs", "2")),
        ("generate --decode-steps 4 --overlap --overlap-max-seqs 8", g("--decode-steps", "4", "--overlap",
                                                                      "--overlap-max-seqs", "8")),
        ("generate --no-chunked-prefill --no-prefix-caching", g("--no-chunked-prefill", "--no-prefix-caching")),
        ("generate --step-timeout-s 20 --collective-timeout-s 30 --armed-decode-wait-ms 0 --executor ray",
         g("--step-timeout-s", "20", "--collective-timeout-s", "30", "--armed-decode-wait-ms", "0", "--executor",
           "ray")),
        ("generate --ep-backend allgather --temperature 0.8 --top-k 20 --top-p 0.9 --sampling-seed 5",
         g("--ep-backend", "allgather", "--temperature", "0.8", "--top-k", "20", "--top-p", "0.9",
           "--sampling-seed", "5")),
        ("generate --stop-token-ids 7,8 --ignore-eos", g("--stop-token-ids", "7,8", "--ignore-eos")),
        ("generate --model <checkpoint dir> --prompt 'The quick brown fox'",
         lambda: run([py, "-m", "launch", "generate", "--model", str(ckpt), "--device", "cpu", "--no-progress",
                      "--prompt", "The quick brown fox", "--max-tokens", "4"])),
        ("generate --ep-backend deepep (no deep_ep here: a one-line error)",
         lambda: expect_fail(GEN + ["--model", "qwen3-moe-tiny", "--device", "cpu", "--no-progress", "--executor",
                                    "ray", "--dp", "2", "--ep", "2", "--ep-backend", "deepep"], "error:")),
        ("generate --device cuda (no GPU here: a one-line error)",
         lambda: expect_fail(GEN + [*TINY[:2], "--device", "cuda"], "error:")),
        ("graphline serve --model qwen3-tiny --port 0 (defaults: Ray)", s()),
        ("serve --executor local --host 127.0.0.1 --served-model-name tiny --metrics-interval-s 1",
         s("--executor", "local", "--host", "127.0.0.1", "--served-model-name", "tiny", "--metrics-interval-s", "1",
           body={"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 4})),
        ("serve --host 0.0.0.0 --admin-token-file F (requests to 127.0.0.1 only)",
         s("--executor", "local", "--host", "0.0.0.0", "--admin-token-file", str(token_file))),
        ("serve --host 0.0.0.0 with GRAPHLINE_ADMIN_TOKEN", s("--executor", "local", "--host", "0.0.0.0",
                                                             env={"GRAPHLINE_ADMIN_TOKEN": "t0k3n"})),
        ("serve --host 0.0.0.0 --admin-token T", s("--executor", "local", "--host", "0.0.0.0", "--admin-token", "t")),
        ("serve --api-key-file F (requests carry Authorization: Bearer KEY)",
         s("--executor", "local", "--api-key-file", str(token_file), headers={"Authorization": "Bearer s3cret"})),
        ("serve --api-key K", s("--executor", "local", "--api-key", "k3y", headers={"Authorization": "Bearer k3y"})),
        ("serve with GRAPHLINE_API_KEY", s("--executor", "local", env={"GRAPHLINE_API_KEY": "k3y"},
                                           headers={"Authorization": "Bearer k3y"})),
        ("serve --allowed-origins http://localhost:3000 (a request from that origin)",
         s("--executor", "local", "--allowed-origins", "http://localhost:3000",
           headers={"Origin": "http://localhost:3000"})),
        ("serve --host 0.0.0.0 without a token: refused",
         lambda: expect_fail([py, "-m", "launch", "serve", *TINY, "--host", "0.0.0.0", "--port", "0"], "token")),
        ("serve --model <checkpoint dir>: chat completions", lambda: serve_once(
            ["--model", str(ckpt), "--device", "cpu", "--no-progress", "--executor", "local"],
            body={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}, path="/v1/chat/completions")),
        ("serve --model <checkpoint dir> --reasoning-parser qwen3: chat completions", lambda: serve_once(
            ["--model", str(ckpt), "--device", "cpu", "--no-progress", "--executor", "local", "--reasoning-parser",
             "qwen3"], body={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
            path="/v1/chat/completions")),
        ("serve --model <checkpoint dir> --tool-call-parser hermes: chat completions with tools", lambda: serve_once(
            ["--model", str(ckpt), "--device", "cpu", "--no-progress", "--executor", "local", "--tool-call-parser",
             "hermes", "--max-model-len", "256"], body={"messages": [{"role": "user", "content": "hi"}],
                                                        "max_tokens": 4, "tools": [{"type": "function", "function": {
                                                            "name": "get_weather"}}]}, path="/v1/chat/completions")),
        ("serve --dp 2 --overlap --decode-steps 4", s("--dp", "2", "--overlap", "--decode-steps", "4")),
        ("graphline bench --model qwen3-tiny --executor local --max-tokens 16 --concurrency 1,4",
         lambda: run([py, "-m", "launch", "bench", "--model", "qwen3-tiny", "--executor", "local", "--max-tokens", "16",
                      "--concurrency", "1,4", "--requests-per-client", "1", "--prompt-len", "8", "--server-arg=--device",
                      "--server-arg=cpu", "--out", str(token_file.parent / "bench.json")])),
        ("graphline bench --model <checkpoint dir> --api completions,chat",
         lambda: run([py, "-m", "launch", "bench", "--model", str(ckpt), "--executor", "local", "--api", "completions,chat",
                      "--concurrency", "1,2", "--requests-per-client", "1", "--prompt-len", "32", "--max-tokens", "8",
                      "--max-model-len", "128", "--server-arg=--device", "--server-arg=cpu",
                      "--out", str(token_file.parent / "bench_chat.json")])),
        ("graphline bench --model <checkpoint dir> --api completions,responses",
         lambda: run([py, "-m", "launch", "bench", "--model", str(ckpt), "--executor", "local", "--api",
                      "completions,responses", "--concurrency", "1", "--requests-per-client", "1", "--prompt-len", "32",
                      "--max-tokens", "8", "--max-model-len", "128", "--server-arg=--device", "--server-arg=cpu",
                      "--out", str(token_file.parent / "bench_responses.json")])),
        ("serve --model <checkpoint dir> --responses-store 16: POST /v1/responses", lambda: serve_once(
            ["--model", str(ckpt), "--device", "cpu", "--no-progress", "--executor", "local", "--responses-store",
             "16"], body={"input": "hi", "max_output_tokens": 4}, path="/v1/responses")),
        ("serve --model <checkpoint dir> --chat-template FILE: chat completions", lambda: serve_once(
            ["--model", str(ckpt), "--device", "cpu", "--no-progress", "--executor", "local", "--chat-template",
             str(template_file(token_file.parent))], body={"messages": [{"role": "user", "content": "hi"}],
                                                           "max_tokens": 4}, path="/v1/chat/completions")),
        ("serve --max-concurrent-requests 8", s("--executor", "local", "--max-concurrent-requests", "8")),
        ("serve --scheduling-policy priority (a request with priority -1)",
         s("--executor", "local", "--scheduling-policy", "priority",
           body={"prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0, "priority": -1})),
        ("launch/cluster.sh up --model qwen3-tiny --dp 2 --port 0", lambda: serve_via_cluster()),
        ("launch/cluster.sh --help", lambda: run(["bash", "launch/cluster.sh", "--help"])),
    ]


def serve_via_cluster() -> tuple[bool, str]:
    cmd = ["bash", "launch/cluster.sh", "up", *TINY, "--dp", "2", "--port", "0"]
    env = {**os.environ, "GRAPHLINE_RAY_PORT": "0", "GRAPHLINE_RAY_NUM_CPUS": "2", "PYTHON": sys.executable,
           "GRAPHLINE": f"{sys.executable} -m launch", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env=env)
    try:
        for line in proc.stdout:
            m = re.search(r"serving \S+ on (http://\S+)", line)
            if m:
                data = json.dumps({"prompt": [1, 2, 3], "max_tokens": 4}).encode()
                req = urllib.request.Request(m.group(1) + "/v1/completions", data=data,
                                             headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=120) as r:
                    return r.status == 200, f"{m.group(1)} answered"
        return False, "did not start"
    finally:
        stop(proc)


def template_file(d: Path) -> Path:
    """A minimal Jinja chat template in `d` (for `--chat-template`)."""
    p = d / "chat_template.jinja"
    p.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")
    return p


NOT_HERE = [
    ("python3 -m pytest -m gpu tests/gpu; -m multigpu tests/multigpu", "needs one / two CUDA GPUs"),
    ("bash bench/device_suite.sh tests|benches|owed", "needs the GPU machine"),
    ("launch/cluster.sh head / worker / serve HEAD:6379 ... --tp 8 --dp 2", "needs several machines (the two-node "
     "deployment is covered by tests/dist/test_two_nodes.py on one machine)"),
]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None)
    args = p.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.fixtures.hf_checkpoints import build_checkpoint

    tmp = Path(tempfile.mkdtemp(prefix="graphline-doc-commands-"))
    ckpt = build_checkpoint(tmp / "fixture-checkpoint", shards=2)
    token = tmp / "admin_token"
    token.write_text("s3cret\n")
    lines = ["| command | result | last line |", "|---|---|---|"]
    failed = 0
    for name, fn in rows(ckpt, token):
        t0 = time.monotonic()
        ok, tail = fn()
        failed += not ok
        row = f"| `{name}` | {'ok' if ok else 'FAILED'} ({time.monotonic() - t0:.0f} s) | {tail.replace('|', '/')} |"
        print(row, flush=True)
        lines.append(row)
    for name, why in NOT_HERE:
        lines.append(f"| `{name}` | not run here | {why} |")
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
