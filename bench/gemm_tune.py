"""Config sweep for the skinny decode GEMM (`modeling/ops/triton_gemm.py`) on the Qwen3-0.6B shapes, or on the
dense projections of other presets (`--presets`).

    python -m bench.gemm_tune --out artifacts/gemm_tune.json
    python -m bench.gemm_tune --presets qwen3-8b --shapes qkv,o_proj,gate_up,down --ms 4,16,32,64
    python -m bench.gemm_tune --safe-table qwen3-1.7b --ms 1,4,16 --out artifacts/safe_17b.json  # no GPU

Every measurement runs the GEMM as a decode graph does: one CUDA graph calls it on distinct
weight copies in turn (up to 28 copies, at least 256 MiB of them, so L2 never holds the weights; lm_head: 2
copies, 8 calls), with a fixed x; the graph is replayed `--replays` times and the figure is microseconds
per call (CUDA events). Per (shape, M) it reports cuBLAS (`F.linear`), the pre-sweep kernel
config ("current"), the config `linear` picks now ("table"), the best swept config and the
weight-read roofline (N*K*2 / copy bandwidth). M classes 32 and 64 sweep the 32- and 64-row tiles
(`triton_gemm.block_m`). Every swept config is checked against `F.linear`
(atol = rtol = 2e-2) and for bitwise-equal outputs across replays; the winner is the fastest
config that passes both. The JSON holds all measurements and a ready-to-paste `_CONFIGS`.

Compile time dominates, so all configs are first compiled in parallel in spawned worker
processes (tiny launches that fill Triton's on-disk cache with the same specialisation the
sweep uses: N, K, strides divisible by 16, M not specialised); the sweep itself then only
loads binaries. `--jobs 0` compiles in-process instead.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from bench.common import copy_bandwidth, machine, preset_projections, weight_copies, write_json

SHAPES = {"qkv": (4096, 1024), "o_proj": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072),
          "down_gated": (1024, 3072), "lm_head": (151936, 1024)}
# Shapes whose GEMM input is silu(gate) * up of x `[M, 2K]`, computed in the kernel's prologue; their "cuBLAS"
# column is the unfused pair (`silu_and_mul` kernel + `linear` as the table picks it).
GATED = {"down_gated"}
MS = (1, 4, 16)
COPIES, LM_HEAD_COPIES, LM_HEAD_CALLS = 28, 2, 8
COPY_BYTES = 256 << 20  # weight bytes a graph cycles through (several times L2), capped at COPIES copies
SMEM_LIMIT = 200 * 1024
Cfg = tuple[int, int, int, int, int]  # (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages)


def preset_shapes(preset: str) -> dict[str, tuple[int, int]]:
    """The (N, K) of a preset's dense decode projections at TP=1 (`bench.common.preset_projections`, plus
    down_gated where it has a dense MLP), named "<preset>/<kind>" (kinds as in SHAPES)."""
    kinds = preset_projections(preset)
    if "down" in kinds:
        kinds["down_gated"] = kinds["down"]
    return {f"{preset}/{kind}": nk for kind, nk in kinds.items()}


def kind_of(name: str) -> str:
    return name.rsplit("/", 1)[-1]


def sweep_configs(name: str, n: int, k: int, block_m: int = 16) -> list[Cfg]:
    """The swept configs of one shape at row tile `block_m`: K % (SPLIT_K * BLOCK_K) == 0, brief-formula shared
    memory <= 200 KiB; the 32- and 64-row tiles sweep wider N tiles and shallower K chunks."""
    out = []
    kind = kind_of(name)
    gated = kind in GATED  # the prologue's loads are not pipelined: also one-iteration splits (K / (SK * BK) == 1)
    tall = block_m > 16
    for bn in ((32, 64, 128) if tall else (16, 32, 64)):
        for bk in ((64, 128, 256) if gated or tall else (128, 256, 512)):
            for sk in ((1, 2, 3, 4, 6, 8, 12, 16, 24) if gated else (1, 2, 4, 8)):
                if k % (sk * bk) or (kind == "lm_head" and (sk > 1 or bn < 32)):
                    continue
                for warps in ((4,) if gated else (4, 8)):
                    for stages in ((2, 3, 4) if tall else (1, 2, 3)):
                        if stages * (block_m + bn) * bk * 2 <= SMEM_LIMIT:
                            out.append((bn, bk, sk, warps, stages))
    return out


def current_config(n: int, k: int) -> Cfg:
    """The config the kernel used before this sweep ("current": fixed, M-independent)."""
    bn, bk, stages = (16, 512, 4) if n <= 8192 else (64, 256, 3)
    return (bn, 256 if k % bk else bk, 1, 4, stages)


def _compile_worker(job: tuple[list[tuple[Cfg, bool, int]], int]) -> list[str]:
    """Spawned process: launch each (config, gated, row tile) once on a tiny problem (same Triton specialisation as
    the sweep)."""
    cfgs, device_index = job
    from modeling.ops.triton_gemm import GemmConfig, linear_with_config

    torch.cuda.set_device(device_index)
    errors = []
    for c, gated, bm in cfgs:
        cfg = GemmConfig(*c)
        k = cfg.split_k * cfg.block_k
        x = torch.zeros(bm, 2 * k if gated else k, dtype=torch.bfloat16, device="cuda")
        w = torch.zeros(2 * cfg.block_n, k, dtype=torch.bfloat16, device="cuda")
        try:
            linear_with_config(x, w, cfg, gated=gated)
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - reported, the sweep records the config as failed
            errors.append(f"{c} block_m {bm}: {type(e).__name__}: {e}")
    return errors


def precompile(cfgs: list[tuple[Cfg, bool, int]], jobs: int, device_index: int) -> list[str]:
    """Compile every config once (into Triton's on-disk cache); returns failure messages."""
    if jobs <= 0 or len(cfgs) < 2:
        return _compile_worker((cfgs, device_index))
    jobs = min(jobs, len(cfgs))
    chunks = [(cfgs[i::jobs], device_index) for i in range(jobs)]
    try:
        with mp.get_context("spawn").Pool(jobs) as pool:
            return [e for errs in pool.map(_compile_worker, chunks) for e in errs]
    except Exception as e:  # noqa: BLE001 - the sweep compiles lazily in-process instead
        print(f"parallel compile failed ({type(e).__name__}: {e}); compiling in-process", flush=True)
        return _compile_worker((cfgs, device_index))


class GraphTimer:
    """Captures `calls` invocations of `call(i)` into one CUDA graph on a side stream and times replays."""

    def __init__(self, replays: int) -> None:
        self.replays = replays
        self.stream = torch.cuda.Stream()

    def run(self, call: Callable[[int], torch.Tensor], calls: int) -> tuple[float, torch.Tensor, bool]:
        """Returns (us per call, last call's output after the final replay, bitwise-equal across two replays)."""
        main = torch.cuda.current_stream()
        self.stream.wait_stream(main)
        with torch.cuda.stream(self.stream):
            call(0)  # eager warm-up on the capture stream: compile / load, counters, cuBLAS workspace
            self.stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                outs = [call(i) for i in range(calls)]
            finally:
                graph.capture_end()
        main.wait_stream(self.stream)
        graph.replay()
        graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(self.replays):
            graph.replay()
        end.record()
        end.synchronize()
        us = start.elapsed_time(end) * 1e3 / (self.replays * calls)
        first = outs[-1].clone()
        graph.replay()
        same = torch.equal(first, outs[-1])
        torch.cuda.synchronize()
        return us, outs[-1], same


def _fmt(cfg: Cfg | None) -> str:
    return "-" if cfg is None else "(" + ", ".join(map(str, cfg)) + ")"


def tune_shape(name: str, n: int, k: int, ms: tuple[int, ...], timer: GraphTimer, bw: float) -> list[dict]:
    from modeling.ops.triton_fused import silu_and_mul
    from modeling.ops.triton_gemm import GemmConfig, config_for, linear, linear_with_config

    from modeling.ops.triton_gemm import block_m

    gated = kind_of(name) in GATED
    if kind_of(name) == "lm_head":
        copies, calls = LM_HEAD_COPIES, LM_HEAD_CALLS
    else:
        copies = weight_copies(n * k * 2, COPY_BYTES, COPIES)
        calls = max(8, copies)
    g = torch.Generator(device="cuda").manual_seed(n + k)
    w0 = (torch.randn(n, k, device="cuda", generator=g) / k ** 0.5).bfloat16()
    weights = [w0] + [w0.clone() for _ in range(copies - 1)]
    rows = []
    for m in ms:
        cfgs = sweep_configs(name, n, k, block_m(m))
        x = torch.randn(m, 2 * k if gated else k, device="cuda", generator=g).bfloat16()
        ref = F.linear(silu_and_mul(x) if gated else x, weights[(calls - 1) % copies]).float()

        def measure(cfg: Cfg, x: torch.Tensor = x, ref: torch.Tensor = ref) -> dict:
            gc = GemmConfig(*cfg)
            try:
                us, y, same = timer.run(lambda i: linear_with_config(x, weights[i % copies], gc, gated=gated), calls)
            except Exception as e:  # noqa: BLE001 - a config that fails to launch is recorded, not fatal
                return {"config": list(cfg), "error": f"{type(e).__name__}: {e}"[:300]}
            ok = bool(torch.allclose(y.float(), ref, atol=2e-2, rtol=2e-2))
            return {"config": list(cfg), "us": us, "correct": ok, "deterministic": same}

        if gated:
            cublas_us, _, _ = timer.run(lambda i, x=x: linear(silu_and_mul(x), weights[i % copies]), calls)
        else:
            cublas_us, _, _ = timer.run(lambda i, x=x: F.linear(x, weights[i % copies]), calls)
        current = (measure(current_config(n, k)) if block_m(m) == 16  # it predates the taller row tiles
                   else {"config": None, "skipped": "row tile above 16"})
        t = config_for(n, k, m, gated=gated)
        table = ({"config": None, "us": cublas_us, "correct": True, "deterministic": True} if t is None
                 else measure((t.block_n, t.block_k, t.split_k, t.num_warps, t.num_stages)))
        sweep = [measure(c) for c in cfgs]
        good = sorted((r for r in sweep if "us" in r and r["correct"] and r["deterministic"]), key=lambda r: r["us"])
        best = good[0] if good else None
        row = {"shape": name, "gated": gated, "n": n, "k": k, "m": m, "cublas_us": cublas_us, "current": current,
               "table": table, "roofline_us": n * k * 2 / bw * 1e6, "best": best, "sweep": sweep,
               "failed": [r for r in sweep if "us" not in r or not (r["correct"] and r["deterministic"])]}
        rows.append(row)
        print(f"{name:>24} {m:3d} {cublas_us:8.2f} {current.get('us', float('nan')):8.2f} "
              f"{table.get('us', float('nan')):8.2f} {best['us'] if best else float('nan'):8.2f} "
              f"{row['roofline_us']:8.2f}  {_fmt(tuple(best['config']) if best else None):22} "
              f"{len(good)}/{len(sweep)} ok", flush=True)
    return rows


def configs_source(rows: list[dict]) -> str:
    lines = []
    for table, want_gated in (("_CONFIGS", False), ("_GATED_CONFIGS", True)):
        lines.append(f"{table}: dict[tuple[int, int, int], tuple[int, int, int, int, int] | None] = {{")
        lines += _config_lines([r for r in rows if r["gated"] == want_gated])
        lines.append("}")
    return "\n".join(lines)


def _config_lines(rows: list[dict]) -> list[str]:
    lines = []
    for r in rows:
        if r["best"] is None:
            continue
        base = "unfused" if r["gated"] else "cuBLAS"
        if r["cublas_us"] < r["best"]["us"]:
            lines.append(f"    ({r['n']}, {r['k']}, {r['m']}): None,  # {r['shape']} M{'=' if r['m'] == 1 else '<='}{r['m']}:"
                         f" {base} {r['cublas_us']:.2f} us, best Triton {r['best']['us']:.2f}")
            continue
        lines.append(f"    ({r['n']}, {r['k']}, {r['m']}): {_fmt(tuple(r['best']['config']))},"
                     f"  # {r['shape']} M{'=' if r['m'] == 1 else '<='}{r['m']}: {r['best']['us']:.2f} us, {base} {r['cublas_us']:.2f},"
                     f" roofline {r['roofline_us']:.2f}")
    return lines


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="JSON output path")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma list of " + ",".join(SHAPES))
    ap.add_argument("--presets", default="", help="sweep these presets' projections (the --shapes kinds they have) "
                    "instead of the Qwen3-0.6B ones")
    ap.add_argument("--ms", default=",".join(map(str, MS)), help="row counts (config classes 1, 4, 16, 32, 64)")
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--jobs", type=int, default=min(16, max(1, (os.cpu_count() or 2) - 1)),
                    help="parallel compile processes (0: compile in-process)")
    ap.add_argument("--safe-table", default="", help="write to --out, without timing anything, a table giving these "
                    "presets' untabled projections the safe config at --ms classes (`safe_table`), then stop")
    args = ap.parse_args(argv)
    if args.safe_table:
        if not args.out:
            ap.error("--safe-table needs --out")
        from modeling.ops.projection_choice import m_class

        classes = tuple(sorted({m_class(int(m)) for m in args.ms.split(",")}))
        entries = safe_table([p for p in args.safe_table.split(",") if p], classes)
        write_json(args.out, {"table": entries})
        print(f"wrote {len(entries)} safe-config entries to {args.out}")
        return
    from modeling.ops.triton_gemm import config_for

    t0 = time.perf_counter()
    dev = torch.device("cuda", torch.cuda.current_device())
    from modeling.ops.triton_gemm import block_m

    kinds = [s for s in args.shapes.split(",") if s]
    unknown = sorted(set(kinds) - set(SHAPES))
    if unknown:
        ap.error(f"--shapes: unknown {unknown}; choose from {','.join(SHAPES)}")
    if args.presets:
        shapes = {name: nk for p in args.presets.split(",") if p for name, nk in preset_shapes(p).items()
                  if kind_of(name) in kinds}
    else:
        shapes = {name: SHAPES[name] for name in kinds}
    names = list(shapes)
    ms = tuple(int(m) for m in args.ms.split(","))
    if any(not 1 <= m <= 64 for m in ms):
        ap.error("--ms: row counts between 1 and 64")
    all_cfgs: set[tuple[Cfg, bool, int]] = set()
    for name in names:
        n, k = shapes[name]
        gated = kind_of(name) in GATED
        for bm in sorted({block_m(m) for m in ms}):
            all_cfgs.update((c, gated, bm) for c in sweep_configs(name, n, k, bm))
            if bm == 16:
                all_cfgs.add((current_config(n, k), gated, bm))
        for m in ms:
            t = config_for(n, k, m, dev, gated=gated)
            if t is not None:
                all_cfgs.add(((t.block_n, t.block_k, t.split_k, t.num_warps, t.num_stages), gated, block_m(m)))
    compile_errors = precompile(sorted(all_cfgs), args.jobs, dev.index)
    t_compile = time.perf_counter() - t0
    print(f"compiled {len(all_cfgs)} configs in {t_compile:.1f} s ({len(compile_errors)} failed)", flush=True)
    for e in compile_errors[:10]:
        print("  compile failure:", e[:200])

    bw = copy_bandwidth(dev)
    print(f"{machine()}; copy bandwidth {bw / 1e12:.2f} TB/s; us per call inside a CUDA graph")
    print(f"{'shape':>8} {'M':>3} {'cuBLAS':>8} {'current':>8} {'table':>8} {'best':>8} {'roof':>8}  "
          f"{'best (BN, BK, SK, warps, stages)':22}", flush=True)
    timer = GraphTimer(args.replays)
    rows = []
    for name in names:
        rows += tune_shape(name, *shapes[name], ms, timer, bw)
        torch.cuda.empty_cache()  # drop the weight copies and the graph pools of this shape
    from modeling.ops.triton_gemm import split_k_counters

    counters_zero = int(split_k_counters(dev).count_nonzero()) == 0
    src = configs_source(rows)
    print(src)
    print(f"split-K counters back to zero: {counters_zero}; total {time.perf_counter() - t0:.1f} s "
          f"(compile {t_compile:.1f} s)")
    write_json(args.out, {"machine": machine(), "triton": __import__("triton").__version__,
                          "copy_bandwidth_Bps": bw, "replays": args.replays, "copies": COPIES,
                          "compile_s": t_compile, "total_s": time.perf_counter() - t0,
                          "compile_errors": compile_errors, "counters_zero": counters_zero,
                          "results": rows, "configs": {f"{r['n']},{r['k']},{r['m']}": r["best"]["config"]
                                                       for r in rows if r["best"]},
                          "configs_py": src, "table": table_entries(rows)})


def table_entries(rows: list[dict]) -> list[dict]:
    """The sweep as tuning-table entries (`bench.model_sweep --gemm-table` installs them): per (N, K, M class,
    gated) the best config, or None where cuBLAS (gated: the unfused pair) was faster."""
    from modeling.ops.triton_gemm import m_class

    out = []
    for r in rows:
        if r["best"] is not None:
            faster = r["best"]["us"] < r["cublas_us"]
            out.append({"n": r["n"], "k": r["k"], "m_class": m_class(r["m"]), "gated": r["gated"],
                        "config": r["best"]["config"] if faster else None})
    return out


def safe_table(presets: list[str], classes: tuple[int, ...] = (1, 4, 16), sms: int = 132) -> list[dict]:
    """Tuning-table entries giving every projection of `presets` that the table lacks the safe generic config
    (`triton_gemm.default_config` for `sms` SMs; 132: an H200) at each of `classes`: the path untabled shapes take
    with `GRAPHLINE_PROJECTION_MEASURE=0`, for an in-model A/B against the warm-up's measured choice in one
    process (`bench.decode_ab` variant `gemm_table=PATH`). No device needed."""
    from modeling.ops.triton_gemm import _CONFIGS, default_config

    out = []
    for preset in presets:
        for n, k in dict.fromkeys(preset_projections(preset).values()):
            for mc in classes:
                if (n, k, mc) not in _CONFIGS:
                    c = default_config(n, k, mc, sms)
                    out.append({"n": n, "k": k, "m_class": mc, "gated": False,
                                "config": [c.block_n, c.block_k, c.split_k, c.num_warps, c.num_stages]})
    return out


def install_table(path: str) -> int:
    """Put the `table_entries` of a `bench.gemm_tune` JSON at `path` into `triton_gemm._CONFIGS` /
    `_GATED_CONFIGS` (this process); returns how many."""
    from modeling.ops import triton_gemm

    entries = json.loads(Path(path).read_text())["table"]
    for e in entries:
        table = triton_gemm._GATED_CONFIGS if e["gated"] else triton_gemm._CONFIGS
        table[(e["n"], e["k"], e["m_class"])] = None if e["config"] is None else tuple(e["config"])
    return len(entries)


if __name__ == "__main__":
    main()
