"""What the engine needs from an executor, and the single-process adapter around `LocalExecutor`.

The engine drives any object with this surface (`actors.coordinator.Coordinator` has it):
    model_config (vocab_size), num_kv_blocks (per DP rank), block_size, dp_size,
    step(batches: list[StepBatch | None], num_steps=1) -> list[np.ndarray | None] (int64 `[B]`, or
        `[B, num_steps]` for multi-step decode of greedy decode batches),
    status() -> dict, reset(recapture=True, num_kv_blocks=None, reload_weights=False) -> dict,
    and optionally max_model_len, rebuild() (a `RebuildableExecutor`), shutdown(), idle() (called after a step
    that left nothing to run: `Coordinator.idle` cancels decode steps the ranks armed), and the two halves of
    `step` for overlapped scheduling: submit(batches, num_steps=1) -> ticket (token ids may refer to the
    previous round's tokens, `actors.batch.prev_token`), collect(ticket) -> what `step` returns (in
    submission order).
"""
from __future__ import annotations

import time
from typing import Any, Optional, Protocol, Sequence, runtime_checkable

import numpy as np

from actors.batch import StepBatch


@runtime_checkable
class Executor(Protocol):
    @property
    def num_kv_blocks(self) -> int: ...

    @property
    def block_size(self) -> int: ...

    @property
    def dp_size(self) -> int: ...

    def step(self, batches: Sequence[Optional[StepBatch]], num_steps: int = 1) -> list[Optional[np.ndarray]]: ...

    def status(self) -> dict: ...

    def reset(self, recapture: bool = True, num_kv_blocks: Optional[int] = None,
              reload_weights: bool = False) -> dict: ...


@runtime_checkable
class RebuildableExecutor(Protocol):
    """An executor that restarts after a failure: `rebuild()` brings up a fresh rank group (KV contents lost,
    `num_kv_blocks` read again after it). `actors.coordinator.Coordinator` and `engine.testing.PagedToyExecutor`
    are; `LocalEngineExecutor` is not (a failure there raises from its step and nothing restarts it)."""

    def rebuild(self) -> None: ...


def executor_max_model_len(executor: Any) -> Optional[int]:
    """The executor's max_model_len, wherever it keeps it (None if it does not say)."""
    for path in ("max_model_len", "cfg.runtime.max_model_len", "cfg.max_model_len", "config.runtime.max_model_len"):
        obj = executor
        try:
            for part in path.split("."):
                obj = getattr(obj, part)
        except AttributeError:
            continue
        if isinstance(obj, int):
            return obj
    return None


class LocalEngineExecutor:
    """`actors.local.LocalExecutor` (one rank, this process, no Ray) with the engine's executor surface.

    Start-up captures every decode then every prefill bucket, like the coordinator, with a
    progress bar. `status()` reports one rank in the coordinator's shape.
    """

    def __init__(self, runtime_cfg):
        from actors.local import LocalExecutor

        self.cfg = runtime_cfg
        self.local = LocalExecutor(runtime_cfg)
        self.timings: dict[str, float] = {}
        self.resets: list[dict] = []
        self.started_at: Optional[float] = None

    # ---- surface
    @property
    def runtime(self):
        return self.local.runtime

    @property
    def model_config(self):
        return self.local.runtime.model_config

    @property
    def num_kv_blocks(self) -> int:
        return self.local.num_kv_blocks

    @property
    def block_size(self) -> int:
        return self.cfg.block_size

    @property
    def dp_size(self) -> int:
        return 1

    @property
    def max_model_len(self) -> int:
        return self.cfg.max_model_len

    def start(self, progress: bool = True) -> dict:
        t0 = time.perf_counter()
        self.timings = self.local.start(progress)
        self.timings["start_s"] = time.perf_counter() - t0
        self.started_at = time.time()
        return dict(self.timings)

    def step(self, batches: Sequence[Optional[StepBatch]], num_steps: int = 1) -> list[Optional[np.ndarray]]:
        if batches[0] is None:
            return [None]
        return self.local.step(batches, num_steps)

    def submit(self, batches: Sequence[Optional[StepBatch]], num_steps: int = 1) -> Any:
        """Launch one round on the device without waiting (the runtime checks previous-step references)."""
        if len(batches) != 1:
            raise ValueError(f"a local executor has one DP rank, got {len(batches)} batches")
        if batches[0] is None:
            return None
        return self.local.runtime.launch(batches[0], num_steps=num_steps)

    def collect(self, ticket: Any) -> list[Optional[np.ndarray]]:
        return [None if ticket is None else ticket.result()]

    def check_batch(self, dp_rank: int, batch: StepBatch) -> None:
        """Raise BatchError when `batch` could not run on this rank; runs nothing."""
        self.local.runtime.check_batch(batch)

    def health(self) -> dict:
        """The one in-process rank serves once started (a failure there raises in `step`)."""
        ok = self.started_at is not None
        return {"ok": ok, "state": "serving" if ok else "starting", "reason": None if ok else "starting",
                "ranks": [], "generation": 1}

    def reset(self, recapture: bool = True, num_kv_blocks: Optional[int] = None, reload_weights: bool = False) -> dict:
        rt = self.local.runtime
        t0 = time.perf_counter()
        rt.reset()
        out: dict[str, Any] = {"reset_s": time.perf_counter() - t0}
        if reload_weights:
            out["weights_s"] = rt.load_model()
        if num_kv_blocks is not None:
            t1 = time.perf_counter()
            rt.allocate_kv_cache(num_kv_blocks)
            out["kv_cache_s"] = time.perf_counter() - t1
        if reload_weights:  # the runner holds the model; a KV resize only needs the (already dropped) graphs gone
            rt.build_runner()
        if recapture:
            rt.capture_all()
            out["capture_s"] = rt.timings["capture_s"]
        out["total_s"] = time.perf_counter() - t0
        self.resets.append({"time": time.time(), **out})
        return out

    def status(self) -> dict:
        stats = self.local.runtime.stats()
        rank = {"rank": 0, "dp_rank": 0, "tp_rank": 0, "ep_rank": 0, "node": "local", "alive": True, **stats}
        return {  # the coordinator's status shape (actors.startup.summarize_status), one rank
            "executor": "local",
            "state": "serving" if self.started_at else "starting",
            "topology": {"world": 1, "tp": 1, "dp": 1, "ep": 1},
            "step_path": "local",
            "startup": dict(self.timings),
            "ranks": [rank],
            "resets": list(self.resets),
            "failures": 0,
        }

    def shutdown(self) -> None:
        pass
