"""Model-shape sweep on one GPU: decode graphs against the bytes they must read, prefill against the compute floor.

    python -m bench.model_sweep --layers 8 --batches 1,4,16,64,256 --out artifacts/model_sweep.json

For each shape (random-weight presets of Qwen3-0.6B, 1.7B, 8B, 14B and Qwen3-30B-A3B; `--layers N` keeps the first
N layers of each so every shape fits the time budget):
- decode: the rank's captured decode graph (forward, then the greedy head) at each batch with `--context` tokens
  of history and random token ids; its device time against the roofline of the bytes actually needed: the
  weights the step reads (all dense weights and the LM head; the embedding rows only; for MoE only the distinct
  experts the batch's tokens route to, measured by hooks on the routers during one eager forward of the same
  step) plus the KV read, over the measured copy bandwidth. Also the wall time of `RankRuntime.execute`.
- long context: the same at `--long-contexts` for `--long-batches` (the KV cache is sized to the need, capped by
  free memory; past the cap sequences share physical blocks, which flatters the KV read).
- prefill: one sequence of T tokens through the piecewise plan against the compute floor: 2 * active parameters
  (embedding and LM head excluded, top-k of E experts) * T plus the causal attention FLOPs, at a measured bf16
  matmul rate; and against the bytes floor: the weights the prefill reads (for MoE the experts its tokens route
  to, hooked as for decode) plus the KV it writes, over the copy bandwidth.
- engine (`--engine-batches`, "" to skip): decode steps through `LLMEngine` over the in-process local executor with
  the serving defaults (`engine_runs`): B greedy requests of `--context` random prompt tokens admitted at once,
  `--engine-steps` tokens each; the median time of the steps in which every row decoded, from the second quarter
  on, against the same batch's in-rank graph step and roofline where the decode rows have that batch.
- first token (`--engine-ttft`, "" to skip): the engine's time to first token of one request of T random prompt
  tokens at a time (the median of 5 after a warm-up), against both floors where `--prefill` has T.
Diagnosis: `--kernels B1,B2` prints the profiler's kernel table of those decode batches, `--pdl` sets the in-rank
runs' PDL mode, `--gemm-table` installs a `bench.gemm_tune` JSON's entries before anything is captured.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import statistics

import numpy as np
import torch

from actors.environment import options_from_environ
from actors.rank import RankRuntime, RuntimeConfig
from bench.common import copy_bandwidth, machine, time_step, write_json
from bench.graph_bench import _decode_batch, _decode_step, _prefill_step
from bench.profile_step import kernel_table
from graphrunner.config import GraphRunnerConfig
from modeling.config import PRESETS, ModelConfig
from modeling.moe import SparseMoeBlock, route
from modeling.ops.options import PDL_CHOICES
from parallel.context import ParallelContext

SHAPES = ("qwen3-0.6b", "qwen3-1.7b", "qwen3-8b", "qwen3-14b", "qwen3-30b-a3b")
BATCHES = "1,2,3,4,6,8,12,16,24,32,48,64,128,256"


def matmul_rate(dev: torch.device, n: int = 8192, iters: int = 20) -> float:
    """Measured bf16 dense matmul FLOP/s (n x n x n)."""
    a = torch.randn(n, n, device=dev).bfloat16()
    b = torch.randn(n, n, device=dev).bfloat16()
    t = time_step(lambda: a @ b, dev, warmup=3, iters=iters)["gpu_s"]
    return 2 * n ** 3 / t


def preset_with_layers(name: str, layers: int | None) -> str:
    """The preset to run: `name`, or a copy with its first `layers` layers registered under a derived name."""
    if layers is None or layers >= PRESETS[name].num_layers:
        return name
    derived = f"{name}@{layers}L"
    PRESETS[derived] = dataclasses.replace(PRESETS[name], num_layers=layers)
    return derived


def _moe_blocks(rt: RankRuntime) -> list[SparseMoeBlock]:
    return [layer.mlp for layer in rt.model.layers if isinstance(layer.mlp, SparseMoeBlock)]


def _experts_used(rt: RankRuntime, step) -> list[int]:
    """Distinct experts each MoE layer's router sends this step's tokens to (one eager forward, hooked)."""
    used: list[int] = []
    blocks = _moe_blocks(rt)
    originals = [block._experts for block in blocks]
    for block, experts in zip(blocks, originals):  # every router's logits reach `_experts` (forward, forward_routed)
        def counted(hidden, logits, block=block, experts=experts):
            _, ids = route(logits, block.top_k, block.renormalize)
            used.append(int(torch.unique(ids).numel()))
            return experts(hidden, logits)
        block._experts = counted
    try:
        rt.model(step.input_ids, step.position_ids, step.kv_caches, step.attn_metadata)
    finally:
        for block, experts in zip(blocks, originals):
            block._experts = experts
    return used


@dataclasses.dataclass
class _Bytes:
    """What one decode step must read: `fixed` (every weight but the experts and an untied embedding) plus per
    used expert `per_expert`, plus `kv_per_token` per token of history."""

    fixed: int
    per_expert: int
    kv_per_token: int
    row_bytes: int  # one embedding row

    def needed(self, experts_used: list[int], batch: int, context: int) -> int:
        return (self.fixed + self.per_expert * sum(experts_used) + batch * self.row_bytes
                + batch * (context + 1) * self.kv_per_token)


def _bytes(rt: RankRuntime, cfg: ModelConfig) -> _Bytes:
    total = rt.weight_bytes()
    m = rt.model
    emb = m.embed_tokens.weight
    untied = 0 if cfg.tie_word_embeddings else emb.numel() * emb.element_size()
    experts, per_expert = 0, 0
    for block in _moe_blocks(rt):
        b = (block.w13.numel() + block.w2.numel()) * block.w13.element_size()
        experts += b
        per_expert = b // block.e_local
    kv = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * torch.empty((), dtype=cfg.dtype).element_size()
    return _Bytes(total - untied - experts, per_expert, kv, cfg.hidden_size * emb.element_size())


def _prefill_flops(cfg: ModelConfig, rt: RankRuntime, tokens: int) -> float:
    """2 * active parameters * T (embedding, LM head excluded; top-k of the experts) + causal attention."""
    m = rt.model
    params = sum(p.numel() for p in m.parameters())  # tied weights are counted once
    params -= m.embed_tokens.weight.numel()
    if not cfg.tie_word_embeddings:
        params -= m.lm_head.weight.numel()
    for block in _moe_blocks(rt):
        expert = block.w13.numel() + block.w2.numel()
        params -= expert - expert * block.top_k // block.e_local
    attn = 2 * 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * tokens * (tokens + 1) / 2
    return 2 * params * tokens + attn


def _kv_blocks(cfg: ModelConfig, need: int, block_size: int, reserve: int) -> int:
    """Blocks for `need` (all sequences distinct), capped to 80% of the free device memory less `reserve`."""
    per_block = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2 * block_size
    free, _ = torch.cuda.mem_get_info()
    return max(64, min(need + 1, int((free - reserve) * 0.8) // per_block))


def _decode_row(rt, nbytes: _Bytes, bw: float, batch: int, context: int, rng, iters: int, rank_exec: bool,
                kernels: bool = False) -> dict:
    tokens = rng.integers(1, rt.model_config.vocab_size, batch)
    step = _decode_step(rt, batch, context, tokens)
    used = _experts_used(rt, step) if _moe_blocks(rt) else []
    li = step.attn_metadata.last_token_index

    def graph_step():
        return rt.model.greedy_tokens(rt.runner(step), li)

    g = time_step(graph_step, rt.device, iters=iters)
    need = nbytes.needed(used, batch, context)
    row = {"batch": batch, "context": context, "graph": g, "bytes_needed": need, "roofline_s": need / bw,
           "x_roofline": g["gpu_s"] / (need / bw),
           "experts_per_layer": (sum(used) / len(used)) if used else None}
    if kernels:
        print(f"  kernels of the decode step, batch {batch}, context {context} (10 steps)")
        print(kernel_table(graph_step, iters=10, rows=30))
    if rank_exec:
        sb = _decode_batch(rt, batch, context, tokens)
        row["rank_execute"] = time_step(lambda: rt.execute(sb), rt.device, iters=iters)
    return row


def _print_decode(rows: list[dict], title: str) -> None:
    print(f"  {title}")
    print(f"  {'batch':>5} {'ctx':>6} {'graph gpu ms':>12} {'graph wall ms':>13} {'exec wall ms':>12} "
          f"{'need MiB':>9} {'experts/L':>9} {'roof ms':>8} {'x roof':>6}")
    for r in rows:
        ex = f"{r['rank_execute']['wall_s'] * 1e3:12.3f}" if "rank_execute" in r else f"{'-':>12}"
        el = f"{r['experts_per_layer']:9.1f}" if r["experts_per_layer"] is not None else f"{'-':>9}"
        print(f"  {r['batch']:5d} {r['context']:6d} {r['graph']['gpu_s'] * 1e3:12.3f} "
              f"{r['graph']['wall_s'] * 1e3:13.3f} {ex} {r['bytes_needed'] / 2**20:9.1f} {el} "
              f"{r['roofline_s'] * 1e3:8.3f} {r['x_roofline']:6.2f}")


@torch.inference_mode()
def sweep_shape(name: str, args, bw: float, rate: float) -> dict:
    preset = preset_with_layers(name, args.layers)
    cfg = PRESETS[preset]
    batches = [int(b) for b in args.batches.split(",")]
    long_ctx = [int(c) for c in args.long_contexts.split(",") if c]
    long_b = [int(b) for b in args.long_batches.split(",") if b]
    prefills = [int(t) for t in args.prefill.split(",") if t]
    dev = torch.device("cuda", 0)
    sizes = sorted(set(batches) | set(long_b))
    graph = GraphRunnerConfig(max_decode_batch=max(sizes), decode_capture_sizes=tuple(sizes),
                              pcg_max_tokens=max(prefills) if prefills else 0, pcg_token_stride=512)
    max_len = max([args.context] + long_ctx + prefills) + 64
    rt_cfg = RuntimeConfig(model=preset, device=("cuda" if torch.cuda.is_available() else "cpu"), num_kv_blocks=64,
                           max_model_len=max_len, graph=graph,
                           kernels=dataclasses.replace(options_from_environ().kernels, pdl=args.pdl))
    rt = RankRuntime(rt_cfg, ParallelContext(), dev)
    rt.load_model()
    bs = rt_cfg.block_size
    need = max([b * math.ceil((args.context + 1) / bs) for b in batches]
               + [b * math.ceil((c + 1) / bs) for b in long_b for c in long_ctx] + [math.ceil(max(prefills or [1]) / bs)])
    blocks = _kv_blocks(cfg, need, bs, reserve=4 << 30)
    rt.allocate_kv_cache(blocks)
    for k, v in rt.kv_cache.layers:  # history with spread-out values (routing and attention like real data)
        k.normal_(0, 0.5)
        v.normal_(0, 1.0)
    rt.build_runner()
    capture_s = rt.capture_all()
    nbytes = _bytes(rt, cfg)
    rng = np.random.default_rng(0)
    print(f"\n## {preset}: {cfg.num_layers} layers, weights {rt.weight_bytes() / 2**30:.2f} GiB, "
          f"{blocks} KV blocks (need {need}), capture {sum(capture_s.values()):.1f} s")
    kernel_batches = {int(b) for b in args.kernels.split(",") if b}
    decode = [_decode_row(rt, nbytes, bw, b, args.context, rng, args.iters, True, b in kernel_batches)
              for b in batches]
    _print_decode(decode, f"decode, context {args.context}")
    long_rows = [_decode_row(rt, nbytes, bw, b, c, rng, args.iters, False) for c in long_ctx for b in long_b]
    if long_rows:
        _print_decode(long_rows, "decode, long context" + (" (KV blocks shared)" if blocks <= need else ""))
    prefill = []
    for t in prefills:
        step = _prefill_step(rt, t)
        p = time_step(lambda: rt.runner(step), dev, iters=max(5, args.iters // 3))
        floor = _prefill_flops(cfg, rt, t) / rate
        used = _experts_used(rt, step) if _moe_blocks(rt) else []
        bytes_floor = nbytes.needed(used, 1, t - 1) / bw  # the weights read (experts hit), t tokens of KV written
        prefill.append({"tokens": t, "pcg": p, "floor_s": floor, "x_floor": p["gpu_s"] / floor,
                        "bytes_floor_s": bytes_floor, "x_bytes_floor": p["gpu_s"] / bytes_floor,
                        "experts_used": used, "tflops": _prefill_flops(cfg, rt, t) / p["gpu_s"] / 1e12})
    if prefill:
        print(f"  {'tokens':>6} {'pcg gpu ms':>10} {'pcg wall ms':>11} {'floor ms':>8} {'x floor':>7} {'TFLOP/s':>7} "
              f"{'bytes ms':>8} {'x bytes':>7}")
        for r in prefill:
            print(f"  {r['tokens']:6d} {r['pcg']['gpu_s'] * 1e3:10.3f} {r['pcg']['wall_s'] * 1e3:11.3f} "
                  f"{r['floor_s'] * 1e3:8.3f} {r['x_floor']:7.2f} {r['tflops']:7.1f} {r['bytes_floor_s'] * 1e3:8.3f} "
                  f"{r['x_bytes_floor']:7.2f}")
    paths = rt.runner.stats.snapshot()["steps"]
    result = {"preset": preset, "config": {k: str(v) for k, v in dataclasses.asdict(cfg).items()},
              "weight_bytes": rt.weight_bytes(), "kv_blocks": blocks, "kv_blocks_needed": need,
              "capture_s": capture_s, "decode": decode, "long_context": long_rows, "prefill": prefill, "paths": paths,
              "bytes_model": dataclasses.asdict(nbytes)}
    rt.reset()
    return result


def engine_runs(preset: str, batches: list[int], context: int, steps: int, ttft_tokens: tuple[int, ...] = (),
                repeats: int = 5, device: str = "auto", extra_args: tuple[str, ...] = ()) -> dict:
    """Decode steps and first tokens through the engine (see the module doc), on one local executor built from
    `launch.options` as `graphline serve --executor local` would be (plus `extra_args`):
    - "decode": a fresh `LLMEngine` per batch; rows of batch, context, engine_step_s, steps (how many counted);
    - "ttft": for each of `ttft_tokens`, one greedy request of that many random prompt tokens at a time on an idle
      engine (one warm-up request, then `repeats`); rows of tokens, ttft_s (the median
      `RequestOutput.time_to_first_token`: admission, the prefill step and the first token's bookkeeping)."""
    from bench.prefill_bench import Driver
    from engine import LLMEngine
    from launch.options import add_model_args, build_executor, engine_config, start_executor

    ap = argparse.ArgumentParser()
    add_model_args(ap, executor_default="local")
    max_len = max([context + steps] + list(ttft_tokens)) + 64
    args = ap.parse_args(["--model", preset, "--device", device, "--max-model-len", str(max_len),
                          "--max-num-seqs", str(max(batches or [1])), "--no-progress", *extra_args])
    executor, _kind = build_executor(args)
    start_executor(executor, args)
    decode, ttft = [], []
    try:
        cfg = engine_config(args)
        vocab = executor.model_config.vocab_size
        for b in batches:
            drv = Driver(LLMEngine(executor, cfg), vocab, seed=b)
            for _ in range(b):
                drv.add(drv.prompt(context), steps)
            drv.drain()
            counted = drv.decode_steps[len(drv.decode_steps) // 4:]
            decode.append({"batch": b, "context": context, "engine_step_s": statistics.median(counted),
                           "steps": len(counted)})
        for t in ttft_tokens:
            drv = Driver(LLMEngine(executor, cfg), vocab, seed=t)
            drv.run_one(drv.prompt(t), 1)
            times = [drv.run_one(drv.prompt(t), 1).time_to_first_token for _ in range(repeats)]
            ttft.append({"tokens": t, "ttft_s": statistics.median(times), "repeats": repeats})
    finally:
        executor.shutdown()
    return {"decode": decode, "ttft": ttft}


def _print_engine(rows: list[dict], decode: list[dict]) -> None:
    by_batch = {r["batch"]: r for r in decode}
    print(f"  decode through the engine\n  {'batch':>5} {'ctx':>6} {'engine ms':>9} {'steps':>5} {'graph ms':>8} "
          f"{'x graph':>7} {'x roof':>6}")
    for r in rows:
        d = by_batch.get(r["batch"])
        g = f"{d['graph']['gpu_s'] * 1e3:8.3f} {r['engine_step_s'] / d['graph']['gpu_s']:7.2f} " \
            f"{r['engine_step_s'] / d['roofline_s']:6.2f}" if d else f"{'-':>8} {'-':>7} {'-':>6}"
        print(f"  {r['batch']:5d} {r['context']:6d} {r['engine_step_s'] * 1e3:9.3f} {r['steps']:5d} {g}")


def _print_ttft(rows: list[dict], prefill: list[dict]) -> None:
    by_tokens = {r["tokens"]: r for r in prefill}
    print("  first token through the engine")
    print(f"  {'tokens':>6} {'ttft ms':>8} {'pcg ms':>7} {'x floor':>7} {'x bytes':>7}")
    for r in rows:
        p = by_tokens.get(r["tokens"])
        extra = f"{p['pcg']['gpu_s'] * 1e3:7.3f} {r['ttft_s'] / p['floor_s']:7.2f} " \
            f"{r['ttft_s'] / p['bytes_floor_s']:7.2f}" if p else f"{'-':>7} {'-':>7} {'-':>7}"
        print(f"  {r['tokens']:6d} {r['ttft_s'] * 1e3:8.3f} {extra}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"presets, comma-separated (default {SHAPES})")
    ap.add_argument("--layers", type=int, default=None, help="keep the first N layers of every shape")
    ap.add_argument("--batches", default=BATCHES)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--long-contexts", default="8192,32768")
    ap.add_argument("--long-batches", default="1,16,64")
    ap.add_argument("--prefill", default="512,2048")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--engine-batches", default="1,8,64", help="decode batches through the engine (\"\": none)")
    ap.add_argument("--engine-steps", type=int, default=64, help="tokens each engine request decodes")
    ap.add_argument("--engine-ttft", default="512,2048",
                    help="prompt lengths whose time to first token to measure through the engine (\"\": none)")
    ap.add_argument("--kernels", default="", help="decode batches whose per-kernel table to print")
    ap.add_argument("--pdl", default="early", choices=PDL_CHOICES,
                    help="KernelOptions.pdl of the in-rank runs (the other kernel options: the GRAPHLINE_* variables)")
    ap.add_argument("--gemm-table", default=None, help="a `bench.gemm_tune` JSON whose table entries to install "
                    "in the skinny GEMM's tuning table first (an A/B of a sweep's winners in the model)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.gemm_table:
        from bench.gemm_tune import install_table

        print(f"# installed {install_table(args.gemm_table)} tuning-table entries from {args.gemm_table}")
    dev = torch.device("cuda", 0)
    bw = copy_bandwidth(dev)
    rate = matmul_rate(dev)
    print(f"# {machine()} | copy bw {bw / 1e12:.2f} TB/s | bf16 matmul {rate / 1e12:.0f} TFLOP/s | "
          f"layers {args.layers or 'all'}")
    results = []
    for shape in args.shapes.split(","):
        results.append(sweep_shape(shape, args, bw, rate))
        gc.collect()  # the shape's runtime (weights, KV cache, graphs) went out of scope
        torch.cuda.empty_cache()
        engine_b = [int(b) for b in args.engine_batches.split(",") if b]
        engine_t = tuple(int(t) for t in args.engine_ttft.split(",") if t)
        if engine_b or engine_t:
            runs = engine_runs(results[-1]["preset"], engine_b, args.context, args.engine_steps, engine_t)
            results[-1]["engine"], results[-1]["engine_ttft"] = runs["decode"], runs["ttft"]
            if engine_b:
                _print_engine(runs["decode"], results[-1]["decode"])
            if engine_t:
                _print_ttft(runs["ttft"], results[-1]["prefill"])
            gc.collect()
            torch.cuda.empty_cache()
    print(f"\n{'shape':>22} {'b1 x roof':>9} {'b_max x roof':>12} {'long b1 x roof':>14} {'prefill x floor':>15}")
    for r in results:
        d, lc, p = r["decode"], r["long_context"], r["prefill"]
        print(f"{r['preset']:>22} {d[0]['x_roofline']:9.2f} {d[-1]['x_roofline']:12.2f} "
              f"{(lc[-len(args.long_batches.split(','))]['x_roofline'] if lc else float('nan')):14.2f} "
              f"{(p[-1]['x_floor'] if p else float('nan')):15.2f}")
    write_json(args.out, {"machine": machine(), "copy_bandwidth_Bps": bw, "matmul_flops": rate, "args": vars(args),
                          "shapes": results})


if __name__ == "__main__":
    main()
