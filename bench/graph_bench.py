"""Graph runner benchmark on one GPU: eager vs our graphs vs torch.compile, side by side in one run.

    python -m bench.graph_bench --model qwen3-0.6b --out artifacts/graph_bench.json

Decode: step time (forward + LM head + argmax, host work included, synchronised) at each batch
with `--context` tokens of history per sequence, for eager, our full decode graphs and
`torch.compile(mode="reduce-overhead")` of the same model. Prefill: one sequence of T tokens,
eager vs piecewise plan replay. Start-up: capture seconds per bucket and in total, graph pool
and bridge bytes. Roofline: weight bytes (+ KV bytes read) over the measured copy bandwidth.
"""
from __future__ import annotations

import argparse
import logging
import time

import numpy as np
import torch

from actors.batch import StepBatch
from actors.rank import RankRuntime, RuntimeConfig
from bench.common import copy_bandwidth, machine, time_step, write_json
from graphrunner.config import GraphRunnerConfig
from graphrunner.step import ForwardStep
from modeling.attn_metadata import build_step_from_arrays
from parallel.context import ParallelContext


def _decode_batch(rt: RankRuntime, batch: int, context: int, tokens: np.ndarray | None = None) -> StepBatch:
    """The `_decode_step` inputs as the step batch a rank receives (timing the rank's own decode path); tokens:
    int64 `[batch]` ids (default all 7)."""
    bs = rt.cfg.block_size
    per = -(-(context + 1) // bs)
    tables = np.zeros((batch, per), dtype=np.int32)
    nblocks = rt.kv_cache.spec.num_blocks - 1
    for i in range(batch):
        tables[i] = 1 + (np.arange(per) + i * per) % nblocks
    ids = np.full(batch, 7, dtype=np.int64) if tokens is None else tokens.astype(np.int64)
    return StepBatch(token_ids=ids, q_seqlens=np.ones(batch, np.int32),
                     num_history=np.full(batch, context, np.int32), block_tables=tables,
                     temperature=np.zeros(batch, np.float32), top_k=np.zeros(batch, np.int32),
                     top_p=np.ones(batch, np.float32), seeds=np.full(batch, -1, np.int64))


def _decode_step(rt: RankRuntime, batch: int, context: int, tokens: np.ndarray | None = None) -> ForwardStep:
    """One decode token per sequence after `context` tokens of history; tokens: int64 `[batch]` (default all 7)."""
    bs, width = rt.cfg.block_size, rt.cfg.max_blocks_per_seq
    per = -(-(context + 1) // bs)
    tables = np.zeros((batch, width), dtype=np.int32)
    nblocks = rt.kv_cache.spec.num_blocks - 1
    for i in range(batch):  # sequences share physical blocks when the cache is small: timing only
        tables[i, :per] = 1 + (np.arange(per) + i * per) % nblocks
    ids = np.full(batch, 7, dtype=np.int64) if tokens is None else tokens.astype(np.int64)
    ids, pos, meta = build_step_from_arrays(ids, np.ones(batch, dtype=np.int32),
                                            np.full(batch, context, dtype=np.int32), tables, bs, rt.device)
    return ForwardStep(ids, pos, rt.kv_cache.layers, meta)


def _prefill_step(rt: RankRuntime, tokens: int, seqs: int = 1, ids: np.ndarray | None = None) -> ForwardStep:
    """`seqs` fresh sequences of `tokens` new tokens each, on distinct KV blocks from block 1 on; ids: int64
    `[seqs * tokens]` (default: random ids below 1000, seeded by `tokens`)."""
    bs, width = rt.cfg.block_size, rt.cfg.max_blocks_per_seq
    per = -(-tokens // bs)
    tables = np.zeros((seqs, width), dtype=np.int32)
    for i in range(seqs):
        tables[i, :per] = 1 + i * per + np.arange(per)
    if ids is None:
        ids = np.random.default_rng(tokens).integers(1, min(1000, rt.model_config.vocab_size), seqs * tokens)
    ids, pos, meta = build_step_from_arrays(ids.astype(np.int64), np.full(seqs, tokens, dtype=np.int32),
                                            np.zeros(seqs, dtype=np.int32), tables, bs, rt.device)
    return ForwardStep(ids, pos, rt.kv_cache.layers, meta)


def _compiled_decode(rt: RankRuntime):
    """torch.compile's own CUDA graphs over the same model. The KV arenas are marked static so the
    store kernel's in-place cache writes do not make cudagraph trees skip the graph."""
    model = rt.model
    for k, v in rt.kv_cache.layers:
        torch._dynamo.mark_static_address(k)
        torch._dynamo.mark_static_address(v)
    torch._logging.set_logs(graph_breaks=True, recompiles=True, perf_hints=True)

    def fwd(ids, pos, kv, meta):
        return model.compute_logits(model(ids, pos, kv, meta), meta.last_token_index).argmax(-1)

    return torch.compile(fwd, mode="reduce-overhead", dynamic=False, fullgraph=False)


class _LogCollector(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage()[:300])


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--batches", default="1,8,32,64,128,256")
    ap.add_argument("--prefill", default="128,512,1024,2048,4096")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--blocks", type=int, default=4096)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda", 0)
    batches = [int(x) for x in args.batches.split(",")]
    prefills = [int(x) for x in args.prefill.split(",")]
    graph = GraphRunnerConfig(max_decode_batch=max(batches), pcg_max_tokens=max(prefills), pcg_token_stride=512)
    cfg = RuntimeConfig(model=args.model, device="cuda", num_kv_blocks=args.blocks, max_model_len=8192, graph=graph)
    rt = RankRuntime(cfg, ParallelContext(), dev)
    rt.load_model()
    rt.allocate_kv_cache()
    rt.build_runner()
    bw = copy_bandwidth(dev)
    weight_bytes = rt.weight_bytes()
    torch.cuda.synchronize()
    mem0 = torch.cuda.memory_allocated()
    capture: dict[str, float] = {}
    t0 = time.perf_counter()
    decode_sizes, prefill_sizes = rt.capture_sizes()
    for b in decode_sizes:
        capture[f"decode:{b}"] = rt.capture_decode(b)
    t_dec = time.perf_counter() - t0
    mem_dec = torch.cuda.memory_allocated() - mem0
    for t in prefill_sizes:
        capture[f"prefill:{t}"] = rt.capture_prefill(t)
    total_capture = time.perf_counter() - t0
    mem_all = torch.cuda.memory_allocated() - mem0
    snap = rt.runner.stats.snapshot()
    head_bytes = rt.stats()["head_graphs"]["pool_bytes"]
    kv_tok_bytes = 2 * rt.model_config.num_layers * rt.model_config.num_kv_heads * rt.model_config.head_dim * 2
    print(f"# {machine()} | model {args.model} | weights {weight_bytes / 2**30:.3f} GiB | copy bw {bw / 1e12:.2f} TB/s")
    print(f"capture: {len(decode_sizes)} decode buckets in {t_dec:.2f} s, {len(prefill_sizes)} prefill buckets, "
          f"total {total_capture:.2f} s; decode pool {mem_dec / 2**20:.1f} MiB (LM-head graphs of buckets <= "
          f"{cfg.head_graph_max_batch}: {head_bytes / 2**20:.1f} MiB of it), all graphs {mem_all / 2**20:.1f} MiB")

    compiled = None if args.no_compile else _compiled_decode(rt)
    collector = _LogCollector()
    logging.getLogger("torch").addHandler(collector)
    decode_rows = []
    print(f"{'batch':>5} {'eager ms':>9} {'graph ms':>9} {'rank exec ms':>12} {'compile ms':>10} {'graph gpu ms':>12} "
          f"{'roofline ms':>11} {'x roofline':>10} {'eager/graph':>11} {'compile/graph':>13}")
    for b in batches:
        step = _decode_step(rt, b, args.context)
        li = step.attn_metadata.last_token_index

        def graph_fn():
            return rt.model.compute_logits(rt.runner(step), li).argmax(-1)

        def eager_fn():
            return rt.model.compute_logits(rt.model(step.input_ids, step.position_ids, step.kv_caches, step.attn_metadata),
                                           li).argmax(-1)

        g = time_step(graph_fn, dev)
        sb = _decode_batch(rt, b, args.context)
        x = time_step(lambda: rt.execute(sb), dev)
        e = time_step(eager_fn, dev, iters=10)
        c = None
        if compiled is not None:
            try:
                c = time_step(lambda: compiled(step.input_ids, step.position_ids, step.kv_caches, step.attn_metadata), dev,
                              warmup=5)
            except Exception as exc:  # recorded, not hidden: the row says compile failed and why
                c = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        roof = (weight_bytes + b * (args.context + 1) * kv_tok_bytes) / bw
        row = {"batch": b, "eager": e, "graph": g, "rank_execute": x, "compile": c, "roofline_s": roof,
               "x_roofline": g["wall_s"] / roof, "eager_over_graph": e["wall_s"] / g["wall_s"],
               "compile_over_graph": (c["wall_s"] / g["wall_s"]) if c and "wall_s" in c else None}
        decode_rows.append(row)
        cms = f"{c['wall_s'] * 1e3:10.3f}" if c and "wall_s" in c else f"{'failed':>10}"
        cog = f"{row['compile_over_graph']:13.2f}" if row["compile_over_graph"] else f"{'-':>13}"
        print(f"{b:5d} {e['wall_s'] * 1e3:9.3f} {g['wall_s'] * 1e3:9.3f} {x['wall_s'] * 1e3:12.3f} {cms} "
              f"{g['gpu_s'] * 1e3:12.3f} "
              f"{roof * 1e3:11.3f} {row['x_roofline']:10.2f} {row['eager_over_graph']:11.1f} {cog}")
    prefill_rows = []
    print(f"{'tokens':>6} {'eager ms':>9} {'pcg ms':>9} {'eager/pcg':>9}")
    for t in prefills:
        step = _prefill_step(rt, t)
        p = time_step(lambda: rt.runner(step), dev)
        e = time_step(lambda: rt.model(step.input_ids, step.position_ids, step.kv_caches, step.attn_metadata), dev,
                      iters=10)
        prefill_rows.append({"tokens": t, "eager": e, "pcg": p, "eager_over_pcg": e["wall_s"] / p["wall_s"]})
        print(f"{t:6d} {e['wall_s'] * 1e3:9.3f} {p['wall_s'] * 1e3:9.3f} {e['wall_s'] / p['wall_s']:9.2f}")
    paths = rt.runner.stats.snapshot()["steps"]
    print("paths:", paths)
    write_json(args.out, {
        "machine": machine(), "model": args.model, "context": args.context, "copy_bandwidth_Bps": bw,
        "weight_bytes": weight_bytes, "capture_s": capture, "capture_total_s": total_capture,
        "decode_capture_s": t_dec, "decode_graph_bytes": mem_dec, "all_graph_bytes": mem_all,
        "head_graph_bytes": head_bytes,
        "runner_stats": snap, "decode": decode_rows, "prefill": prefill_rows, "paths": paths,
        "compile_warnings": collector.lines[:20],
    })


if __name__ == "__main__":
    main()
