"""Config sweep for the routed-expert GEMMs (`modeling/ops/triton_moe.py`) at decode token counts.

    python -m bench.moe_tune --shape 2048,768,128,8 --tokens 1,8,64,256 --out artifacts/moe_tune.json
    python -m bench.moe_tune --tokens 512,2048 --block-ms 64,128 --warps 4,8 --block-ks 32,64 --block-ns 64,128
    python -m bench.moe_tune --tokens 2048 --block-ms 128 --block-ms2 64,128 --block-ns2 128,256 --warps 8
    python -m bench.moe_tune --pairs --tokens 1,2 --block-ns 16,32,64 --block-ks 64,128,256 --warps 2,4

`--block-ms` / `--warps` / `--block-ns` / `--block-ks` / `--stages` widen the sweep (default: the default config's
row tile, 4 warps, the decode sizes' N and K tiles, 3 and 4 stages); each w13 candidate runs with the default w2 config.

Per token count: `routed_experts` inside one CUDA graph over `--copies` weight copies (so L2 does not hold the
experts), microseconds per call, first sweeping the w13 (gate-up) GEMM's config with the w2 GEMM's default, then
the w2 config with the best w13 one; every config is checked against the grouped default's output (atol = rtol =
2e-2). `--pairs`: the same sweep over `triton_moe_pairs.pair_experts`'s two kernels (row tile fixed at 16).
"""
from __future__ import annotations

import argparse
import itertools

import torch

from bench.common import graph_replay_us, machine, write_json


def _time(fn, copies: int, replays: int = 20) -> float:
    """Microseconds per call of fn(i) over `copies` weight copies, all in one CUDA graph."""
    return graph_replay_us(lambda: [fn(i) for i in range(copies)], replays) / copies


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="2048,768,128,8", help="H,I,E,top_k")
    ap.add_argument("--tokens", default="1,8,64,256")
    ap.add_argument("--copies", type=int, default=4)
    ap.add_argument("--block-ms", default="", help="row tiles to sweep (default: the default config's)")
    ap.add_argument("--block-ms2", default="",
                    help="row tiles of the w2 (down) GEMM to sweep (default: the best w13 config's; the two GEMMs map "
                         "their row tiles independently)")
    ap.add_argument("--warps", default="4")
    ap.add_argument("--block-ns", default="", help="N tiles (default 16,32,64 for w13 and 32,64,128 for w2)")
    ap.add_argument("--block-ns2", default="", help="N tiles of the w2 GEMM (default: --block-ns)")
    ap.add_argument("--block-ks", default="64,128,256")
    ap.add_argument("--stages", default="3,4", help="pipeline stages to sweep")
    ap.add_argument("--pairs", action="store_true",
                    help="sweep the pair-by-pair kernels (`triton_moe_pairs`, 16-row tiles), not the grouped ones")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from modeling.ops.triton_moe import MoeGemmConfig, gemm_config, routed_experts
    from modeling.ops.triton_moe_pairs import pair_configs, pair_experts

    h, i, e, k = (int(v) for v in args.shape.split(","))
    dev = torch.device("cuda", 0)
    w13s = [(torch.randn(e, 2 * i, h, device=dev) / h ** 0.5).bfloat16() for _ in range(args.copies)]
    w2s = [(torch.randn(e, h, i, device=dev) / i ** 0.5).bfloat16() for _ in range(args.copies)]
    print(f"# {machine()} | H {h} I {i} E {e} top-{k} | us per call, graph over {args.copies} weight copies")
    rows = []
    for n in (int(t) for t in args.tokens.split(",")):
        x = torch.randn(n, h, device=dev).bfloat16()
        w, ids = torch.softmax(torch.randn(n, e, device=dev), -1).topk(k, -1)
        w = (w / w.sum(-1, keepdim=True)).float()
        d13, d2 = gemm_config(n * k, e, True, torch.bfloat16), gemm_config(n * k, e, False, torch.bfloat16)
        experts = routed_experts
        if args.pairs:
            (d13, d2), experts = pair_configs(torch.bfloat16), pair_experts
        ref = routed_experts(x, ids, w, w13s[0], w2s[0]).float()

        def run(c13, c2):
            def call(j):
                return experts(x, ids, w, w13s[j], w2s[j], configs=(c13, c2))
            try:
                ok = bool(torch.allclose(call(0).float(), ref, atol=2e-2, rtol=2e-2))
                return _time(call, args.copies) if ok else float("inf")
            except Exception as exc:  # noqa: BLE001 - a config that fails to compile or launch is skipped
                print("   ", c13, c2, type(exc).__name__, str(exc)[:120])
                return float("inf")

        base = run(d13, d2)
        ints = lambda text: tuple(int(v) for v in text.split(",") if v)  # noqa: E731
        bms, warps, bks = ints(args.block_ms) or (d13.block_m,), ints(args.warps), ints(args.block_ks)
        stages = ints(args.stages)
        bns13, bns2 = (ints(args.block_ns),) * 2 if args.block_ns else ((16, 32, 64), (32, 64, 128))
        bns2 = ints(args.block_ns2) or bns2
        c13s = [MoeGemmConfig(bm, bn, bk, nw, st)
                for bm, bn, bk, nw, st in itertools.product(bms, bns13, bks, warps, stages)]
        t13 = sorted(((run(c, d2), c) for c in c13s), key=lambda r: r[0])
        best13 = t13[0][1]
        bms2 = ints(args.block_ms2) or (best13.block_m,)
        c2s = [MoeGemmConfig(bm, bn, bk, nw, st)
               for bm, bn, bk, nw, st in itertools.product(bms2, bns2, bks, warps, stages)]
        t2 = sorted(((run(best13, c), c) for c in c2s), key=lambda r: r[0])
        row = {"tokens": n, "default_us": base, "default": [d13, d2], "best_us": t2[0][0], "best": [best13, t2[0][1]],
               "w13_top": t13[:5], "w2_top": t2[:5]}
        rows.append(row)
        print(f"tokens {n:5d}: default {base:7.1f} us {d13} {d2}\n    best {t2[0][0]:7.1f} us {best13} {t2[0][1]}")
        for t, c in t13[:3]:
            print(f"      w13 {t:7.1f} {c}")
        for t, c in t2[:3]:
            print(f"      w2  {t:7.1f} {c}")
    write_json(args.out, {"machine": machine(), "shape": [h, i, e, k], "rows": rows})


if __name__ == "__main__":
    main()
