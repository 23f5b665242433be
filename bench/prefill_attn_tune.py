"""Launch-config sweep of the paged causal prefill attention (`modeling/ops/triton_prefill.py`), with torch's SDPA
on contiguous K/V beside it as a reference point.

    python -m bench.prefill_attn_tune --heads 16/8,32/8,32/4 --cases 512,2048,8192,2048@6144

A case `T` is one sequence of T new tokens with no history; `T@H` is T new tokens after H cached ones (a chunk of
a long prompt under chunked prefill). For each (heads, case): microseconds per call inside a CUDA graph and TFLOP/s
of the causal attention (4 * D * Hq * the attended (query, key) pairs) for the default config and every swept
config (each checked against the default's output, atol = rtol = 2e-2), and `torch.nn.functional.
scaled_dot_product_attention` (causal, GQA, the backend torch picks) over the same new tokens when there is no
history. bf16, head_dim 128, KV pages of 64 tokens (the runtime's default), pages in a shuffled order.
"""
from __future__ import annotations

import argparse
import itertools

import torch

from bench.common import graph_replay_us, machine, write_json

PAGE = 64
D = 128


def _case(text: str) -> tuple[int, int]:
    new, _, hist = text.partition("@")
    return int(new), int(hist or 0)


def pairs(new: int, hist: int) -> int:
    """(query, key) pairs a causal prefill of `new` tokens after `hist` cached ones attends."""
    return new * hist + new * (new + 1) // 2


@torch.inference_mode()
def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", default="16/8,32/8,32/4", help="Hq/Hkv pairs")
    ap.add_argument("--cases", default="512,2048,8192,2048@6144")
    ap.add_argument("--block-ms", default="64,128")
    ap.add_argument("--block-ns", default="32,64,128")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--stages", default="2,3,4")
    ap.add_argument("--no-sweep", action="store_true", help="only the default config (and SDPA)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from modeling.ops.triton_prefill import PrefillConfig, prefill_attention, prefill_config

    dev = torch.device("cuda", 0)
    ints = lambda text: [int(v) for v in text.split(",") if v]  # noqa: E731
    sweep = [PrefillConfig(*c) for c in itertools.product(ints(args.block_ms), ints(args.block_ns), ints(args.warps),
                                                          ints(args.stages))] if not args.no_sweep else []
    print(f"# {machine()} | bf16, head_dim {D}, pages of {PAGE} | us per call in a graph (TFLOP/s)", flush=True)
    rows = []
    for heads in args.heads.split(","):
        hq, hkv = (int(v) for v in heads.split("/"))
        for text in args.cases.split(","):
            new, hist = _case(text)
            kv_len = new + hist
            n_pages = -(-kv_len // PAGE)
            g = torch.Generator(device=dev).manual_seed(0)
            kc = torch.randn(n_pages + 1, PAGE, hkv, D, generator=g, device=dev).bfloat16()
            vc = torch.randn_like(kc)
            q = torch.randn(new, hq, D, generator=g, device=dev).bfloat16()
            table = (torch.randperm(n_pages, generator=g, device=dev) + 1).int().view(1, -1)
            q_start = torch.zeros(1, dtype=torch.int32, device=dev)
            q_lens = torch.tensor([new], dtype=torch.int32, device=dev)
            kv_lens = torch.tensor([kv_len], dtype=torch.int32, device=dev)
            scale = D ** -0.5
            flops = 4 * D * hq * pairs(new, hist)

            def run(cfg=None):
                return prefill_attention(q, kc, vc, q_start, q_lens, kv_lens, table, scale, max_q_seqlen=new,
                                         config=cfg)

            default = prefill_config(new, D, torch.bfloat16)
            ref = run(default)
            base_us = graph_replay_us(lambda: run(default))
            row = dict(heads=heads, case=text, default=list(default.__dict__.values()), default_us=base_us,
                       default_tflops=flops / base_us / 1e6, configs=[])
            best = (base_us, default)
            for cfg in sweep:
                try:
                    ok = torch.allclose(run(cfg).float(), ref.float(), atol=2e-2, rtol=2e-2)
                    us = graph_replay_us(lambda cfg=cfg: run(cfg)) if ok else float("inf")
                except Exception as exc:  # noqa: BLE001 - a config that fails to compile or launch is skipped
                    print(f"    {cfg}: {type(exc).__name__} {str(exc)[:100]}", flush=True)
                    us = float("inf")
                row["configs"].append(dict(config=list(cfg.__dict__.values()), us=us))
                if us < best[0]:
                    best = (us, cfg)
            sdpa_us = None
            if hist == 0:
                # the same new tokens as contiguous [1, H, T, D] K/V (positions in page-table order)
                k = kc[table[0].long()].reshape(-1, hkv, D)[:new].transpose(0, 1).unsqueeze(0).contiguous()
                v = vc[table[0].long()].reshape(-1, hkv, D)[:new].transpose(0, 1).unsqueeze(0).contiguous()
                qs = q.transpose(0, 1).unsqueeze(0).contiguous()

                def sdpa():
                    return torch.nn.functional.scaled_dot_product_attention(qs, k, v, is_causal=True, enable_gqa=True)

                diff = (sdpa()[0].transpose(0, 1).float() - ref.float()).abs().max().item()
                sdpa_us = graph_replay_us(sdpa)
                row.update(sdpa_us=sdpa_us, sdpa_max_abs=diff)
            row.update(best=list(best[1].__dict__.values()), best_us=best[0])
            rows.append(row)
            sd = f"{sdpa_us:8.1f} ({flops / sdpa_us / 1e6:5.0f})" if sdpa_us else "-"
            print(f"{heads:>6} {text:>10}  default {tuple(default.__dict__.values())} {base_us:8.1f} "
                  f"({flops / base_us / 1e6:5.0f})  best {tuple(best[1].__dict__.values())} {best[0]:8.1f} "
                  f"({flops / best[0] / 1e6:5.0f})  sdpa {sd}", flush=True)
    write_json(args.out, dict(machine=machine(), args=vars(args), rows=rows))


if __name__ == "__main__":
    main()
