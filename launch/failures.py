"""Start-up failures as one line on the terminal: the cause and the fix. The full traceback goes to a log file.

`explain(exc)` maps an exception (also one raised inside a rank and reported by the coordinator, whose text
carries the remote cause) to a sentence naming what went wrong and what to do; `write_log(...)` writes the
traceback and returns the file's path (`GRAPHLINE_LOG_DIR`, default `~/.cache/graphline/logs`).
"""
from __future__ import annotations

import os
import re
import time
import traceback
from pathlib import Path
from typing import Optional

_PACKAGES = {  # import name -> what to install
    "triton": "triton (the GPU kernel compiler; it comes with the CUDA build of torch: pip install torch)",
    "ray": "ray (pip install 'ray>=2.40')",
    "transformers": "transformers (pip install transformers)",
    "tokenizers": "tokenizers (pip install tokenizers)",
    "deep_ep": "deep_ep (DeepEP; or use --ep-backend allgather)",
}
_MISSING = re.compile(r"No module named '([^']+)'")


def missing_package(text: str) -> Optional[str]:
    m = _MISSING.search(text)
    return m.group(1).split(".")[0] if m else None


def explain(exc: BaseException) -> str:
    """One line: what failed and how to fix it."""
    text = " ".join(str(exc).split())
    name = type(exc).__name__
    pkg = missing_package(text) or (getattr(exc, "name", None) if isinstance(exc, ModuleNotFoundError) else None)
    if pkg:
        pkg = pkg.split(".")[0]
        return f"the Python package '{pkg}' is missing: install {_PACKAGES.get(pkg, pkg + ' (pip install ' + pkg + ')')}"
    if name == "PlacementError":
        fix = []
        if "CPU:" in text:
            fix.append("start Ray with more CPUs (--num-cpus N when graphline starts it), or add nodes "
                       "(launch/cluster.sh worker)")
        if "GPU" in text:
            fix.append("lower --tp/--dp/--ep to the GPUs the cluster has (ray status), or add GPU nodes")
        return f"{text}" + (f"; fix: {' or '.join(fix)}" if fix else "")
    if name in ("ConfigError", "UnknownPresetError", "CheckpointError"):
        return f"model: {text}"
    if name == "DeviceError":
        return text
    if isinstance(exc, OSError) and getattr(exc, "errno", None) in (98, 48):  # EADDRINUSE (Linux, macOS)
        return f"{text}: the port is in use; choose another with --port (0 = any free port)"
    if "ConnectionError" in name or "Failed to connect to GCS" in text or "Could not find any running Ray" in text:
        return (f"cannot reach the Ray cluster ({text[:300]}): is `launch/cluster.sh head` running at --address, "
                "and does this shell have the cluster's token (RAY_AUTH_MODE=token, RAY_AUTH_TOKEN_PATH)?")
    if name in ("RankFailureError", "StartupCaptureError"):
        return f"a rank failed during start-up: {text[:600]}"
    return f"{name}: {text[:600]}"


def log_dir() -> Path:
    from actors.environment import log_dir as log_dir_override

    return Path(log_dir_override() or Path.home() / ".cache" / "graphline" / "logs")


def write_log(command: str, exc: BaseException) -> Optional[Path]:
    """Write the traceback of `exc` to a new log file; its path, or None when no file could be written."""
    try:
        d = log_dir()
        d.mkdir(parents=True, exist_ok=True)
        path = d / f"graphline-{command}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
        path.write_text("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
        return path
    except OSError:
        return None
