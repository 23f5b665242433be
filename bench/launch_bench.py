"""What a CUDA graph launch costs on the host, and whether launching a decode step in segments hides it.

    python -m bench.launch_bench --out artifacts/launch_bench.json

1. Synthetic chains of N kernels (torch elementwise, a trivial Triton kernel, a cuBLAS M=1 GEMM)
   captured into one graph: host microseconds inside `replay()` (the launch call), and the
   graph's node and edge types read back through the driver API.
2. The real decode forward of `--model` at batch 1, captured as one graph and as several
   graphs split at decoder-layer boundaries (sharing one pool, replayed in order): the
   host launch time of each and the wall time of launch + synchronise.
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import time
from collections import Counter
from typing import Any, Callable

import torch

_NODE_TYPES = {0: "kernel", 1: "memcpy", 2: "memset", 3: "host", 4: "graph", 5: "empty", 6: "wait_event",
               7: "event_record", 10: "mem_alloc", 11: "mem_free", 12: "batch_mem_op", 13: "conditional"}


class _EdgeData(ctypes.Structure):
    _fields_ = [("from_port", ctypes.c_ubyte), ("to_port", ctypes.c_ubyte), ("type", ctypes.c_ubyte),
                ("reserved", ctypes.c_ubyte * 5)]


def graph_structure(raw: int) -> dict[str, Any]:
    """Node types, edge count and edge types (0 default, 1 programmatic) of a `cudaGraph_t` via libcuda."""
    cuda = ctypes.CDLL("libcuda.so.1")
    g = ctypes.c_void_p(raw)
    n = ctypes.c_size_t(0)
    cuda.cuGraphGetNodes(g, None, ctypes.byref(n))
    nodes = (ctypes.c_void_p * n.value)()
    cuda.cuGraphGetNodes(g, nodes, ctypes.byref(n))
    types: Counter = Counter()
    for node in nodes:
        t = ctypes.c_int(-1)
        cuda.cuGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(t))
        types[_NODE_TYPES.get(t.value, str(t.value))] += 1
    out: dict[str, Any] = {"nodes": n.value, "node_types": dict(types)}
    try:
        fn = cuda.cuGraphGetEdges_v2
        e = ctypes.c_size_t(0)
        fn(g, None, None, None, ctypes.byref(e))
        src, dst = (ctypes.c_void_p * e.value)(), (ctypes.c_void_p * e.value)()
        data = (_EdgeData * e.value)()
        fn(g, src, dst, data, ctypes.byref(e))
        out["edges"] = e.value
        out["edge_types"] = dict(Counter(int(d.type) for d in data))
        fan = Counter(s for s in src)
        out["max_out_degree"] = max(fan.values()) if fan else 0
    except AttributeError:
        pass
    return out


def time_replays(graphs: list, iters: int = 200) -> dict[str, float]:
    """Median host microseconds inside the replay calls, and wall microseconds of replay + synchronize."""
    for _ in range(10):
        for g in graphs:
            g.replay()
    torch.cuda.synchronize()
    launch, wall = [], []
    for _ in range(iters):
        t0 = time.perf_counter()
        for g in graphs:
            g.replay()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        launch.append(t1 - t0)
        wall.append(t2 - t0)
    return {"launch_us": 1e6 * statistics.median(launch), "wall_us": 1e6 * statistics.median(wall)}


def _capture(fn: Callable[[], Any], pool=None) -> torch.cuda.CUDAGraph:
    g = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(g, pool=pool):
        fn()
    g.instantiate()
    return g


def synthetic_chains(lengths: list[int]) -> list[dict[str, Any]]:
    import triton
    import triton.language as tl

    @triton.jit
    def _bump(X, N: tl.constexpr):
        offs = tl.arange(0, N)
        tl.store(X + offs, tl.load(X + offs) + 1.0)

    x = torch.zeros(1024, device="cuda")
    a = torch.randn(1, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
    kinds: dict[str, Callable[[], Any]] = {
        "torch_add": lambda: x.add_(1.0),
        "triton": lambda: _bump[(1,)](x, N=1024),
        "cublas_m1": lambda: torch.nn.functional.linear(a, w),
    }
    rows = []
    for kind, op in kinds.items():
        op()
        for n in lengths:
            g = _capture(lambda: [op() for _ in range(n)])
            row = {"kind": kind, "kernels": n, **time_replays([g]), **graph_structure(g.raw_cuda_graph())}
            rows.append(row)
            print(f"  {kind:10s} N={n:4d}: launch {row['launch_us']:7.1f} us, wall {row['wall_us']:7.1f} us, "
                  f"nodes {row['nodes']} {row['node_types']} edges {row.get('edges')} {row.get('edge_types')}", flush=True)
    return rows


def model_segments(model_name: str, splits: list[str]) -> list[dict[str, Any]]:
    """The decode forward at batch 1 captured whole and split at layer boundaries."""
    from actors.rank import RankRuntime, RuntimeConfig
    from bench.graph_bench import _decode_step
    from graphrunner.config import GraphRunnerConfig
    from graphrunner.forward_args import model_kwargs
    from graphrunner.staging import staging_for
    from parallel.context import ParallelContext

    graph = GraphRunnerConfig(max_decode_batch=8, pcg_max_tokens=512, pcg_token_stride=512)
    cfg = RuntimeConfig(model=model_name, device="cuda", num_kv_blocks=256, max_model_len=4096, graph=graph)
    rt = RankRuntime(cfg, ParallelContext(), torch.device("cuda", 0))
    rt.load_model()
    rt.allocate_kv_cache()
    rt.build_runner()
    model = rt.model
    step = _decode_step(rt, 1, 512)
    buffers = model.make_buffers(rt.runner.graph_meta, staging_for(model, rt.runner.graph_meta))
    model.fill_buffers(buffers, step, 1)
    kwargs = model_kwargs(model.update_context(buffers, step, 1))
    rows = []
    with torch.inference_mode():
        model(**kwargs)
        torch.cuda.synchronize()
        num_layers = len(model.layers)
        for spec in splits:
            cuts = sorted({int(c) for c in spec.split(",") if c}) if spec else []
            pool = torch.cuda.graph_pool_handle()
            graphs: list = []
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            hooks = []

            def _cut(_mod, _args):
                graphs[-1].capture_end()
                g = torch.cuda.CUDAGraph(keep_graph=True)
                graphs.append(g)
                g.capture_begin(pool=pool)

            for c in cuts:
                if 0 < c < num_layers:
                    hooks.append(model.layers[c].register_forward_pre_hook(_cut))
            with torch.cuda.stream(stream):
                g0 = torch.cuda.CUDAGraph(keep_graph=True)
                graphs.append(g0)
                g0.capture_begin(pool=pool)
                model(**kwargs)
                graphs[-1].capture_end()
            torch.cuda.current_stream().wait_stream(stream)
            for h in hooks:
                h.remove()
            for g in graphs:
                g.instantiate()
            structure = [graph_structure(g.raw_cuda_graph())["nodes"] for g in graphs]
            row = {"split_before_layers": cuts, "segment_nodes": structure, **time_replays(graphs)}
            rows.append(row)
            print(f"  segments before layers {cuts or '-'}: nodes {structure}, launch {row['launch_us']:.1f} us, "
                  f"wall {row['wall_us']:.1f} us", flush=True)
    return rows


def runtime_graphs(model_name: str, configs: list[tuple[int, int]]) -> list[dict[str, Any]]:
    """Host time of the batch-1 decode graph's and LM-head graph's replay calls inside a `RankRuntime` that
    captured every bucket of (max_decode_batch, pcg_max_tokens), on the rank stream."""
    from actors.rank import RankRuntime, RuntimeConfig
    from bench.graph_bench import _decode_batch
    from graphrunner.config import GraphRunnerConfig
    from parallel.context import ParallelContext

    rows = []
    for max_batch, pcg_tokens in configs:
        graph = GraphRunnerConfig(max_decode_batch=max_batch, pcg_max_tokens=pcg_tokens)
        cfg = RuntimeConfig(model=model_name, device="cuda", num_kv_blocks=1024, max_model_len=8192, graph=graph)
        rt = RankRuntime(cfg, ParallelContext(), torch.device("cuda", 0))
        rt.load_model()
        rt.allocate_kv_cache()
        rt.build_runner()
        rt.capture_all()
        sb = _decode_batch(rt, 1, 512)
        for _ in range(20):
            rt.execute(sb)
        torch.cuda.synchronize()
        wall = []
        for _ in range(200):
            t0 = time.perf_counter()
            rt.execute(sb)
            wall.append(time.perf_counter() - t0)
        full = rt.runner.full_graphs
        body = [g for k, g in full._graphs.items() if k.batch == 1][0].graph
        head = rt._heads[1].greedy_graph if 1 in rt._heads else None
        with torch.cuda.stream(rt.stream):
            t_body = time_replays([body])
            t_head = time_replays([head]) if head is not None else {}
        row = {"max_decode_batch": max_batch, "pcg_max_tokens": pcg_tokens, "decode_graphs": full.num_graphs,
               "prefill_plans": rt.runner.stats.snapshot().get("captured_prefill"),
               "execute_us": 1e6 * statistics.median(wall), "body": t_body, "head": t_head,
               }
        rows.append(row)
        print(f"  max_decode_batch {max_batch} pcg {pcg_tokens}: {row['decode_graphs']} decode graphs, "
              f"{row['prefill_plans']} prefill plans; execute {row['execute_us']:.1f} us; body replay {t_body}; "
              f"head replay {t_head}", flush=True)
        del rt, full, body, head
        torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--lengths", default="32,128,288")
    p.add_argument("--splits", default=";1;2;1,4,12;1,3,7,14,21;2,6,12,20")
    p.add_argument("--sections", default="chains,segments,runtime")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    from bench.common import write_json

    res: dict[str, Any] = {}
    sections = args.sections.split(",")
    if "chains" in sections:
        print("## synthetic chains: host launch time per graph")
        res["chains"] = synthetic_chains([int(n) for n in args.lengths.split(",")])
    if "segments" in sections:
        print(f"## {args.model} decode forward, batch 1: one graph vs segments split at layer boundaries")
        res["segments"] = model_segments(args.model, args.splits.split(";"))
    if "runtime" in sections:
        print("## graphs inside a RankRuntime (rank stream): host time of the batch-1 replays")
        res["runtime"] = runtime_graphs(args.model, [(1, 512), (8, 512), (256, 4096)])
    write_json(args.out, res)
    return res


if __name__ == "__main__":
    main()
