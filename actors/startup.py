"""Start-up of a rank group (Ray, placement, groups, weights, KV, runners), the lock-step capture
protocol, and the JSON status summary. Helpers of `actors.coordinator`, which owns the state."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import ray

from actors.environment import python_path
from actors.errors import StartupCaptureError
from actors.placement import ActorPlace, PlacementError, bundle_strategy, cluster_has_gpus, create_placement_group, describe_places, \
    order_ranks
from actors.rankset import RankCallError, RankSet
from actors.worker import RankWorker
from parallel.topology import Topology

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class Launched:
    ranks: RankSet
    owns_ray: bool
    use_gpu: bool
    model_config: Any
    num_kv_blocks: int
    sizes: tuple[list[int], list[int]]
    timings: dict[str, float]
    ranks_see_all_gpus: bool = False


def requested_step_path(cfg: Any) -> str:
    """The step path a `DeploymentConfig` asks for: its driver options' override, else its own `step_path`."""
    return cfg.driver.step_path or cfg.step_path


def ensure_ray(address: Optional[str], num_cpus: Optional[int]) -> bool:
    """Connect to `address` or start a local Ray; returns True when this call started it. Ray's token
    authentication stays as Ray sets it (on for a local cluster since Ray 2.59; `launch/cluster.sh` turns it on
    for the clusters it starts): nothing here weakens it."""
    if ray.is_initialized():
        return False
    if address is not None:
        ray.init(address=address, include_dashboard=False, log_to_driver=True)
    else:
        ray.init(num_cpus=num_cpus, include_dashboard=False,
                 runtime_env={"env_vars": {"PYTHONPATH": python_path(_REPO_ROOT)}})
    return True


def actor_phases(places: Sequence[ActorPlace], since: float) -> dict[str, float]:
    """Where the actors' start went, from their reported wall-clock moments (`ActorPlace.started`; one host's
    clock), slowest actor per entry, in seconds after `since` (the placement group was ready): "init_begin" (the
    actor's __init__ began: Ray started the process and loaded the actor class), "init_end"; and "torch_import",
    the seconds __init__ spent importing torch."""
    out: dict[str, float] = {}
    for name, key in (("init_begin", "constructing"), ("init_end", "constructed")):
        vals = [p.started[key] - since for p in places if key in p.started]
        if vals:
            out[name] = max(vals)
    vals = [p.started["torch"] - p.started["constructing"] for p in places if "torch" in p.started]
    if vals:
        out["torch_import"] = max(vals)
    return out


def launch_ranks(cfg: Any, topo: Topology, test_faults: dict[int, dict]) -> Launched:
    """Everything of start-up before capture. On failure every actor is killed, then the error propagates."""
    t0 = time.perf_counter()
    owns = ensure_ray(cfg.address, cfg.num_cpus)
    ray_init_s = time.perf_counter() - t0
    use_gpu = cfg.use_gpu if cfg.use_gpu is not None else (cfg.runtime.device != "cpu" and cluster_has_gpus())
    if use_gpu is False and cfg.runtime.device.startswith("cuda"):
        raise PlacementError(f"--device {cfg.runtime.device} needs GPUs, but the Ray cluster has none "
                             "(ray status shows its resources); use --device cpu or auto")
    timeout = cfg.collective_timeout_s + 120.0
    pg = create_placement_group(topo.world, use_gpu, timeout_s=timeout)
    t_pg, wall_pg = time.perf_counter(), time.time()
    # TP ranks see every GPU of their node and bind their own by id: symmetric memory (the TP all-reduce)
    # tells peers apart by device index, and under Ray's default isolation every rank would be cuda:0.
    # Not with compiled graphs: Ray's compiled-graph device setup requires its own per-actor CUDA_VISIBLE_DEVICES.
    see_all = use_gpu and topo.tp > 1 and requested_step_path(cfg) != "compiled"
    opts: dict[str, Any] = {"runtime_env": {"env_vars": {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}}} \
        if see_all else {}
    workers = [RankWorker.options(num_cpus=1, num_gpus=1 if use_gpu else 0, scheduling_strategy=bundle_strategy(pg, i),
                                  **opts).remote(i) for i in range(topo.world)]
    ranks = RankSet(workers, [], pg)
    try:
        places: list[ActorPlace] = ranks.call("place", timeout_s=timeout, what="actor start")
        order = order_ranks(places)
        ranks = RankSet([workers[i] for i in order], [places[i] for i in order], pg)
        for r, faults in test_faults.items():
            ray.get(ranks.workers[r]._test_set_faults.remote(**faults), timeout=30)
        t_placed = time.perf_counter()
        timings: dict[str, Any] = {"ray_s": t_placed - t0, "ray_init_s": ray_init_s,
                                   "placement_group_s": t_pg - t0 - ray_init_s, "actor_start_s": t_placed - t_pg,
                                   "actor_phases_s": actor_phases(places, wall_pg)}
        if use_gpu:  # attention compiles overlap the groups, weights and KV phases (`actors.kernel_warm_up`)
            ranks.call("start_kernel_warm_up", [(cfg.runtime, topo.tp, cfg.runtime.device, topo.coords(r).tp_rank,
                                                 cfg.comm) for r in range(topo.world)],
                       per_rank=True, timeout_s=timeout, what="kernel warm-up start")
        t1 = time.perf_counter()
        coll = cfg.collective_timeout_s
        rv = ranks.call("serve_rendezvous", (topo.world, coll), ranks=[0], timeout_s=timeout)[0]
        per_rank = ranks.call("init_groups", [(r, topo, rv, use_gpu, cfg.runtime.device, coll, cfg.runtime,
                                               cfg.comm) for r in range(topo.world)],
                              per_rank=True, timeout_s=timeout, what="process groups")
        timings["group_phases_s"] = {k: max(t[k] for t in per_rank) for k in per_rank[0]}  # slowest rank per phase
        t2 = time.perf_counter()
        infos = ranks.call("build_runtime", (cfg.runtime, cfg.ep_backend), timeout_s=timeout, what="build runtime")
        timings["groups_s"] = time.perf_counter() - t1
        timings["build_runtime_s"] = time.perf_counter() - t2
        model_config = infos[0]["model_config"]
        if topo.ep_enabled and not model_config.is_moe:
            raise ValueError(f"ep={topo.ep} needs a MoE model; {cfg.runtime.model!r} is dense")
        t1 = time.perf_counter()
        ranks.call("load_model", timeout_s=timeout + 1200.0, what="weight load")
        timings["weights_s"] = time.perf_counter() - t1
        t1 = time.perf_counter()
        budgets = ranks.call("kv_blocks_for_budget", timeout_s=timeout, what="KV budget")
        n_blocks = min(budgets)
        ranks.call("allocate_kv_cache", (n_blocks,), timeout_s=timeout, what="KV allocation")
        timings["kv_s"] = time.perf_counter() - t1
        t1 = time.perf_counter()
        ranks.call("build_runner", timeout_s=timeout, what="runner")  # waits for the attention kernels' warm-up
        timings["runner_s"] = time.perf_counter() - t1
        sizes = ranks.call("capture_sizes", timeout_s=timeout, what="capture sizes")
        if any(tuple(map(tuple, s)) != tuple(map(tuple, sizes[0])) for s in sizes):
            raise StartupCaptureError(f"ranks disagree on capture buckets: {sizes}")
    except BaseException:
        ranks.kill()
        if owns:
            ray.shutdown()
        raise
    return Launched(ranks, owns, use_gpu, model_config, n_blocks, (list(sizes[0][0]), list(sizes[0][1])), timings,
                    see_all)


def capture_all(ranks: RankSet, decode: Sequence[int], prefill: Sequence[int], *, timeout_s: float,
                progress: bool) -> dict[str, float]:
    """Lock-step capture: every rank captures bucket i before any rank starts bucket i + 1.

    Returns wall seconds per bucket ("decode:8", "prefill:512", ...). On a failure every
    surviving rank resets its runner (nothing stays published) and StartupCaptureError is
    raised; a rank that is dead or stuck makes the whole group be torn down instead.
    """
    from tqdm.auto import tqdm

    buckets = [("decode", b) for b in decode] + [("prefill", t) for t in prefill]
    per_bucket: dict[str, float] = {}
    bar = tqdm(total=len(buckets), desc=f"capture x{len(ranks)} ranks", unit="bucket", disable=not progress,
               leave=False)
    try:
        for kind, b in buckets:
            t0 = time.perf_counter()
            try:
                ranks.call("capture", (kind, b), timeout_s=timeout_s, what=f"capture {kind}:{b}", fail_fast=False)
            except RankCallError as e:
                raise _abort(ranks, e) from None
            per_bucket[f"{kind}:{b}"] = time.perf_counter() - t0
            bar.update(1)
            bar.set_postfix_str(f"{kind}:{b} {per_bucket[f'{kind}:{b}']:.2f}s")
    finally:
        bar.close()
    return per_bucket


def _abort(ranks: RankSet, e: RankCallError) -> StartupCaptureError:
    what = f"{e.what} failed: " + "; ".join(str(f) for f in e.faults)
    if any(f.kind in ("died", "hung") for f in e.faults):
        ranks.kill()
        return StartupCaptureError(f"{what}; a rank is dead or stuck, so every rank was torn down; nothing published")
    try:
        ranks.call("abort_capture", timeout_s=120.0, what="capture abort", fail_fast=False)
    except RankCallError as e2:
        ranks.kill()
        return StartupCaptureError(f"{what}; aborting failed too ({e2}), every rank was torn down")
    return StartupCaptureError(f"{what}; all {len(ranks)} ranks reset their runners, nothing published")


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if hasattr(x, "item") and callable(x.item):
        try:
            return x.item()
        except (ValueError, TypeError):
            pass
    return str(x)


def summarize_status(coord: Any, infos: Sequence[Optional[dict]]) -> dict:
    """The coordinator's JSON status: global counters plus one entry per rank."""
    c, topo = coord._c, coord.topo
    ranks = coord._ranks  # read once: another thread may tear the group down meanwhile
    places = describe_places(ranks.places, range(len(ranks.places))) if ranks is not None else []
    per_rank = []
    for r in range(topo.world):
        co = topo.coords(r)
        entry: dict[str, Any] = {"rank": r, "dp_rank": co.dp_rank, "tp_rank": co.tp_rank, "ep_rank": co.ep_rank,
                                 "alive": bool(r < len(infos) and infos[r] is not None)}
        if r < len(places):
            entry.update({k: places[r][k] for k in ("node_id", "node_ip", "gpu_ids", "pid")})
        info = infos[r] if r < len(infos) else None
        if info:
            rt = info.get("runtime", {})
            entry.update(device=info.get("device"), phase=info.get("phase"), steps=info.get("steps"),
                         in_rank_step_ms_mean=info.get("in_rank_step_ms_mean"), runner=rt.get("runner"),
                         capture=(rt.get("runner") or {}).get("capture"), timings=rt.get("timings"),
                         kv_blocks=rt.get("kv_blocks"), kv_bytes=rt.get("kv_bytes"),
                         tp_allreduce=info.get("tp_allreduce"), head_graphs=rt.get("head_graphs"),
                         decode_lane_steps=rt.get("decode_lane_steps"), armed_decode=rt.get("armed_decode"),
                         memory={k: rt[k] for k in ("memory_allocated", "memory_reserved") if k in rt})
        per_rank.append(entry)
    steps = max(c.steps, 1)
    out = {
        "state": coord._state,
        "topology": {"world": topo.world, "tp": topo.tp, "dp": topo.dp, "ep": topo.ep,
                     "ep_backend": coord.cfg.ep_backend},
        "step_path": coord.step_path,
        "ray_address": ray.get_runtime_context().gcs_address if ray.is_initialized() else None,
        "health": coord.health(),
        "last_phase": c.last_phase,
        "phases": dict(c.phases),
        "steps": c.steps,
        "resets": c.resets,
        "failures": c.failures,
        "last_failure": c.last_failure,
        "num_kv_blocks": coord._num_kv_blocks,
        "startup": coord._startup,
        "overhead": {"driver_step_ms_mean": 1e3 * c.driver_s / steps, "in_rank_step_ms_mean": 1e3 * c.in_rank_s / steps,
                     "coordinator_ms_mean": 1e3 * (c.driver_s - c.in_rank_s) / steps},
        "last_reset_events": {str(r): [e["kind"] for e in ev] for r, ev in coord._last_reset_events.items()},
        "ranks": per_rank,
    }
    return _jsonable(out)
