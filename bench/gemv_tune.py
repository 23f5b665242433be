"""Config sweep for the decode GEMV (`modeling/ops/triton_gemv.py`) on a preset's TP=1 projections (Qwen3-0.6B by
default), and, for Qwen3-0.6B, the per-layer chain of projections as the model runs it with and without the GEMV.

    python -m bench.gemv_tune --out artifacts/gemv_tune.json
    python -m bench.gemv_tune --shapes qwen3-8b,qwen3-30b-a3b --no-chain     # other presets' projections

Per projection and row count M it times (microseconds per call inside one CUDA graph over weight copies, 28 or for
large weights fewer but at least 512 MiB in all, as `bench.gemm_tune` does) the operators the GEMV replaces, run
unfused (`add_rms_norm` kernel, `linear` as the skinny-GEMM table picks it, `silu_and_mul`), against every swept GEMV
config; each config is checked against the unfused result (atol = rtol = 2e-2, and the new residual stream bitwise)
and for bitwise-equal outputs across replays. Then the chain of one layer's four projections (qkv, o_proj, gate_up,
down, attention left out: a fixed input to o_proj) over 28 layers: the model's layout before the GEMV (residual add +
norm in the skinny GEMM's epilogue after o_proj and down, cuBLAS qkv and gate_up) against the GEMV layout (add + norm
in the prologue of qkv and gate_up, SiLU-gate in gate_up's epilogue) with the best configs; microseconds per layer,
side by side in one run. The JSON holds every measurement and a ready-to-paste `_CONFIGS`.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import time
from pathlib import Path

import torch

from bench.common import copy_bandwidth, machine, preset_projections, weight_copies, write_json
from bench.gemm_tune import GraphTimer

H, I, QKV, ATT = 1024, 3072, 4096, 2048  # Qwen3-0.6B: hidden, intermediate, q+k+v width, attention width
EPS = 1e-6
# name -> (N, K, norm, gated): N is the output width (the SiLU-gate's width when gated), K the input width.
OPS = {"qkv": (QKV, H, 2, False), "o_proj": (H, ATT, 0, False), "gate_up": (I, H, 2, True), "down": (H, I, 0, False)}
MS = (1, 2)
COPIES = 28  # weight copies a graph cycles through (fewer for large weights: at least COPY_BYTES in all)
COPY_BYTES = 512 << 20
Cfg = tuple  # (BLOCK_N, BLOCK_K, num_warps, num_stages[, row_loop])


def preset_ops(name: str) -> dict[str, tuple[int, int, int, bool]]:
    """The GEMV-shaped decode projections of preset `name` at TP=1: qkv and o_proj, plus gate_up and down for a
    dense MLP (MoE experts take the routed kernel), keyed `<preset>:<op>`."""
    p = preset_projections(name)
    ops = {"qkv": (*p["qkv"], 2, False), "o_proj": (*p["o_proj"], 0, False)}
    if "gate_up" in p:
        ops.update(gate_up=(p["gate_up"][0] // 2, p["gate_up"][1], 2, True), down=(*p["down"], 0, False))
    return {f"{name}:{op}": shape for op, shape in ops.items()}


def copies_for(n: int, k: int, gated: bool) -> int:
    return weight_copies((2 if gated else 1) * n * k * 2, COPY_BYTES, COPIES)


def install_winners(path: str) -> int:
    """Put the winners of a `bench.gemv_tune` JSON at `path` into `triton_gemv._CONFIGS` (this process); returns
    how many."""
    from modeling.ops import triton_gemv

    rows = [r for r in json.loads(Path(path).read_text())["results"] if r.get("best")]
    for r in rows:
        triton_gemv._CONFIGS[(r["n"], r["k"], triton_gemv.m_pad(r["m"]), r["norm"], r["gated"])] = \
            tuple(r["best"]["config"])
    return len(rows)


def sweep_configs(n: int, k: int, m: int, gated: bool, row_loop: bool = False) -> list[Cfg]:
    """Configs with at most 32K weight-times-row products per program per chunk (registers); row_loop: whole-row
    configs in `GemvConfig.row_loop` form (a fifth element, True)."""
    from modeling.ops.triton_gemv import m_pad

    out = []
    kmax = 1 << (k - 1).bit_length()
    for bn in (1, 2, 4, 8, 16, 32):
        for bk in ((256, 512, 1024, 2048, 4096) if k <= 4096 else (512, 1024, 2048, 4096)):
            if bk > kmax:
                continue
            work = bn * bk * m_pad(m) * (2 if gated else 1)
            if not 1024 <= work <= 32768:
                continue
            for warps in ((4, 8) if m == 1 or k > 4096 else (4,)):
                for stages in (((1, 3) if k <= 4096 else (1, 2, 4)) if k > bk else (1,)):
                    out.append((bn, bk, warps, stages, True) if row_loop and bk >= k else (bn, bk, warps, stages))
    return out


def _compile_worker(job: tuple[list[tuple[str, int, Cfg, tuple]], int]) -> list[str]:
    """Spawned process: launch each (op, M, config) once on the real shape (same specialisation as the sweep)."""
    jobs, device_index = job
    from modeling.ops.triton_gemv import GemvConfig, gemv_with_config

    torch.cuda.set_device(device_index)
    errors = []
    for name, m, c, (n, k, norm, gated) in jobs:
        x = torch.zeros(m, k, dtype=torch.bfloat16, device="cuda")
        w = torch.zeros(2 * n if gated else n, k, dtype=torch.bfloat16, device="cuda")
        nw = torch.ones(k, dtype=torch.bfloat16, device="cuda") if norm else None
        try:
            gemv_with_config(x, w, GemvConfig(*c), residual=x if norm == 2 else None, norm_weight=nw, eps=EPS,
                             gated=gated)
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - reported; the sweep records the config as failed
            errors.append(f"{name} M={m} {c}: {type(e).__name__}: {e}"[:300])
    return errors


def precompile(jobs: list[tuple[str, int, Cfg, tuple]], workers: int, device_index: int) -> list[str]:
    if workers <= 0 or len(jobs) < 2:
        return _compile_worker((jobs, device_index))
    workers = min(workers, len(jobs))
    chunks = [(jobs[i::workers], device_index) for i in range(workers)]
    with mp.get_context("spawn").Pool(workers) as pool:
        return [e for errs in pool.map(_compile_worker, chunks) for e in errs]


def _weights(n: int, k: int, gated: bool, seed: int) -> list[torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    w0 = (torch.randn(2 * n if gated else n, k, device="cuda", generator=g) / k ** 0.5).bfloat16()
    return [w0] + [w0.clone() for _ in range(copies_for(n, k, gated) - 1)]


def tune_op(name: str, shape: tuple[int, int, int, bool], m: int, timer: GraphTimer, bw: float,
            row_loop: bool = False) -> dict:
    from modeling.ops.triton_fused import add_rms_norm, silu_and_mul
    from modeling.ops.triton_gemm import linear
    from modeling.ops.triton_gemv import GemvConfig, gemv_with_config

    n, k, norm, gated = shape
    ws = _weights(n, k, gated, n * 7 + k)
    copies = len(ws)
    g = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    res = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    nw = (1 + 0.1 * torch.randn(k, device="cuda", generator=g)).bfloat16()

    def unfused(i: int) -> torch.Tensor:
        h = add_rms_norm(x, res, nw, EPS)[0] if norm else x
        y = linear(h, ws[i % copies])
        return silu_and_mul(y) if gated else y

    base_us, ref, _ = timer.run(unfused, copies)
    ref_sum = add_rms_norm(x, res, nw, EPS)[1] if norm else None
    rows = []
    for c in sweep_configs(n, k, m, gated, row_loop):
        cfg = GemvConfig(*c)
        kw = dict(residual=res if norm == 2 else None, norm_weight=nw if norm else None, eps=EPS, gated=gated)
        try:
            us, y, same = timer.run(lambda i: gemv_with_config(x, ws[i % copies], cfg, **kw)[0], copies)
            summed = gemv_with_config(x, ws[0], cfg, **kw)[1]
        except Exception as e:  # noqa: BLE001 - a config that fails to launch is recorded, not fatal
            rows.append({"config": list(c), "error": f"{type(e).__name__}: {e}"[:300]})
            continue
        ok = bool(torch.allclose(y.float(), ref.float(), atol=2e-2, rtol=2e-2))
        if ref_sum is not None:
            ok = ok and torch.equal(summed, ref_sum)
        rows.append({"config": list(c), "us": us, "correct": ok, "deterministic": same})
    good = sorted((r for r in rows if "us" in r and r["correct"] and r["deterministic"]), key=lambda r: r["us"])
    best = good[0] if good else None
    roof = (2 if gated else 1) * n * k * 2 / bw * 1e6
    print(f"{name:>22} {m:3d} {base_us:9.2f} {best['us'] if best else float('nan'):9.2f} {roof:8.2f}  "
          f"{tuple(best['config']) if best else '-'}  {len(good)}/{len(rows)} ok", flush=True)
    return {"op": name, "m": m, "n": n, "k": k, "norm": norm, "gated": gated, "unfused_us": base_us,
            "roofline_us": roof, "best": best, "sweep": rows}


def chain(m: int, best: dict[tuple[str, int], Cfg], timer: GraphTimer) -> dict:
    """One layer's projections over 28 layers: before (epilogue norm, cuBLAS qkv/gate_up) against the GEMV layout."""
    from modeling.ops.triton_fused import add_rms_norm
    from modeling.ops.triton_gemm import linear, linear_add_rms_norm
    from modeling.ops.triton_gemv import GemvConfig, gemv_with_config

    w = {name: _weights(n, k, gated, n * 7 + k) for name, (n, k, _, gated) in OPS.items()}
    g = torch.Generator(device="cuda").manual_seed(100 + m)
    o_in = torch.randn(m, ATT, device="cuda", generator=g).bfloat16()
    res0 = torch.randn(m, H, device="cuda", generator=g).bfloat16()
    y0 = torch.randn(m, H, device="cuda", generator=g).bfloat16()
    nw = (1 + 0.1 * torch.randn(H, device="cuda", generator=g)).bfloat16()
    h0 = add_rms_norm(y0, res0, nw, EPS)[0]
    cfg = {name: GemvConfig(*best[(name, m)]) for name in OPS if (name, m) in best}
    if len(cfg) < len(OPS):
        return {"m": m, "error": "no passing config for every projection"}

    def before(layers: int, pdl: int) -> torch.Tensor:
        h, res = h0, res0
        for i in range(layers):
            linear(h, w["qkv"][i], pdl=pdl)
            h, res = linear_add_rms_norm(o_in, w["o_proj"][i], res, nw, EPS, pdl=pdl)
            up = linear(h, w["gate_up"][i], pdl=pdl)
            h, res = linear_add_rms_norm(up, w["down"][i], res, nw, EPS, gated=True, pdl=pdl)
        return res

    def after(layers: int, pdl: int) -> torch.Tensor:
        y, res = y0, res0
        for i in range(layers):
            _, res = gemv_with_config(y, w["qkv"][i], cfg["qkv"], residual=res, norm_weight=nw, eps=EPS, pdl=pdl)
            y, _ = gemv_with_config(o_in, w["o_proj"][i], cfg["o_proj"], pdl=pdl)
            act, res = gemv_with_config(y, w["gate_up"][i], cfg["gate_up"], residual=res, norm_weight=nw, eps=EPS,
                                        gated=True, pdl=pdl)
            y, _ = gemv_with_config(act, w["down"][i], cfg["down"], pdl=pdl)
        return add_rms_norm(y, res, nw, EPS, pdl=pdl)[1]

    from modeling.ops.pdl import pdl_mode, pdl_supported

    out = {"m": m}
    dev = torch.device("cuda", torch.cuda.current_device())
    modes = ["0", "early"] if pdl_supported(dev) else ["0"]
    for mode in modes:
        pdl = pdl_mode(dev, mode)  # each capture below launches with this mode
        for label, fn in (("before", before), ("gemv", after), ("before_again", before), ("gemv_again", after)):
            us, _, _ = timer.run(lambda i, fn=fn: fn(COPIES, pdl), 1)
            out[f"{label}_pdl{mode}_us_per_layer"] = us / COPIES
    for mode in modes:
        b = (out[f"before_pdl{mode}_us_per_layer"] + out[f"before_again_pdl{mode}_us_per_layer"]) / 2
        a = (out[f"gemv_pdl{mode}_us_per_layer"] + out[f"gemv_again_pdl{mode}_us_per_layer"]) / 2
        out[f"ratio_gemv_over_before_pdl{mode}"] = a / b
        print(f"chain M={m} PDL={mode}: before {b:.2f} us/layer, GEMV {a:.2f} us/layer, ratio {a / b:.3f} "
              f"(saves {(b - a) * COPIES:.0f} us per 28-layer step)", flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="JSON output path")
    ap.add_argument("--ops", default=None, help="comma list of " + ",".join(OPS) + " (Qwen3-0.6B; default all)")
    ap.add_argument("--shapes", default=None, help="presets whose projections to sweep instead (comma list)")
    ap.add_argument("--no-chain", action="store_true", help="skip the Qwen3-0.6B per-layer chain")
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--row-loop", action="store_true", help="sweep whole-row configs in the row-at-a-time form")
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--jobs", type=int, default=min(16, max(1, (os.cpu_count() or 2) - 1)))
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    dev = torch.device("cuda", torch.cuda.current_device())
    if args.shapes:
        ops = {name: shape for preset in args.shapes.split(",") for name, shape in preset_ops(preset).items()}
    else:
        ops = {s: OPS[s] for s in (args.ops or ",".join(OPS)).split(",") if s}
    names = list(ops)
    ms = tuple(int(m) for m in args.ms.split(","))
    jobs = [(name, m, c, ops[name]) for name in names for m in ms
            for c in sweep_configs(ops[name][0], ops[name][1], m, ops[name][3], args.row_loop)]
    errors = precompile(jobs, args.jobs, dev.index)
    t_compile = time.perf_counter() - t0
    print(f"compiled {len(jobs)} (op, M, config) in {t_compile:.1f} s ({len(errors)} failed)", flush=True)
    for e in errors[:10]:
        print("  compile failure:", e)
    bw = copy_bandwidth(dev)
    timer = GraphTimer(args.replays)
    print(f"{machine()}; copy bandwidth {bw / 1e12:.2f} TB/s; us per call inside a CUDA graph")
    print(f"{'op':>22} {'M':>3} {'unfused':>9} {'GEMV':>9} {'roof':>8}  best (BLOCK_N, BLOCK_K, warps, stages)")
    rows = [tune_op(name, ops[name], m, timer, bw, args.row_loop) for name in names for m in ms]
    best = {(r["op"], r["m"]): tuple(r["best"]["config"]) for r in rows if r["best"]}
    chains = [chain(m, best, timer) for m in ms] if set(names) == set(OPS) and not args.no_chain else []
    from modeling.ops.triton_gemv import m_pad

    lines = ["_CONFIGS: dict[tuple[int, int, int, int, bool], tuple[int, int, int, int]] = {"]
    for r in rows:
        if r["best"]:
            lines.append(f"    ({r['n']}, {r['k']}, {m_pad(r['m'])}, {r['norm']}, {r['gated']}): "
                         f"{tuple(r['best']['config'])},  # {r['op']} M={r['m']}: {r['best']['us']:.2f} us, "
                         f"unfused {r['unfused_us']:.2f}, roofline {r['roofline_us']:.2f}")
    lines.append("}")
    print("\n".join(lines))
    print(f"total {time.perf_counter() - t0:.1f} s (compile {t_compile:.1f} s)")
    write_json(args.out, {"machine": machine(), "triton": __import__("triton").__version__, "copy_bandwidth_Bps": bw,
                          "replays": args.replays, "copies": COPIES, "compile_s": t_compile,
                          "compile_errors": errors, "results": rows, "chains": chains, "configs_py": "\n".join(lines)})


if __name__ == "__main__":
    main()
