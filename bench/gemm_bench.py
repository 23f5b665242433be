"""Skinny decode GEMM vs cuBLAS (`F.linear`) on the qwen3-0.6b projection shapes, against the weight-read roofline.

    python -m bench.gemm_bench
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton

from bench.common import copy_bandwidth
from modeling.ops.triton_gemm import linear

SHAPES = {"qkv": (4096, 1024), "o_proj": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072),
          "lm_head": (151936, 1024)}


def main() -> None:
    bw = copy_bandwidth(torch.device("cuda", 0))
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    print(f"{'shape':>8} {'M':>3} {'cublas us':>10} {'skinny us':>10} {'roof us':>8} {'speedup':>8}")
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda").bfloat16()
        for m in (1, 8, 16):
            x = torch.randn(m, k, device="cuda").bfloat16()
            tc = triton.testing.do_bench(lambda: F.linear(x, w), warmup=20, rep=100) * 1e3
            ts = triton.testing.do_bench(lambda: linear(x, w), warmup=20, rep=100) * 1e3
            print(f"{name:>8} {m:3d} {tc:10.1f} {ts:10.1f} {n * k * 2 / bw * 1e6:8.1f} {tc / ts:8.2f}")


if __name__ == "__main__":
    main()
