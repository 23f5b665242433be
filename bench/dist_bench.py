"""Distributed benchmark: coordinator overhead per decode step, TP=2 vs TP=1, start-up split.

    python -m bench.dist_bench --out artifacts/dist_bench.json                     # qwen3-0.6b, GPUs
    python -m bench.dist_bench --model qwen3-tiny --device cpu --out /tmp/d.json   # CPU smoke check

For each TP size: start a coordinator (timings: Ray, process groups, weights, KV, capture),
then for each step path (pipe, compiled graph, plain actor calls) and each batch size run decode
steps through `Coordinator.step` (inputs in, next tokens back on the driver); on the pipe path
also calls of `--decode-steps` decode steps each (multi-step decode, reported per token). Each rank
records the time of its `execute` call (host-to-device, forward or graph replay, LM head,
sampling, device-to-host); the coordinator overhead of a step is the driver's end-to-end
time minus the slowest rank's in-rank time of that step. Medians are reported.

"ahead" (pipe path): the same decode steps submitted one ahead of their collection
(`Coordinator.submit` / `collect`), every token id a reference to the previous step's token
(`prev_token`), as a serving loop that keeps the device busy would run them; reported is the
interval between consecutive steps' tokens arriving on the driver.

`--armed-wait-ms 20,0` runs TP=1 once per value of `RuntimeConfig.armed_decode_wait_ms`, side by side: with
armed decode (`actors.armed`: after a strict greedy decode step the rank enqueues the next one behind a gate)
and without it; ranks with TP > 1 never arm and run once.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from typing import Any, Optional

import numpy as np

from actors.batch import SamplerExtras, StepBatch, prev_token
from actors.coordinator import Coordinator, DeploymentConfig
from actors.rank import RuntimeConfig
from bench.common import write_json
from graphrunner.config import GraphRunnerConfig


def decode_batch(batch: int, context: int, block_size: int, num_blocks: int, vocab: int, steps: int = 1) -> StepBatch:
    """`batch` sequences with `context` cached tokens each, one new token (KV content is irrelevant here);
    block tables cover `steps` decode steps."""
    per = -(-(context + steps) // block_size)
    tables = np.zeros((batch, per), dtype=np.int32)
    for i in range(batch):  # distinct blocks while the cache is large enough, then shared (timing only)
        tables[i] = 1 + (np.arange(per) + i * per) % (num_blocks - 1)
    rng = np.random.default_rng(batch)
    return StepBatch(token_ids=rng.integers(0, vocab, batch, dtype=np.int64), q_seqlens=np.ones(batch, np.int32),
                     num_history=np.full(batch, context, np.int32), block_tables=tables,
                     temperature=np.zeros(batch, np.float32), top_k=np.zeros(batch, np.int32),
                     top_p=np.ones(batch, np.float32), seeds=np.full(batch, -1, np.int64))


SAMPLING_MODES = {
    # name: (temperature, top_k, top_p, top-N logprobs or -1)
    "greedy": (0.0, 0, 1.0, -1),
    "t1_p0.9": (1.0, 0, 0.9, -1),
    "t1_k50": (1.0, 50, 1.0, -1),
    "t1": (1.0, 0, 1.0, -1),
    "greedy_lp5": (0.0, 0, 1.0, 5),
    "t1_p0.9_lp5": (1.0, 0, 0.9, 5),
}


def with_sampling(batch: StepBatch, mode: str) -> StepBatch:
    """`batch` with every row sampled as `mode` (a `SAMPLING_MODES` key) and seeded by its row index."""
    temp, top_k, top_p, logprobs = SAMPLING_MODES[mode]
    b = batch.batch_size
    # a logprobs-only step's extras as the engine builds them (`engine.sampling_rows.build_extras`)
    extras = None if logprobs < 0 else SamplerExtras.off(b, logprobs)
    return dataclasses.replace(batch, temperature=np.full(b, temp, np.float32), top_k=np.full(b, top_k, np.int32),
                               top_p=np.full(b, top_p, np.float32),
                               seeds=np.arange(b, dtype=np.int64) if temp > 0 else np.full(b, -1, np.int64),
                               extras=extras)


def measure(coord: Coordinator, batch: StepBatch, steps: int, warmup: int, num_steps: int = 1) -> dict[str, float]:
    for _ in range(warmup):
        coord.step([batch], num_steps=num_steps)
    coord.rank_step_times(clear=True)
    e2e = []
    for _ in range(steps):
        t0 = time.perf_counter()
        coord.step([batch], num_steps=num_steps)
        e2e.append(time.perf_counter() - t0)
    per_rank = [t[-steps:] for t in coord.rank_step_times(clear=True)]
    in_rank = [max(ts) for ts in zip(*per_rank)]
    over = [a - b for a, b in zip(e2e, in_rank)]
    med = statistics.median
    return {"e2e_ms": 1e3 * med(e2e), "in_rank_ms": 1e3 * med(in_rank), "overhead_ms": 1e3 * med(over),
            "overhead_pct": 100.0 * med(over) / med(in_rank), "e2e_p90_ms": 1e3 * sorted(e2e)[int(0.9 * len(e2e))]}


def measure_ahead(coord: Coordinator, batch: StepBatch, steps: int, warmup: int) -> dict[str, float]:
    """Decode steps submitted one ahead, token ids referring to the previous step: the interval between
    consecutive steps' tokens reaching the driver (median and p90, ms)."""
    ahead = dataclasses.replace(batch, token_ids=np.array([prev_token(i) for i in range(batch.batch_size)],
                                                          dtype=np.int64))
    coord.step([batch])  # the ranks' previous step, which the first references point at
    ticket = coord.submit([ahead])
    for _ in range(warmup):
        nxt = coord.submit([ahead])
        coord.collect(ticket)
        ticket = nxt
    gaps, last = [], time.perf_counter()
    for _ in range(steps):
        nxt = coord.submit([ahead])
        coord.collect(ticket)
        now = time.perf_counter()
        gaps.append(now - last)
        last, ticket = now, nxt
    coord.collect(ticket)
    gaps.sort()
    return {"ahead_ms": 1e3 * statistics.median(gaps), "ahead_p90_ms": 1e3 * gaps[int(0.9 * len(gaps))]}


def add_armed_wait_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--armed-wait-ms", default="",
                   help="comma list: one TP=1 run per RuntimeConfig.armed_decode_wait_ms (0 = never arm), side by "
                        "side; empty: the default once")


def armed_waits(args: Any, tp: int) -> list[Optional[float]]:
    """The `--armed-wait-ms` values to run at this TP size (None: the runtime's default). TP ranks arm too
    (collectively, `actors.armed`), so every size runs each value."""
    return [float(x) for x in args.armed_wait_ms.split(",") if x.strip()] or [None]


def make_coordinator(args: Any, tp: int, armed_wait_ms: Optional[float] = None,
                     driver: Optional[Any] = None) -> Coordinator:
    """A coordinator (not started) for the parsed benchmark `args`: model, device, decode and prefill bucket
    limits, KV blocks (`--kv-blocks`, 0 or absent: from the memory budget), CPUs for a local Ray; armed decode
    waits `armed_wait_ms` (None: the runtime's default; 0: never arms). Options come from the environment as for
    `graphline serve` (`actors.environment.options_from_environ`); `driver` replaces the driver options."""
    from actors.environment import options_from_environ

    opts = options_from_environ()
    graph = GraphRunnerConfig(max_decode_batch=args.max_decode_batch, pcg_max_tokens=args.pcg_max_tokens,
                              prefill_graph_max_tokens=getattr(args, "prefill_graph_max_tokens", 0) or 0)
    kv_blocks = getattr(args, "kv_blocks", 0)
    extra = {} if armed_wait_ms is None else {"armed_decode_wait_ms": armed_wait_ms}
    rt = RuntimeConfig(model=args.model, device=args.device, graph=graph, num_kv_blocks=kv_blocks or None,
                       kernels=opts.kernels, **extra)
    return Coordinator(DeploymentConfig(runtime=rt, tp=tp, use_gpu=False if args.device == "cpu" else None,
                                        num_cpus=args.num_cpus, comm=opts.comm,
                                        driver=driver if driver is not None else opts.driver))


def run_tp(args: Any, tp: int, armed_wait_ms: Optional[float] = None) -> dict[str, Any]:
    coord = make_coordinator(args, tp, armed_wait_ms)
    t0 = time.perf_counter()
    startup = coord.start(progress=not args.quiet)
    startup["total_s"] = time.perf_counter() - t0
    out: dict[str, Any] = {"tp": tp, "armed_wait_ms": armed_wait_ms, "startup": startup,
                           "default_step_path": coord.step_path, "decode": {}}
    try:
        mc = coord.model_config
        for path in args.paths.split(","):
            try:
                coord._switch_step_path(path)
            except ValueError as e:  # e.g. compiled graphs with TP ranks that see every GPU
                out.setdefault("skipped_paths", {})[path] = str(e)
                if not args.quiet:
                    print(f"  tp={tp} {path}: skipped: {e}", flush=True)
                continue
            for b, mode in ((int(x), m) for x in args.batches.split(",") for m in args.sampling.split(",")):
                batch = with_sampling(decode_batch(b, args.context, coord.block_size, coord.num_kv_blocks,
                                                   mc.vocab_size), mode)
                r = measure(coord, batch, args.steps, args.warmup)
                key = f"{path}:b{b}" if mode == "greedy" else f"{path}:b{b}:{mode}"
                out["decode"][key] = r
                if mode != "greedy":  # sampled rows: the strict round trip only
                    if not args.quiet:
                        print(f"  tp={tp} {path:8s} batch {b:3d} {mode}: e2e {r['e2e_ms']:.3f} ms, in-rank "
                              f"{r['in_rank_ms']:.3f} ms", flush=True)
                    continue
                if not args.quiet:
                    print(f"  tp={tp} {path:8s} batch {b:3d}: e2e {r['e2e_ms']:.3f} ms, in-rank {r['in_rank_ms']:.3f}"
                          f" ms, overhead {r['overhead_ms']:.3f} ms ({r['overhead_pct']:.1f}%)", flush=True)
                if path == "pipe":
                    r.update(measure_ahead(coord, batch, args.steps, args.warmup))
                    if not args.quiet:
                        print(f"  tp={tp} {path:8s} batch {b:3d}: submitted ahead: {r['ahead_ms']:.3f} ms per step "
                              f"(p90 {r['ahead_p90_ms']:.3f})", flush=True)
                k = args.decode_steps
                if k > 1 and path == "pipe":
                    mb = decode_batch(b, args.context, coord.block_size, coord.num_kv_blocks, mc.vocab_size, k)
                    r = measure(coord, mb, max(10, args.steps // k), 3, num_steps=k)
                    r = {f"per_token_{key}": v / k for key, v in r.items() if key.endswith("_ms")}
                    out["decode"][key].update(r, decode_steps=k)
                    if not args.quiet:
                        print(f"  tp={tp} {path:8s} batch {b:3d}: {k} decode steps per call: e2e "
                              f"{r['per_token_e2e_ms']:.3f} ms per token", flush=True)
        status = coord.status()
        out["status_overhead"] = status["overhead"]
        out["armed_decode"] = [r.get("armed_decode") for r in status["ranks"]]
    finally:
        coord.shutdown()
    return out


def table(res: dict[str, Any]) -> str:
    lines = ["tp  armed  path      batch  sampling     e2e ms  in-rank ms  overhead ms  overhead %  ahead ms  "
             "multi-step e2e ms/token"]
    for run in res["runs"]:
        armed = "default" if run.get("armed_wait_ms") is None else f"{run['armed_wait_ms']:g} ms"
        for key, r in run["decode"].items():
            path, b, mode = (key.split(":") + ["greedy"])[:3]
            b = b[1:]
            ahead = f"{r['ahead_ms']:8.3f}" if "ahead_ms" in r else " " * 8
            multi = f"{r['per_token_e2e_ms']:10.3f} (x{r['decode_steps']})" if "per_token_e2e_ms" in r else ""
            lines.append(f"{run['tp']:<3d} {armed:>6s} {path:9s} {int(b):5d}  {mode:11s} {r['e2e_ms']:8.3f} {r['in_rank_ms']:11.3f} "
                         f"{r['overhead_ms']:12.3f} {r['overhead_pct']:10.1f}  {ahead}  {multi}")
        for key, ratio in sampled_ratios(run).items():
            lines.append(f"    {key}: sampled / greedy e2e {ratio['e2e']:.3f}, in-rank {ratio['in_rank']:.3f}")
        if any(run.get("armed_decode") or []):
            lines.append(f"    armed decode per rank (tp={run['tp']}): {run['armed_decode']}")
    lines.append("")
    lines.append(f"ray.init: {res['ray_init_s']:.2f} s (once); ray_s = placement + actor start-up")
    lines.append("tp  ray_s  groups_s  weights_s  kv_s  runner_s  capture_s  total_s   (runner_s: kernel warm-up)")
    for run in res["runs"]:
        s = run["startup"]
        lines.append(f"{run['tp']:<3d} {s['ray_s']:5.2f} {s['groups_s']:9.2f} {s['weights_s']:10.2f} "
                     f"{s['kv_s']:5.2f} {s.get('runner_s', 0.0):9.2f} {s['capture_s']:10.2f} {s['total_s']:8.2f}")
        detail = {k: s[k] for k in ("placement_group_s", "actor_start_s", "build_runtime_s") if k in s}
        detail.update({f"actor.{k}": v for k, v in s.get("actor_phases_s", {}).items()})
        detail.update(s.get("group_phases_s", {}))
        if detail:
            lines.append("    " + "  ".join(f"{k} {v:.2f}" for k, v in detail.items()))
    for r in res.get("tp2_vs_tp1", []):
        armed = ["default" if r[k] is None else f"{r[k]:g} ms" for k in ("tp2_armed_wait_ms", "tp1_armed_wait_ms")]
        lines.append(f"TP=2 (armed {armed[0]}) / TP=1 (armed {armed[1]}) {r['point']}: " + "  ".join(
            f"{m} {r[m]:.3f}" for m in RATIO_MEASURES if m in r))
    return "\n".join(lines)


RATIO_MEASURES = ("in_rank", "e2e", "ahead")


def sampled_ratios(run: dict[str, Any]) -> dict[str, dict[str, float]]:
    """For every sampled point of one run ("path:bB:mode"), its time over the greedy point of the same path and
    batch, strict round trip and in-rank."""
    out: dict[str, dict[str, float]] = {}
    for key, r in run["decode"].items():
        if key.count(":") == 2 and (g := run["decode"].get(key.rsplit(":", 1)[0])) is not None:
            out[key] = {m: r[f"{m}_ms"] / g[f"{m}_ms"] for m in ("e2e", "in_rank")}
    return out


def tp_ratios(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """TP=2 time / TP=1 time for every point both measured, for every pair of a TP=2 run and a TP=1 run (one run
    per armed-decode wait and TP size): in-rank step, strict round trip (e2e) and submitted ahead, where
    measured. Below 1: TP=2 is faster."""
    out: list[dict[str, Any]] = []
    for tp2 in (r for r in runs if r["tp"] == 2):
        for tp1 in (r for r in runs if r["tp"] == 1):
            out.extend(_pair_ratios(tp1, tp2))
    return out


def _pair_ratios(tp1: dict[str, Any], tp2: dict[str, Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for point, one in tp1["decode"].items():
        two = tp2["decode"].get(point)
        if two is None:
            continue
        row: dict[str, Any] = {"tp1_armed_wait_ms": tp1.get("armed_wait_ms"),
                               "tp2_armed_wait_ms": tp2.get("armed_wait_ms"), "point": point}
        for m in RATIO_MEASURES:
            if f"{m}_ms" in one and f"{m}_ms" in two:
                row[m] = two[f"{m}_ms"] / one[f"{m}_ms"]
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--device", default="auto", help="auto (GPUs when the cluster has them) or cpu")
    p.add_argument("--tp", default="1,2", help="TP sizes to run (comma list)")
    p.add_argument("--batches", default="1,64")
    p.add_argument("--paths", default="pipe,compiled", help="step paths to measure (comma list)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per point (default 300 GPU / 30 CPU)")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--decode-steps", type=int, default=8, help="also time multi-step decode calls (pipe path)")
    p.add_argument("--context", type=int, default=128, help="cached tokens per sequence")
    p.add_argument("--sampling", default="greedy",
                   help="comma list of sampling modes per batch, side by side: " + ", ".join(SAMPLING_MODES))
    p.add_argument("--max-decode-batch", type=int, default=256)
    p.add_argument("--pcg-max-tokens", type=int, default=4096)
    p.add_argument("--kv-blocks", type=int, default=0, help="KV blocks per rank (0 = from the memory budget)")
    p.add_argument("--num-cpus", type=int, default=None, help="for a local ray.init")
    add_armed_wait_arg(p)
    p.add_argument("--out", default=None)
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    if args.steps is None:
        args.steps = 30 if args.device == "cpu" else 300
    if args.device == "cpu" and args.num_cpus is None:
        args.num_cpus = 4
    import ray

    from actors.startup import ensure_ray

    res: dict[str, Any] = {"model": args.model, "device": args.device, "args": vars(args), "runs": []}
    t0 = time.perf_counter()
    ensure_ray(None, args.num_cpus)  # once for every run; the coordinators reuse it
    res["ray_init_s"] = time.perf_counter() - t0
    try:
        for tp in (int(x) for x in args.tp.split(",")):
            if args.device != "cpu":
                import torch

                if tp > torch.cuda.device_count():
                    res.setdefault("skipped", []).append(f"tp={tp}: {torch.cuda.device_count()} GPU(s) here")
                    continue
            for w in armed_waits(args, tp):
                res["runs"].append(run_tp(args, tp, w))
    finally:
        if ray.is_initialized():
            ray.shutdown()
    res["tp2_vs_tp1"] = tp_ratios(res["runs"])
    print(table(res))
    write_json(args.out, res)
    return res


if __name__ == "__main__":
    main()
