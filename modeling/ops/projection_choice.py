"""Which kernel serves each dense decode projection `[M, K] @ [N, K]^T` at M <= 64 rows (CPU-importable, no Triton).

Per (N, K, row class), row classes 1 (M == 1), 4 (M <= 4), 16 (M <= 16), 32 (M <= 32), 64 (M <= 64) as `triton_gemm`
keys its table:
1. the tuning table (`triton_gemm._CONFIGS`, measured offline by `python -m bench.gemm_tune`): a skinny-GEMM config,
   or None where cuBLAS measured faster;
2. else, for row classes 32 and 64 (`TABLE_ONLY_CLASSES`), cuBLAS: there the safe config's isolated win did not
   carry into the model (Qwen3-1.7B's down projection at class 32 won alone and took batches 24-32 to 1.28x,
   docs/benchmarks.md, twentieth session), so those classes take the Triton path only where a table entry says so;
3. else the fallback chosen on this device at warm-up (`triton_gemm_measure.measure_projection_fallbacks`, run by
   `Qwen3ForCausalLM.warm_up_kernels` outside capture for every (N, K) the loaded model has): the faster of cuBLAS
   and the safe generic config (`triton_gemm.default_config`), read from the disk cache or measured, each in the
   form the model runs it (`FORMS`: with the SiLU-gate before it and the residual add + RMSNorm it fuses after it);
4. else (nothing chosen yet, or `KernelOptions.measure_projections=False`) the safe generic config.
At 1-2 rows the decode GEMV (`triton_gemv`) serves ahead of this choice wherever it applies.

Disk cache (`default_cache_path()`, `~/.cache/graphline/projection_choice.json`): one entry per GPU name, torch /
CUDA / Triton versions, dtype, PDL mode, (N, K, row class) and form (`MeasureContext.key`), holding the winner and
the safe config it was measured against; an entry whose safe config is no longer today's is measured again. A missing,
unreadable or corrupt file counts as empty and is rewritten whole at the next write; writes replace the file
atomically (temp file + `os.replace`) after merging what it holds then; a failed write only logs.

Process-wide state (documented exception to the no-global-state rule): `_FALLBACKS`, the chosen fallbacks keyed by
(device index, N, K, row class), written only by the warm-up (outside capture), read by every
`triton_gemm.config_for`; it lives for the process, and a process's first choice stands for the later models on
that device whatever their dtype or PDL mode. `clear_fallbacks` empties it (tests, benchmarks).
"""
from __future__ import annotations

import json
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Mapping, Optional

from torch import nn

log = logging.getLogger(__name__)

ROW_CLASSES = (1, 4, 16, 32, 64)
# How a projection runs in the model, which is what its fallback is measured as: "plain" y = x @ w^T; "gated" the
# SiLU-gate before it (`silu_mul_linear`); "add_norm" / "gated_add_norm" also the residual add + RMSNorm after it
# (`linear_add_rms_norm`: one kernel where the skinny GEMM serves and fuses them, else the GEMM and `add_rms_norm`).
FORMS = ("plain", "gated", "add_norm", "gated_add_norm")
TABLE_ONLY_CLASSES = (32, 64)  # untabled shapes take cuBLAS here: neither measured nor the safe config
MEASURED_CLASSES = tuple(c for c in ROW_CLASSES if c not in TABLE_ONLY_CLASSES)
KERNELS = ("skinny", "cublas")
SOURCES = ("table", "untabled", "measured", "cached", "safe")
CACHE_VERSION = 1

Config = tuple[int, int, int, int, int]  # (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages)
Table = Mapping[tuple[int, int, int], Optional[Config]]
Key = tuple[int, int, int]  # (N, K, row class)


@dataclass(frozen=True)
class Choice:
    """kernel: "skinny" (the Triton skinny GEMM with `config`) or "cublas" (`F.linear`, config None);
    source: "table", "untabled" (cuBLAS of a table-only row class), "measured" (now), "cached" (measured by an
    earlier process) or "safe"."""

    kernel: str
    config: Optional[Config]
    source: str


_FALLBACKS: dict[tuple[int, int, int, int], Choice] = {}


def m_class(m: int) -> int:
    """Config row class of M rows (1 <= M <= 64): 1, 4 (M <= 4), 16 (M <= 16), 32 (M <= 32) or 64."""
    return 1 if m == 1 else 4 if m <= 4 else 16 if m <= 16 else 32 if m <= 32 else 64


def choose(n: int, k: int, m: int, table: Table, safe: Callable[[], Config],
           device_index: Callable[[], int]) -> Choice:
    """The kernel for `m` rows of weight `[n, k]`: the table's entry, else this device's chosen fallback, else the
    safe config (`safe()`, evaluated only then; `device_index()` only past the table)."""
    key = (n, k, m_class(m))
    if key in table:
        entry = table[key]
        return Choice("cublas", None, "table") if entry is None else Choice("skinny", tuple(entry), "table")
    if key[2] in TABLE_ONLY_CLASSES:
        return Choice("cublas", None, "untabled")
    chosen = _FALLBACKS.get((device_index(), *key))
    if chosen is not None:
        return chosen
    return Choice("skinny", tuple(safe()), "safe")


def decide(cublas_s: float, safe_s: float, safe_config: Config, source: str = "measured") -> Choice:
    """The fallback from seconds per call: cuBLAS unless the safe config was strictly faster."""
    if safe_s < cublas_s:
        return Choice("skinny", tuple(safe_config), source)
    return Choice("cublas", None, source)


def needs_choice(device_index: int, n: int, k: int, mc: int, table: Table) -> bool:
    return mc in MEASURED_CLASSES and (n, k, mc) not in table and (device_index, n, k, mc) not in _FALLBACKS


def record(device_index: int, n: int, k: int, mc: int, choice: Choice) -> None:
    if mc not in MEASURED_CLASSES or choice.kernel not in KERNELS or choice.source not in ("measured", "cached"):
        raise ValueError(f"not a measured fallback for row class {mc}: {choice}")
    _FALLBACKS[(device_index, n, k, mc)] = choice


def fallbacks() -> dict[tuple[int, int, int, int], Choice]:
    """A copy of the chosen fallbacks, keyed by (device index, N, K, row class)."""
    return dict(_FALLBACKS)


def clear_fallbacks() -> None:
    _FALLBACKS.clear()


def merge_forms(uses: Iterable[tuple[tuple[int, int], str]]) -> dict[tuple[int, int], str]:
    """{(N, K): form} of (shape, form) uses; a shape used in two forms is measured "plain" (the GEMMs alone)."""
    forms: dict[tuple[int, int], str] = {}
    for shape, form in uses:
        if form not in FORMS:
            raise ValueError(f"form {form!r} of {shape}: not one of {FORMS}")
        forms[shape] = form if forms.get(shape, form) == form else "plain"
    return forms


def projection_shapes(model: nn.Module) -> list[tuple[int, int]]:
    """The distinct (N, K) weight shapes of the model's dense projections and LM head (the modules that carry a
    `gemm`: `parallel.layers`), in module order; MoE experts and routers are not among them."""
    shapes: list[tuple[int, int]] = []
    for mod in model.modules():
        w = getattr(mod, "weight", None)
        if hasattr(type(mod), "gemm") and w is not None and w.dim() == 2 and tuple(w.shape) not in shapes:
            shapes.append((int(w.shape[0]), int(w.shape[1])))
    return shapes


# ---- the disk cache

def default_cache_path() -> Path:
    return Path.home() / ".cache" / "graphline" / "projection_choice.json"


@dataclass(frozen=True)
class MeasureContext:
    """What a measured choice depends on besides the shape: the GPU's name, library versions, dtype, PDL mode."""

    gpu: str
    torch: str
    cuda: str
    triton: str
    dtype: str
    pdl: int

    def key(self, n: int, k: int, mc: int, form: str = "plain") -> str:
        return (f"{self.gpu}|torch {self.torch}|cuda {self.cuda}|triton {self.triton}|{self.dtype}|pdl {self.pdl}"
                f"|{n}x{k}|m{mc}" + ("" if form == "plain" else f"|{form}"))


def load_cache(path: Path) -> dict[str, dict]:
    """The cache's entries by `MeasureContext.key`; {} for a missing, unreadable or corrupt file."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return {}
    entries = data.get("entries") if isinstance(data, dict) and data.get("version") == CACHE_VERSION else None
    return {k: v for k, v in entries.items() if isinstance(v, dict)} if isinstance(entries, dict) else {}


def save_cache(path: Path, new: Mapping[str, dict]) -> None:
    """Merge `new` into the file's entries and replace it atomically; an OSError (read-only home) only logs."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        entries = {**load_cache(path), **new}
        fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({"version": CACHE_VERSION, "entries": entries}, f, indent=1, sort_keys=True)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as e:
        log.warning("projection choice cache %s not written: %s", path, e)


def _cached_choice(entry: object, safe_config: Config) -> Optional[Choice]:
    """The choice a cache entry holds, or None when it is malformed or was measured against another safe config."""
    if not isinstance(entry, dict) or entry.get("kernel") not in KERNELS:
        return None
    if entry.get("safe_config") != list(safe_config):
        return None
    return Choice("cublas", None, "cached") if entry["kernel"] == "cublas" else Choice("skinny", safe_config, "cached")


def resolve(wanted: Iterable[Key], device_index: int, context: MeasureContext, table: Table,
            safe: Callable[[int, int, int], Config], measure: Callable[[int, int, int, Config], tuple[float, float]],
            cache_path: Optional[Path], form_of: Optional[Callable[[int, int, int], str]] = None) -> dict[Key, Choice]:
    """Choose and `record` the fallback of every (N, K, row class) in `wanted` that is neither in `table` nor
    chosen on this device yet: the cache's entry for `context` and the key's form (`form_of(n, k, mc)`, one of
    FORMS; None: all "plain") when it holds one for today's `safe(n, k, mc)`, else `measure(n, k, mc, safe config)
    -> (cuBLAS s, safe config s)` per call, decided by `decide` and written to the cache (`cache_path` None: no
    cache). Returns {(N, K, row class): Choice} of what it chose now."""
    todo = [key for key in dict.fromkeys(wanted) if needs_choice(device_index, *key, table)]
    cached = load_cache(cache_path) if todo and cache_path is not None else {}
    done: dict[Key, Choice] = {}
    new: dict[str, dict] = {}
    for n, k, mc in todo:
        cfg = tuple(int(v) for v in safe(n, k, mc))
        form = form_of(n, k, mc) if form_of is not None else "plain"
        if form not in FORMS:
            raise ValueError(f"form {form!r} of {n}x{k} at row class {mc}: not one of {FORMS}")
        key = context.key(n, k, mc, form)
        choice = _cached_choice(cached.get(key), cfg)
        if choice is None:
            cublas_s, safe_s = measure(n, k, mc, cfg)
            choice = decide(cublas_s, safe_s, cfg)
            new[key] = {"kernel": choice.kernel, "safe_config": list(cfg), "cublas_us": round(cublas_s * 1e6, 3),
                        "safe_us": round(safe_s * 1e6, 3), "form": form}
        record(device_index, n, k, mc, choice)
        done[(n, k, mc)] = choice
    if new and cache_path is not None:
        save_cache(cache_path, new)
    if done:
        log.info("projection fallbacks on device %d: %d measured, %d from %s", device_index, len(new),
                 len(done) - len(new), cache_path)
    return done
