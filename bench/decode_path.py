"""Which product files, and how many of their lines, a decode step crosses: counted by tracing a real server.

    python -m bench.decode_path --out artifacts/decode_path.json --markdown artifacts/decode_path.md
    PYTHONPATH=/path/to/other/checkout python /tmp/decode_path.py --out old.json     # another version of the code
    python -m bench.decode_path --compare old.json new.json --markdown side_by_side.md

What runs, all in this one process: `graphline serve --model qwen3-tiny --executor local --device cpu --host
127.0.0.1 --port P --no-progress --max-model-len 512` through `launch.cli.main` in the main thread (the HTTP
event loop; the engine thread it starts), and a client thread that sends streamed completions (`/v1/completions`,
token-id prompt of `--prompt-len`, greedy, `--max-tokens`; the presets have no EOS token) to 127.0.0.1:P only:
one warm-up request, then the measured one, then SIGINT to stop the server.

How lines are counted (stdlib `sys.settrace`/`threading.settrace`, no dependency): a gate trace function is
installed in every thread before start-up. It only counts the measured request's `LLMEngine.step` calls until
step `--first-step` (step 1 is the prefill of the short prompt; step 2 the first decode). From the call of that
step to the return of step `--first-step + --steps - 1` every 'line' event in a product file is recorded; the
frames already running then (the engine loop) are traced too (`frame.f_trace`). Product files: the packages
launch, engine, actors, modeling, graphrunner and parallel under the checkout the imported `engine` comes
from. Only the engine thread and the main (HTTP event loop) thread count; lines other threads ran in the
window (a status refresher) are listed apart. So the figures cover the HTTP layer, the engine, the executor,
the rank runtime, the graph runner and the model for steady-state decode steps: not start-up, not prefill,
not the finishing step. The per-step phases (`StepInfo.kind` of `AsyncLLMEngine._on_step`) are checked.

Reported per file and per package: distinct executed lines, and the file's whole length (`wc -l`: the
"crosses N files and M lines" figure counts whole files). Work that comes on a timer (the engine thread publishes
its stats at most every 50 ms) or every `block_size` tokens (a new KV block: 16 on CPU) shows only in windows that
reach it: the default window (steps 3..6, about 12 ms) does not, `--max-tokens 40 --steps 30` does.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

PACKAGES = ("launch", "engine", "actors", "modeling", "graphrunner", "parallel")
COUNTED_THREADS = ("MainThread", "graphline-engine")


class Tracer:
    """The gate (every thread, from before start-up) and the line recorder of the window."""

    def __init__(self, root: Path, first_step: int, steps: int):
        from engine.async_engine import AsyncLLMEngine
        from engine.llm_engine import LLMEngine

        self.root, self.first, self.last = root, first_step, first_step + steps - 1
        self.step_code = LLMEngine.step.__code__
        self.on_step_code = AsyncLLMEngine._on_step.__code__
        self.armed = False  # the measured request is in: count its steps
        self.active = False
        self.done = False
        self.step_no = 0
        self.kinds: list[str] = []
        self.lines: dict[tuple[int, str], set[int]] = {}  # (thread ident, file) -> line numbers
        self.modules: set[str] = set()  # files whose module-level code ran in the window (an import)
        self.functions: set[tuple[str, str, int]] = set()
        self.thread_names: dict[int, str] = {}
        self.window_s = 0.0
        self._t0 = 0.0
        self._product: dict[str, str | None] = {}

    def product(self, filename: str) -> str | None:
        """The path relative to the root of a product file, else None (cached per code filename)."""
        rel = self._product.get(filename, 0)
        if rel == 0:
            rel = None
            try:
                p = Path(os.path.realpath(filename)).relative_to(self.root)
                if p.parts[0] in PACKAGES and p.suffix == ".py":
                    rel = p.as_posix()
            except ValueError:
                pass
            self._product[filename] = rel
        return rel

    def install(self) -> None:
        threading.settrace(self.gate)
        sys.settrace(self.gate)

    def uninstall(self) -> None:
        sys.settrace(None)
        threading.settrace(None)  # type: ignore[arg-type]

    def gate(self, frame, event, arg):
        code = frame.f_code
        if self.armed and not self.done:
            if code is self.step_code:
                self.step_no += 1
                if self.step_no == self.first:
                    self._activate()
            elif code is self.on_step_code:
                self.kinds.append(frame.f_locals["info"].kind)
        if not self.active:
            return None
        rel = self.product(code.co_filename)
        if rel is None:
            return None
        self.functions.add((rel, code.co_name, code.co_firstlineno))
        if code.co_name == "<module>":
            self.modules.add(rel)
        return self.local

    def local(self, frame, event, arg):
        if not self.active:
            return None
        if event == "line":
            key = (threading.get_ident(), frame.f_code.co_filename)
            s = self.lines.get(key)
            if s is None:
                s = self.lines[key] = set()
            s.add(frame.f_lineno)
        elif event == "return" and frame.f_code is self.step_code and self.step_no == self.last:
            self.active, self.done = False, True
            self.window_s = time.perf_counter() - self._t0
        return self.local

    def _activate(self) -> None:
        self.thread_names = {t.ident: t.name for t in threading.enumerate() if t.ident is not None}
        self.active = True
        self._t0 = time.perf_counter()
        for frame in sys._current_frames().values():  # frames already running: the engine loop, its callers
            while frame is not None:
                if self.product(frame.f_code.co_filename) is not None:
                    frame.f_trace = self.local
                frame = frame.f_back

    def per_file(self, counted: bool) -> dict[str, set[int]]:
        out: dict[str, set[int]] = {}
        for (ident, filename), s in self.lines.items():
            rel = self.product(filename)
            if rel is not None and (self.thread_names.get(ident, "?") in COUNTED_THREADS) == counted:
                out.setdefault(rel, set()).update(s)
        return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stream(port: int, body: dict, timeout: float) -> int:
    """One streamed completion to 127.0.0.1:port; returns the tokens received."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:300]!r}")
        tokens = 0
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(chunk["error"])
                tokens += sum(len(c.get("token_ids") or []) for c in chunk["choices"])
        return tokens
    finally:
        conn.close()


def client(tracer: Tracer, port: int, args: argparse.Namespace, result: dict) -> None:
    """Wait for the server, warm up, send the measured request, then stop the server (SIGINT)."""
    try:
        deadline = time.monotonic() + args.timeout_s
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5) as r:
                    model = json.load(r)["data"][0]["id"]
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError("the server did not come up")
                time.sleep(0.2)
        body = {"model": model, "prompt": list(range(1, args.prompt_len + 1)), "max_tokens": args.max_tokens,
                "temperature": 0.0, "stream": True}
        result["warmup_tokens"] = stream(port, body, args.timeout_s)
        tracer.armed = True
        result["tokens"] = stream(port, body, args.timeout_s)
    except BaseException as exc:  # noqa: BLE001 - reported, the server stopped either way
        result["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        tracer.active = False
        os.kill(os.getpid(), signal.SIGINT)


def wc_l(path: Path) -> int:
    return path.read_bytes().count(b"\n")


def report(tracer: Tracer, args: argparse.Namespace, result: dict, argv: list[str]) -> dict:
    root = tracer.root
    files = tracer.per_file(counted=True)
    others = tracer.per_file(counted=False)
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], check=False,
                                capture_output=True, text=True, timeout=10).stdout.strip() or None
    except OSError:
        commit = None
    per_file = {rel: {"executed_lines": len(s), "file_lines": wc_l(root / rel), "lines": sorted(s)}
                for rel, s in sorted(files.items())}
    packages = {}
    for pkg in PACKAGES:
        rows = [v for rel, v in per_file.items() if rel.split("/")[0] == pkg]
        packages[pkg] = {"files": len(rows), "file_lines": sum(r["file_lines"] for r in rows),
                         "executed_lines": sum(r["executed_lines"] for r in rows)}
    return {
        "root": str(root), "commit": commit, "python": sys.version.split()[0],
        "command": "graphline serve " + " ".join(argv), "settings": {k: v for k, v in vars(args).items()
                                                                     if k not in ("out", "markdown", "compare")},
        "client": result, "step_kinds": tracer.kinds, "window_steps": [tracer.first, tracer.last],
        "window_complete": tracer.done, "window_s": tracer.window_s, "threads_counted": list(COUNTED_THREADS),
        "imports_in_window": sorted(tracer.modules), "functions": len(tracer.functions),
        "totals": {"files": len(per_file), "file_lines": sum(v["file_lines"] for v in per_file.values()),
                   "executed_lines": sum(v["executed_lines"] for v in per_file.values())},
        "packages": packages, "files": per_file,
        "other_threads": {rel: len(s) for rel, s in sorted(others.items())},
    }


def problems(rep: dict, args: argparse.Namespace) -> list[str]:
    """What makes the window not 'steady-state decode steps only'."""
    out = []
    if rep["client"].get("error"):
        out.append(f"client: {rep['client']['error']}")
    if not rep["window_complete"]:
        out.append(f"the window (steps {rep['window_steps']}) did not complete")
    kinds = rep["step_kinds"]
    if not kinds or kinds[0] != "prefill":
        out.append(f"the measured request's step 1 is not its prefill: {kinds[:1]}")
    window = kinds[rep["window_steps"][0] - 1:rep["window_steps"][1]]
    if len(window) != args.steps or any(k != "decode" for k in window):
        out.append(f"window steps are not all decode: {window}")
    if rep["window_steps"][1] >= args.max_tokens:
        out.append("the window reaches the finishing step: raise --max-tokens")
    if rep["client"].get("tokens") != args.max_tokens:
        out.append(f"the measured request streamed {rep['client'].get('tokens')} tokens, not {args.max_tokens}")
    if rep["imports_in_window"]:
        out.append(f"modules imported in the window: {rep['imports_in_window']}")
    return out


def markdown(rep: dict) -> str:
    t = rep["totals"]
    head = (f"# Decode path: {t['files']} files ({t['file_lines']} lines), {t['executed_lines']} distinct lines "
            "executed")
    window = (f"- window: engine steps {rep['window_steps'][0]}..{rep['window_steps'][1]} of the measured request "
              f"(phases {rep['step_kinds']}), {rep['window_s'] * 1e3:.1f} ms traced; threads "
              f"{', '.join(rep['threads_counted'])}; {rep['functions']} functions")
    lines = [head, "", f"- code: `{rep['root']}` (commit {rep['commit']}), Python {rep['python']}",
             f"- server: `{rep['command']}`", window, "",
             "| package | files | lines of those files | distinct lines executed |", "|---|---:|---:|---:|"]
    for pkg, v in rep["packages"].items():
        lines.append(f"| {pkg} | {v['files']} | {v['file_lines']} | {v['executed_lines']} |")
    lines += [f"| **total** | **{t['files']}** | **{t['file_lines']}** | **{t['executed_lines']}** |", "",
              "| file | file lines | executed |", "|---|---:|---:|"]
    lines += [f"| {rel} | {v['file_lines']} | {v['executed_lines']} |" for rel, v in rep["files"].items()]
    if rep["other_threads"]:
        lines += ["", "Not counted (other threads in the window): " +
                  ", ".join(f"{k} ({n})" for k, n in rep["other_threads"].items())]
    return "\n".join(lines) + "\n"


def compare(old: dict, new: dict) -> str:
    """Side-by-side markdown of two reports (before, after)."""
    def cell(rep: dict, pkg: str | None) -> str:
        v = rep["totals"] if pkg is None else rep["packages"][pkg]
        return f"{v['files']} | {v['file_lines']} | {v['executed_lines']}"

    lines = ["| package | before: files | file lines | executed lines | after: files | file lines | executed lines |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for pkg in PACKAGES:
        lines.append(f"| {pkg} | {cell(old, pkg)} | {cell(new, pkg)} |")
    lines.append(f"| **total** | {cell(old, None)} | {cell(new, None)} |")
    lines += ["", "| file | before: file lines | executed | after: file lines | executed |",
              "|---|---:|---:|---:|---:|"]
    for rel in sorted(set(old["files"]) | set(new["files"])):
        a, b = old["files"].get(rel), new["files"].get(rel)
        fa = f"{a['file_lines']} | {a['executed_lines']}" if a else "- | -"
        fb = f"{b['file_lines']} | {b['executed_lines']}" if b else "- | -"
        lines.append(f"| {rel} | {fa} | {fb} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=None, help="JSON report path")
    p.add_argument("--markdown", default=None, help="markdown report path")
    p.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"), default=None,
                   help="write the side-by-side markdown of two JSON reports (no run)")
    p.add_argument("--model", default="qwen3-tiny")
    p.add_argument("--prompt-len", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--first-step", type=int, default=3, help="first traced step of the request (1 = prefill)")
    p.add_argument("--steps", type=int, default=4, help="decode steps traced")
    p.add_argument("--timeout-s", type=float, default=300.0)
    args = p.parse_args(argv)
    if args.compare:
        old, new = (json.loads(Path(f).read_text()) for f in args.compare)
        text = compare(old, new)
        if args.markdown:
            Path(args.markdown).write_text(text)
        print(text)
        return 0
    if args.first_step < 2:
        p.error("--first-step must be >= 2 (step 1 is the prefill)")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import engine
    from launch import cli

    root = Path(os.path.realpath(engine.__file__)).parent.parent
    port = _free_port()
    serve_argv = ["--model", args.model, "--executor", "local", "--device", "cpu", "--host", "127.0.0.1",
                  "--port", str(port), "--no-progress", "--max-model-len", "512"]
    tracer, result = Tracer(root, args.first_step, args.steps), {}
    tracer.install()
    th = threading.Thread(target=client, args=(tracer, port, args, result), name="decode-path-client", daemon=True)
    th.start()
    try:
        rc = cli.main(["serve", *serve_argv])
    finally:
        tracer.uninstall()
    th.join(30)
    result["serve_rc"] = rc
    rep = report(tracer, args, result, serve_argv)
    rep["problems"] = problems(rep, args)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(rep, indent=1) + "\n")
    text = markdown(rep)
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(text)
    print(text)
    for msg in rep["problems"]:
        print(f"decode_path: problem: {msg}", file=sys.stderr)
    return 1 if rep["problems"] or not rep["files"] else 0


if __name__ == "__main__":
    sys.exit(main())
