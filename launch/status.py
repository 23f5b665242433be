"""The `/status` document: executor status (coordinator or local) normalised to one shape per rank,
plus engine queues and server facts. The dashboard and the Prometheus collector read this shape (the coordinator's
`summarize_status` entries carry the runner snapshot under `runner`; `LocalEngineExecutor` mimics it):

    ranks[i] = {rank, dp_rank, tp_rank, ep_rank, node, device, alive,
                steps{path: n}, eager_reasons{reason: n}, tokens{real, padded, real_total, padded_total,
                padding_waste}, capture{decode{bucket: {seconds, graph}}, prefill{...}, decode_seconds_total,
                prefill_seconds_total, decode_graphs, prefill_plans}, memory{decode_graph_pool_bytes,
                piecewise_graph_pool_bytes, bridge_bytes, static_buffer_bytes}, resets,
                plans{decode: [buckets], prefill: [buckets]} (captured as graphs), kv_blocks, kv_bytes,
                memory_allocated, memory_reserved, timings{...}}
"""
from __future__ import annotations

import time
from typing import Any, Optional

_RUNNER_KEYS = ("steps", "eager_reasons", "tokens", "capture", "memory", "resets")
_EMPTY_RUNNER: dict[str, Any] = {
    "steps": {}, "eager_reasons": {}, "tokens": {"real": {}, "padded": {}, "real_total": 0, "padded_total": 0,
                                                  "padding_waste": 0.0},
    "capture": {"decode": {}, "prefill": {}, "decode_seconds_total": 0.0, "prefill_seconds_total": 0.0,
                "decode_graphs": 0, "prefill_plans": 0},
    "memory": {}, "resets": 0,
}


def _find_runner(rank: dict) -> dict:
    """The runner-stats snapshot inside a rank entry, wherever the executor put it."""
    for cand in (rank.get("runner"), (rank.get("stats") or {}).get("runner") if isinstance(rank.get("stats"), dict)
                 else None, rank.get("stats"), rank):
        if isinstance(cand, dict) and "steps" in cand and isinstance(cand["steps"], dict):
            return cand
    return {}


def _rank_list(raw: dict) -> list[dict]:
    ranks = raw.get("ranks")
    if isinstance(ranks, dict):
        ranks = [dict(v, rank=v.get("rank", int(k)) if str(k).isdigit() else v.get("rank", i))
                 for i, (k, v) in enumerate(sorted(ranks.items(), key=lambda kv: str(kv[0]).zfill(6)))]
    return [r for r in (ranks or []) if isinstance(r, dict)]


def normalize_rank(i: int, rank: dict) -> dict:
    runner = _find_runner(rank)
    stats = rank.get("stats") if isinstance(rank.get("stats"), dict) else {}
    out: dict[str, Any] = {}
    for k, v in {**stats, **rank}.items():
        if k not in ("runner", "stats"):
            out[k] = v
    if isinstance(out.get("steps"), (int, float)):  # the worker's own step count (coordinator status)
        out["rank_steps"] = out["steps"]
    dev_mem = out.get("memory") if isinstance(out.get("memory"), dict) else {}
    for k in ("memory_allocated", "memory_reserved"):  # device memory, kept apart from the runner's graph memory
        if k in dev_mem:
            out.setdefault(k, dev_mem[k])
    for k in _RUNNER_KEYS:
        out[k] = runner.get(k, _EMPTY_RUNNER[k])
    out.setdefault("rank", i)
    out["rank"] = int(out["rank"]) if isinstance(out["rank"], (int, float, str)) and str(out["rank"]).isdigit() else i
    for k in ("dp_rank", "tp_rank", "ep_rank"):
        out.setdefault(k, 0 if k != "dp_rank" else out["rank"])
    out.setdefault("alive", True)
    cap = out.get("capture") or {}
    out["plans"] = {kind: sorted(int(b) for b, v in (cap.get(kind) or {}).items()
                                 if not isinstance(v, dict) or v.get("graph", True))
                    for kind in ("decode", "prefill")}  # buckets served by a captured graph / plan
    tokens = out.get("tokens") or {}
    padded, real = tokens.get("padded_total", 0), tokens.get("real_total", 0)
    out["padding_waste"] = tokens.get("padding_waste", (padded - real) / padded if padded else 0.0)
    return out


def normalize_status(raw: Optional[dict]) -> dict:
    raw = dict(raw or {})
    ranks = [normalize_rank(i, r) for i, r in enumerate(_rank_list(raw))]
    rest = {k: v for k, v in raw.items() if k != "ranks"}
    resets = raw.get("resets", [])
    failures = raw.get("failures", [])
    return {
        "ranks": ranks,
        "state": raw.get("state") or raw.get("phase"),
        "phases": raw.get("phases") if isinstance(raw.get("phases"), dict) else {},
        "resets": resets if isinstance(resets, list) else [],
        "num_resets": len(resets) if isinstance(resets, list) else int(resets or 0),
        "failures": failures if isinstance(failures, list) else [],
        "num_failures": len(failures) if isinstance(failures, list) else int(failures or 0),
        "executor": rest,
    }


def build_status(raw_executor: Optional[dict], engine_stats: dict, server: dict, reset_log: list[dict],
                 failure_log: list[dict]) -> dict:
    """`reset_log` / `failure_log`: the engine's own history (time, figures / message), shown when the
    executor reports only counts."""
    norm = normalize_status(raw_executor)
    ex = norm["executor"]
    return {
        "time": time.time(),
        **server,
        "engine": engine_stats,
        "ranks": norm["ranks"],
        "state": norm["state"],
        "phases": norm["phases"],
        "step_path": ex.get("step_path"),
        "overhead": ex.get("overhead"),
        "resets": norm["resets"] or reset_log,
        "num_resets": max(norm["num_resets"], len(reset_log)),
        "failures": norm["failures"] or failure_log,
        "num_failures": max(norm["num_failures"], len(failure_log)),
        "executor_status": ex,
    }
