"""TP all-reduce on 2 GPUs: NCCL vs the symmetric-memory one-shot, inside one CUDA graph.

    python -m bench.allreduce_bench --out artifacts/allreduce_bench.json

Two processes (torch.multiprocessing, spawn), one NCCL group. For tokens in {1, 8, 64, 256}
x 1024 hidden, bf16 (a decode step's row-parallel output): the symmetric-memory result is
compared with NCCL's, then 56 back-to-back all-reduces (one decode step of a 28-layer
model: 2 per layer) are captured in ONE CUDA graph per implementation and replayed; the
figure is microseconds per all-reduce (CUDA events over the replays, the slower rank).
When symmetric memory is unavailable the reason is reported and only NCCL is timed. With the
fused kernel enabled, the post-projection pair (all-reduce, then residual add + RMSNorm) is
timed against `all_reduce_add_rms_norm` the same way, for each kernel kind (push, pull).
Multicast stays off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 by default).
"""
from __future__ import annotations

import argparse
import os
import queue
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch

from bench.common import write_json

TOKENS = (1, 8, 64, 256)
HIDDEN = 1024
OPS_PER_GRAPH = 56
WORLD = 2
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def _graph_us(fn: Callable[[], Any], replays: int, warmup: int, device: torch.device) -> float:
    """Capture `OPS_PER_GRAPH` calls of `fn` in one graph; device microseconds per call (this rank)."""
    import torch.distributed as dist

    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        fn()  # eager warm-up on the capture stream
    torch.cuda.current_stream(device).wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=side, capture_error_mode="thread_local"):
        for _ in range(OPS_PER_GRAPH):
            fn()
    for _ in range(warmup):
        g.replay()
    torch.cuda.synchronize(device)
    dist.barrier(device_ids=[device.index])
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        g.replay()
    end.record()
    end.synchronize()
    us = start.elapsed_time(end) * 1e3 / (replays * OPS_PER_GRAPH)
    del g
    return us


def _slowest(value: float, device: torch.device) -> float:
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _worker(rank: int, port: int, args: argparse.Namespace, out_q: Any) -> None:
    try:
        for k, v in NO_MULTICAST.items():
            os.environ.setdefault(k, v)
        out_q.put(("ok", rank, _run_rank(rank, port, args)))
    except BaseException:  # noqa: BLE001 - report every failure to the parent
        out_q.put(("error", rank, traceback.format_exc()))


def _run_rank(rank: int, port: int, args: argparse.Namespace) -> dict[str, Any]:
    import torch.distributed as dist

    from parallel.symm_setup import try_create_for_group

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    store = dist.TCPStore("127.0.0.1", port, WORLD, is_master=False, timeout=timedelta(seconds=30))
    dist.init_process_group("nccl", store=store, rank=rank, world_size=WORLD, device_id=device,
                            timeout=timedelta(seconds=30))
    group = dist.group.WORLD
    warm = torch.ones(1, device=device)
    dist.all_reduce(warm)
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    impl, why = try_create_for_group(group, device, args.max_bytes)
    setup_s = time.perf_counter() - t0
    result: dict[str, Any] = {"torch": torch.__version__, "device": torch.cuda.get_device_name(device),
                              "symm": {"available": impl is not None, "reason": why, "setup_s": setup_s,
                                       "variants": list(impl.variants) if impl else []},
                              "hidden": HIDDEN, "dtype": "bfloat16", "ops_per_graph": OPS_PER_GRAPH,
                              "replays": args.replays, "rows": []}
    fused_kinds: dict[str, Any] = {}
    if impl is not None and impl.fused:
        from parallel.symm_fused import KINDS, FusedSymmBuffers

        fused_kinds = {k: FusedSymmBuffers(impl.group_name, device, WORLD, rank, impl.max_bytes, k) for k in KINDS}
    for tokens in TOKENS:
        torch.manual_seed(1234 + rank)
        x = torch.randn(tokens, HIDDEN, dtype=torch.bfloat16, device=device)
        row: dict[str, Any] = {"tokens": tokens, "bytes": x.numel() * x.element_size()}
        ref = x.clone()
        dist.all_reduce(ref)
        nccl_buf = torch.zeros_like(x)  # zeros: 56 in-place sums stay finite
        row["nccl_us"] = _slowest(_graph_us(lambda: dist.all_reduce(nccl_buf), args.replays, 3, device), device)
        if impl is not None and impl.can_reduce(x):
            for variant in impl.variants:
                impl.use_variant(variant)
                got = impl.all_reduce(x)
                diff = float((got.float() - ref.float()).abs().max())
                row[f"symm_{variant}_max_abs_diff"] = _slowest(diff, device)
                row[f"symm_{variant}_exact"] = _slowest(0.0 if torch.equal(got, ref) else 1.0, device) == 0.0
                row[f"symm_{variant}_us"] = _slowest(
                    _graph_us(lambda: impl.all_reduce(x), args.replays, 3, device), device)
            impl.use_variant(impl.variants[0])
            row["speedup"] = row["nccl_us"] / row[f"symm_{impl.variants[0]}_us"]
            if impl.fused:  # the post-projection pair: all-reduce then residual add + RMSNorm, against one kernel
                from modeling.ops.triton_fused import add_rms_norm

                res = torch.randn(tokens, HIDDEN, dtype=torch.bfloat16, device=device)
                w = torch.ones(HIDDEN, dtype=torch.bfloat16, device=device)
                row["symm_then_norm_us"] = _slowest(_graph_us(
                    lambda: add_rms_norm(impl.all_reduce(x), res, w, 1e-6), args.replays, 3, device), device)
                for kind, bufs in fused_kinds.items():
                    row[f"fused_{kind}_us"] = _slowest(_graph_us(
                        lambda: bufs.all_reduce_add_rms_norm(x, res, w, 1e-6), args.replays, 3, device), device)
        elif impl is not None:
            row["symm_note"] = "can_reduce() is False for this size (NCCL would be used)"
        result["rows"].append(row)
    for bufs in fused_kinds.values():
        bufs.close()
    if impl is not None:
        impl.close()
    dist.barrier(device_ids=[rank])
    dist.destroy_process_group()
    return result


def _table(res: dict[str, Any]) -> str:
    variants = res["symm"]["variants"]
    head = f"{'tokens':>6} {'bytes':>8} {'nccl us':>8}" + "".join(f" {('symm ' + v + ' us'):>15}" for v in variants)
    lines = [head + (f" {'speedup':>7} {'exact':>5}" if variants else "")]
    for r in res["rows"]:
        line = f"{r['tokens']:>6} {r['bytes']:>8} {r['nccl_us']:>8.2f}"
        for v in variants:
            line += f" {r.get(f'symm_{v}_us', float('nan')):>15.2f}"
        if variants:
            exact = all(r.get(f"symm_{v}_exact", False) for v in variants)
            line += f" {r.get('speedup', float('nan')):>7.2f} {str(exact):>5}"
        if "symm_then_norm_us" in r:
            line += f"   all-reduce + add_rms_norm {r['symm_then_norm_us']:.2f} us; fused: " + ", ".join(
                f"{k.removeprefix('fused_').removesuffix('_us')} {v:.2f} us" for k, v in r.items()
                if k.startswith("fused_") and k.endswith("_us"))
        lines.append(line)
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="JSON output file")
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--max-bytes", type=int, default=1 << 20)
    ap.add_argument("--timeout", type=float, default=55.0, help="seconds before the workers are stopped")
    args = ap.parse_args()
    t_start = time.perf_counter()
    n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n_gpu < WORLD:
        res = {"error": f"needs {WORLD} CUDA devices, found {n_gpu}"}
        print(res["error"])
        write_json(args.out, res)
        return 1

    import torch.distributed as dist
    import torch.multiprocessing as mp

    store = dist.TCPStore("127.0.0.1", 0, WORLD + 1, is_master=True, timeout=timedelta(seconds=30),
                          wait_for_workers=False)
    ctx = mp.get_context("spawn")
    out_q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, int(store.port), args, out_q), daemon=True) for r in range(WORLD)]
    for p in procs:
        p.start()
    reports: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + args.timeout
    while len(reports) < WORLD and time.monotonic() < deadline:
        try:
            status, rank, payload = out_q.get(timeout=0.5)
            reports[rank] = (status, payload)
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for p in procs) and len(reports) < WORLD:
                time.sleep(1.0)  # let the other rank's report arrive, then give up
                while not out_q.empty():
                    status, rank, payload = out_q.get_nowait()
                    reports[rank] = (status, payload)
                break
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.terminate()
            p.join(timeout=5)
    errors = {r: payload for r, (status, payload) in reports.items() if status != "ok"}
    missing = [r for r in range(WORLD) if r not in reports]
    if errors or missing or 0 not in reports:
        res = {"error": "worker failure", "errors": {str(k): v for k, v in errors.items()},
               "missing_ranks": missing, "timeout_s": args.timeout}
        for r, tb in errors.items():
            print(f"--- rank {r} failed:\n{tb}")
        if missing:
            print(f"ranks {missing} did not report within {args.timeout:.0f} s (stopped)")
        write_json(args.out, res)
        return 1
    res = reports[0][1]
    res["wall_s"] = time.perf_counter() - t_start
    symm = res["symm"]
    print(f"torch {res['torch']} on {WORLD} x {res['device']}; {OPS_PER_GRAPH} all-reduces per CUDA graph, "
          f"{res['replays']} replays; [{res['hidden']}-hidden bf16 rows]")
    if symm["available"]:
        print(f"symmetric memory: {symm['reason']} (set-up {symm['setup_s']:.2f} s)")
    else:
        print(f"symmetric memory UNAVAILABLE: {symm['reason']} -- only NCCL timed")
    print(_table(res))
    print(f"wall {res['wall_s']:.1f} s")
    write_json(args.out, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
