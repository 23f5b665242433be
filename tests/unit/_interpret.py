"""Run Triton kernels under the CPU interpreter for the `*_interpret.py` tests.

Triton picks interpreted or compiled functions when it is imported, so each test module runs its
kernels in one child process started with TRITON_INTERPRET=1; the test process only compares. The
child prints one line `RESULT<json>`.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_interpreted(child: str, *args: object, timeout_s: float = 300) -> dict:
    """Run `child` (Python source) with TRITON_INTERPRET=1 and the repository on PYTHONPATH; each of `args` is
    passed JSON-encoded as a command-line argument. Returns the decoded RESULT line; fails with the child's
    stderr when it exits non-zero or prints none."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path)
    proc = subprocess.run([sys.executable, "-c", child, *(json.dumps(a) for a in args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout_s)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")]
    assert proc.returncode == 0 and line, proc.stderr[-4000:]
    return json.loads(line[-1][len("RESULT"):])
