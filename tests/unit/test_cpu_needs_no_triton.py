"""A CPU install needs no Triton: with `triton` impossible to import, every product module but the GPU kernel
modules imports, and `graphline generate` runs a CPU rank end to end (the kernel modules are imported only for a
CUDA device). The Ray ranks' side is checked in tests/dist/test_two_nodes.py (no Triton module in a CPU rank)."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GPU_ONLY = ("modeling.ops.triton_", "modeling.ops.pdl", "parallel.symm_fused", "modeling.sampler.triton_")

_CHILD = r"""
import importlib, importlib.abc, pkgutil, sys

class NoTriton(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ModuleNotFoundError(f"No module named '{name}'", name=name)

sys.meta_path.insert(0, NoTriton())
gpu_only = tuple(sys.argv[1].split(","))
imported = []
for pkg in ("graphrunner", "modeling", "parallel", "actors", "engine", "launch"):
    mod = importlib.import_module(pkg)
    for info in pkgutil.walk_packages(mod.__path__, pkg + "."):
        if info.name.startswith(gpu_only) or info.name.endswith(".__main__"):
            continue
        importlib.import_module(info.name)
        imported.append(info.name)
from launch.cli import main
code = main(["generate", "--model", "qwen3-tiny", "--device", "cpu", "--prompt-ids", "1,2,3", "--max-tokens", "3"])
leaked = sorted(m for m in sys.modules if m.startswith(gpu_only))
print("RESULT", len(imported), code, leaked)
"""


def test_product_imports_and_a_cpu_rank_run_without_triton():
    proc = subprocess.run([sys.executable, "-c", _CHILD, ",".join(GPU_ONLY)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")]
    assert proc.returncode == 0 and line, proc.stderr[-4000:]
    _, n, code, leaked = line[-1].split(" ", 3)
    assert int(n) > 40 and code == "0" and leaked == "[]", line[-1]
