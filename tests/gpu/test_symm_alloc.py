"""`parallel.symm_allreduce.symm_empty_bytes` allocates symmetric memory without importing sympy: in a fresh process,
`torch.distributed._symmetric_memory.empty` imports it through its stride helper (483 modules, 1.9-3.4 s with the
GIL held on the H200 machines), on the TP group set-up's critical path."""
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]

CHILD = """
import sys, torch
from parallel.symm_allreduce import symm_empty_bytes
dev = torch.device("cuda", 0)
torch.cuda.set_device(dev)
had = "sympy" in sys.modules
x = symm_empty_bytes(4096, dev)
x.fill_(3)
torch.cuda.synchronize()
print("RESULT", had, "sympy" in sys.modules, x.numel(), x.dtype, int(x.sum().item()))
"""


def test_symm_empty_bytes_allocates_without_importing_sympy():
    proc = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, capture_output=True, text=True, timeout=120)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")]
    assert proc.returncode == 0 and line, proc.stderr[-3000:]
    assert line[0].split()[1:] == ["False", "False", "4096", "torch.uint8", str(3 * 4096)], line[0]
