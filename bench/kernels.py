"""Decode attention micro-benchmark: Triton split-KV kernel vs a torch baseline vs the HBM roofline.

Run: `python -m bench.kernels [--out docs/bench_kernels.json] [--sweep]` on one CUDA GPU.

Shapes: Qwen3-0.6B attention (Hq=16, Hkv=8, D=128), bf16 caches `[N, 64, 8, 128]`,
every sequence at the full context; batch 1/32/256 x context 1k/8k by default.
Block ids are a random permutation (non-contiguous pages).

Columns:
- triton us: `modeling.ops.triton_decode.decode_attention`, eager, timed with
  `triton.testing.do_bench` (L2 flushed before every call; median).
- graph us: the same call replayed from a CUDA graph holding R back-to-back
  calls whose block tables point at disjoint cache regions (R chosen so the
  bytes they read exceed twice the L2), i.e. without launch overhead or L2 reuse.
- torch us: a *vectorised torch baseline*, not the per-sequence reference loop
  (far too slow at 256 x 8k): one index_select gathers every block of the
  batch, one batched matmul gives the scores (masked past kv_len), fp32
  softmax, one batched matmul with V.
- KV bytes: bytes of K and V the kernel must read (sum kv_len * Hkv * D * 2 * 2).
- roofline us: KV bytes / measured copy bandwidth, where the copy bandwidth is
  (bytes read + bytes written) / time of a large device-to-device copy.
- frac: roofline us / measured us (1.0 = at the copy-bandwidth roofline).
With --sweep, a grid of decode configs (splits 1..128, BLOCK_N 32/64/128,
stages 2..4) is also timed per case as the graph column is, to tune `decode_config`.
With --variants, the default config is timed the same way at 4 and 8 warps, 1-3 pipeline stages and `prefetch` off
and on (p0 / p1: the first KV tile loaded after or before the PDL wait; launched without PDL here, so this shows what
the early loads cost in registers, not the overlap they buy in a model: `bench.decode_ab` measures that).
"""
from __future__ import annotations

import argparse
import json
import math
import os
from dataclasses import asdict, dataclass, replace

import torch
import triton
import triton.testing
from triton.runtime.errors import OutOfResources

from modeling.ops.triton_decode import DecodeConfig, decode_attention, decode_config, device_sm_count

HQ, HKV, HEAD_DIM, BLOCK = 16, 8, 128, 64
DTYPE = torch.bfloat16


@dataclass
class Row:
    batch: int
    context: int
    triton_us: float
    graph_us: float
    torch_us: float
    speedup: float
    kv_bytes: int
    roofline_us: float
    frac: float
    graph_frac: float
    num_splits: int
    max_abs_diff: float
    best_config: dict | None = None
    best_config_us: float | None = None


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Device copy bandwidth in bytes/s: (read + write) / time of a large D2D copy."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=10, rep=200, return_mode="median")
    src = dst = None  # free them before empty_cache (the lambda above ran already)
    torch.cuda.empty_cache()
    return 2 * nbytes / (ms * 1e-3)


def torch_decode(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor, kv_lens: torch.Tensor, scale: float
) -> torch.Tensor:
    """Vectorised baseline: gather all blocks, batched matmuls, masked fp32 softmax. `[B, Hq, D]`."""
    b, hq, d = q.shape
    nblk, bs, hkv = tables.shape[1], k_cache.shape[1], k_cache.shape[2]
    flat = tables.reshape(-1).long()
    k = k_cache.index_select(0, flat).view(b, nblk * bs, hkv, d).transpose(1, 2)  # [B, Hkv, L, D]
    v = v_cache.index_select(0, flat).view(b, nblk * bs, hkv, d).transpose(1, 2)
    qg = q.view(b, hkv, hq // hkv, d)
    scores = torch.matmul(qg, k.transpose(2, 3)).float() * scale  # [B, Hkv, G, L]
    pos = torch.arange(nblk * bs, device=q.device)
    scores.masked_fill_(pos[None, None, None, :] >= kv_lens[:, None, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    return torch.matmul(probs, v).view(b, hq, d)


def _l2_bytes() -> int:
    return int(getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 64 << 20))


def graph_time_us(fns: list, replays: int = 20) -> float:
    """Mean time of one call when `fns` (R calls) are replayed back to back from one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in fns:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * len(fns))


def run_case(batch: int, context: int, bandwidth: float, sweep: bool, variants: bool = False) -> Row:
    nblk = -(-context // BLOCK)
    kv_bytes = batch * context * HKV * HEAD_DIM * 2 * DTYPE.itemsize
    copies = max(1, min(64, math.ceil(2 * _l2_bytes() / kv_bytes)))
    num_blocks = copies * batch * nblk + 1
    gen = torch.Generator(device="cuda").manual_seed(batch * 100003 + context)
    k_cache = torch.randn(num_blocks, BLOCK, HKV, HEAD_DIM, device="cuda", dtype=DTYPE, generator=gen)
    v_cache = torch.randn(num_blocks, BLOCK, HKV, HEAD_DIM, device="cuda", dtype=DTYPE, generator=gen)
    ids = torch.randperm(num_blocks - 1, device="cuda", generator=gen).to(torch.int32) + 1
    tables = list(ids.view(copies, batch, nblk))
    kv_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, HQ, HEAD_DIM, device="cuda", dtype=DTYPE, generator=gen)
    scale = HEAD_DIM**-0.5
    cfg = decode_config(batch, HKV, nblk, BLOCK, HEAD_DIM, DTYPE, device_sm_count(q.device))

    def tri(table: torch.Tensor = tables[0], config: DecodeConfig = cfg) -> torch.Tensor:
        return decode_attention(q, k_cache, v_cache, table, kv_lens, scale, config=config)

    def base() -> torch.Tensor:
        return torch_decode(q, k_cache, v_cache, tables[0], kv_lens, scale)

    diff = (tri().float() - base().float()).abs().max().item()
    triton_us = triton.testing.do_bench(tri, warmup=25, rep=200, return_mode="median") * 1e3
    graph_us = graph_time_us([lambda t=t: tri(t) for t in tables])
    torch_us = triton.testing.do_bench(base, warmup=5, rep=200, return_mode="median") * 1e3
    roofline_us = kv_bytes / bandwidth * 1e6
    row = Row(
        batch=batch,
        context=context,
        triton_us=triton_us,
        graph_us=graph_us,
        torch_us=torch_us,
        speedup=torch_us / triton_us,
        kv_bytes=kv_bytes,
        roofline_us=roofline_us,
        frac=roofline_us / triton_us,
        graph_frac=roofline_us / graph_us,
        num_splits=cfg.num_splits,
        max_abs_diff=diff,
    )
    if variants:
        cells = []
        for warps, stages in ((4, 1), (4, 2), (4, 3), (8, 1), (8, 2), (8, 3)):
            for early in (False, True):
                c = replace(cfg, num_warps=warps, num_stages=stages, prefetch=early)
                us = graph_time_us([lambda t=t, c=c: decode_attention(q, k_cache, v_cache, t, kv_lens, scale, config=c)
                                    for t in tables])
                cells.append(f"w{warps} s{stages} p{int(early)} {us:.1f}")
        print(f"  variants b={batch} ctx={context} (splits {cfg.num_splits}): " + ", ".join(cells))
    if sweep:
        timings = {}
        for splits in (2**i for i in range(8)):
            for block_n in (32, 64, 128):
                for stages in (2, 3, 4):
                    c = replace(cfg, num_splits=splits, block_n=block_n, num_stages=stages)
                    try:
                        timings[c] = graph_time_us([lambda t=t, c=c: tri(t, c) for t in tables])
                    except OutOfResources:  # tile x stages exceeds shared memory
                        continue
        ranked = sorted(timings, key=timings.__getitem__)
        row.best_config = asdict(ranked[0])
        row.best_config_us = timings[ranked[0]]
        best = ", ".join(f"splits={c.num_splits} n={c.block_n} st={c.num_stages}: {timings[c]:.1f}us" for c in ranked[:3])
        print(f"  sweep b={batch} ctx={context}: default {graph_us:.1f}us in a graph; best {best}")
    k_cache = v_cache = None  # free them before empty_cache (the closures above ran already)
    torch.cuda.empty_cache()
    return row


def print_table(rows: list[Row]) -> None:
    head = (
        f"{'batch':>5} {'ctx':>5} {'triton us':>10} {'graph us':>9} {'torch us':>10} {'speedup':>8} "
        f"{'KV MB':>9} {'roof us':>8} {'frac':>5} {'g.frac':>6} {'splits':>6} {'maxdiff':>8}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r.batch:>5} {r.context:>5} {r.triton_us:>10.1f} {r.graph_us:>9.1f} {r.torch_us:>10.1f} "
            f"{r.speedup:>8.1f} {r.kv_bytes / 1e6:>9.1f} {r.roofline_us:>8.1f} {r.frac:>5.2f} {r.graph_frac:>6.2f} "
            f"{r.num_splits:>6} {r.max_abs_diff:>8.1e}"
            + (f"  best {r.best_config_us:.1f} us" if r.best_config_us else "")
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write the table as JSON here (e.g. docs/bench_kernels.json)")
    parser.add_argument("--batches", default="1,32,256")
    parser.add_argument("--contexts", default="1024,8192")
    parser.add_argument("--sweep", action="store_true", help="also time a grid of decode configs per case")
    parser.add_argument("--variants", action="store_true", help="also time the default config at 4 and 8 warps, 1-3 "
                        "stages, the early loads off and on")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench.kernels needs a CUDA GPU")
    torch.backends.cuda.matmul.allow_tf32 = False
    bandwidth = copy_bandwidth()
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}: {props.multi_processor_count} SMs, copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    rows = [
        run_case(b, c, bandwidth, args.sweep, args.variants)
        for b in (int(x) for x in args.batches.split(","))
        for c in (int(x) for x in args.contexts.split(","))
    ]
    print_table(rows)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        report = {
            "device": props.name,
            "sm_count": props.multi_processor_count,
            "copy_bandwidth_Bps": bandwidth,
            "torch_version": torch.__version__,
            "triton_version": triton.__version__,
            "shape": {"hq": HQ, "hkv": HKV, "head_dim": HEAD_DIM, "block_size": BLOCK, "dtype": str(DTYPE)},
            "torch_baseline": "vectorised: index_select gather + batched matmul + masked fp32 softmax",
            "rows": [asdict(r) for r in rows],
        }
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
