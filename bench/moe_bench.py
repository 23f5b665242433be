"""One MoE layer's experts on one GPU: the routed kernels vs the torch static and grouped paths.

    python -m bench.moe_bench --shape 2048,768,128,8 --tokens 1,8,64,256,512,2048 --out artifacts/moe_bench.json

Per token count: device time of `triton_moe.routed_experts` replayed in a CUDA graph (and of its grouping and its
two GEMMs alone; of `triton_moe_pairs.pair_experts` up to 64 pairs), of the static path (also captured) and of the
eager grouped path; the weight bytes the batch's routing needs (distinct experts routed to) over the measured copy
bandwidth, and all experts' bytes.
"""
from __future__ import annotations

import argparse

import torch

from bench.common import copy_bandwidth, machine, time_step, write_json
from modeling.ops import moe_ref


def _graph(fn):
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="2048,768,128,8", help="H,I,E,top_k")
    ap.add_argument("--tokens", default="1,2,8,64,256,512,2048")
    ap.add_argument("--static-max", type=int, default=256, help="time the static path up to this many tokens")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from modeling.ops.triton_moe import group_by_expert, grouped_swiglu, routed_experts
    from modeling.ops.triton_moe_pairs import pair_experts

    h, i, e, k = (int(v) for v in args.shape.split(","))
    dev = torch.device("cuda", 0)
    bw = copy_bandwidth(dev)
    w13 = (torch.randn(e, 2 * i, h, device=dev) / h ** 0.5).bfloat16()
    w2 = (torch.randn(e, h, i, device=dev) / i ** 0.5).bfloat16()
    per_expert = 3 * i * h * 2
    print(f"# {machine()} | H {h} I {i} E {e} top-{k} | all experts {e * per_expert / 2**20:.1f} MiB | "
          f"copy bw {bw / 1e12:.2f} TB/s")
    print(f"{'tokens':>6} {'experts':>7} {'routed us':>9} {'pairs us':>8} {'group us':>8} {'gemms us':>8} {'static us':>9} {'grouped us':>10} {'roof us':>8} "
          f"{'x roof':>6} {'flop floor us':>13}")
    rows = []
    for n in (int(t) for t in args.tokens.split(",")):
        x = torch.randn(n, h, device=dev).bfloat16()
        logits = torch.randn(n, e, device=dev)
        w, ids = torch.softmax(logits, -1).topk(k, -1)
        w = (w / w.sum(-1, keepdim=True)).float()
        used = int(torch.unique(ids).numel())
        roof = used * per_expert / bw
        routed = time_step(_graph(lambda: routed_experts(x, ids, w, w13, w2)), dev)["gpu_s"]
        group = time_step(_graph(lambda: group_by_expert(ids, e, 0)), dev)["gpu_s"]
        pairs = time_step(_graph(lambda: pair_experts(x, ids, w, w13, w2)), dev)["gpu_s"] if n * k <= 64 else None
        sp, counts = group_by_expert(ids, e, 0)
        gemms = time_step(_graph(lambda: grouped_swiglu(x, sp, counts, w13, w2, n * k, top_k=k)), dev)["gpu_s"]
        static = None
        if n <= args.static_max:
            static = time_step(_graph(lambda: moe_ref.experts_static(x, ids, w, w13, w2, 0)), dev)["gpu_s"]
        grouped = time_step(lambda: moe_ref.experts_grouped(x, ids, w, w13, w2, 0), dev, iters=10)["gpu_s"]
        flops = 2 * n * k * 3 * i * h
        row = {"tokens": n, "experts_used": used, "routed_s": routed, "pairs_s": pairs, "group_s": group,
               "gemms_s": gemms,
               "static_s": static, "grouped_s": grouped,
               "roofline_s": roof, "flops": flops}
        rows.append(row)
        st = f"{static * 1e6:9.1f}" if static is not None else f"{'-':>9}"
        pt = f"{pairs * 1e6:8.1f}" if pairs is not None else f"{'-':>8}"
        print(f"{n:6d} {used:7d} {routed * 1e6:9.1f} {pt} {group * 1e6:8.1f} {gemms * 1e6:8.1f} {st} {grouped * 1e6:10.1f} {roof * 1e6:8.1f} "
              f"{routed / roof:6.2f} {flops / 800e12 * 1e6:13.1f}")
    write_json(args.out, {"machine": machine(), "shape": [h, i, e, k], "copy_bandwidth_Bps": bw, "rows": rows})


if __name__ == "__main__":
    main()
