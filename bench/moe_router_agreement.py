"""Does the MoE router kernel change how often two correct expert paths agree? Teacher-forced bf16 agreement on one GPU.

    python -m bench.moe_router_agreement --seeds 0,1,2,3,4,5

`qwen3-moe-small` with random bf16 weights routes at near-ties (the 8th and 9th expert's scores within bf16 noise),
so two correct backends pick different tokens now and then. For each routing (torch's `modeling.moe.route`, the
one-launch `triton_router` kernel: `KernelOptions.moe_route_kernel`) this builds two runtimes whose decode graphs
differ only in the expert path (the routed-expert kernel against torch's static experts), runs both teacher forced
on the tokens of a torch reference run (eager, torch operators) for each prompt seed, and counts the steps whose
greedy tokens agree. If the router kernel were wrong, its agreement would fall well below torch routing's across
seeds; if both spread alike, one seed's figure is noise. Prints per seed and in total, writes `--out` JSON.
"""
from __future__ import annotations

import argparse

import numpy as np
import torch

from actors.rank import RankRuntime, RuntimeConfig
from bench.common import machine, write_json
from graphrunner.config import GraphRunnerConfig
from graphrunner.step import ForwardStep
from modeling.attn_metadata import build_step_from_arrays
from modeling.kv_cache import BlockAllocator
from modeling.ops.options import KernelOptions
from parallel.context import ParallelContext

MODEL = "qwen3-moe-small"


def _runtime(route_kernel: bool, static_experts: bool = False, reference: bool = False) -> RankRuntime:
    graph = GraphRunnerConfig(eager_mode=reference, max_decode_batch=8, pcg_max_tokens=0)
    cfg = RuntimeConfig(model=MODEL, device="cuda", num_kv_blocks=512, max_model_len=4096, dtype="bfloat16",
                        graph=graph, kernel_backend="torch" if reference else "triton",
                        kernels=KernelOptions(moe_route_kernel=route_kernel))
    rt = RankRuntime(cfg, ParallelContext(), torch.device("cuda", 0))
    rt.load_model()
    rt.allocate_kv_cache()
    rt.build_runner()
    if static_experts:
        for layer in rt.model.layers:
            layer.mlp.routed_kernel = None  # torch's static experts, captured in the same decode graphs
    if not reference:
        rt.capture_all()
    return rt


def _step(rt: RankRuntime, chunks: list[list[int]], history: list[int], tables: list[list[int]]) -> ForwardStep:
    width = rt.cfg.max_blocks_per_seq
    tab = np.zeros((len(chunks), width), dtype=np.int32)
    for i, t in enumerate(tables):
        tab[i, :len(t)] = t
    ids, pos, meta = build_step_from_arrays(
        np.array([x for c in chunks for x in c], dtype=np.int64), np.array([len(c) for c in chunks], dtype=np.int32),
        np.array(history, dtype=np.int32), tab, rt.cfg.block_size, rt.device)
    return ForwardStep(ids, pos, rt.kv_cache.layers, meta)


@torch.inference_mode()
def decode_run(rt: RankRuntime, prompts: list[list[int]], steps: int,
               forced: list[list[int]] | None = None) -> list[list[int]]:
    """Prefill, then `steps - 1` greedy decode steps through `rt.runner` fed back (or teacher forced on
    `forced[i][s]`); returns the greedy tokens per prompt. The sequences' blocks are freed after."""
    alloc = BlockAllocator(rt.kv_cache.spec.num_blocks)
    tables = [alloc.allocate(-(-(len(p) + steps + 1) // rt.cfg.block_size)) for p in prompts]
    step = _step(rt, prompts, [0] * len(prompts), tables)
    out = [[t] for t in rt.model.greedy_tokens(rt.runner(step), step.attn_metadata.last_token_index).tolist()]
    hist = [len(p) for p in prompts]
    for s in range(steps - 1):
        feed = [[o[-1]] for o in out] if forced is None else [[f[s]] for f in forced]
        step = _step(rt, feed, hist, tables)
        for o, t in zip(out, rt.model.greedy_tokens(rt.runner(step), step.attn_metadata.last_token_index).tolist()):
            o.append(t)
        hist = [h + 1 for h in hist]
    for t in tables:
        alloc.free(t)
    return out


def agreement(a: list[list[int]], b: list[list[int]]) -> tuple[int, int]:
    """(agreeing steps, steps) over all prompts."""
    pairs = [(x, y) for p, q in zip(a, b) for x, y in zip(p, q)]
    return sum(x == y for x, y in pairs), len(pairs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="3,0,1,2,4,5", help="prompt seeds (3: the GPU test's prompts)")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",") if s]
    reference = _runtime(False, reference=True)
    sides = {(kernel, static): _runtime(kernel, static) for kernel in (False, True) for static in (False, True)}
    vocab = reference.model_config.vocab_size
    rows = []
    totals = {False: [0, 0], True: [0, 0]}
    print(f"# {machine()} | {MODEL} bf16, teacher forced on the torch reference, {args.steps} steps x 3 prompts")
    print(f"{'seed':>4} {'torch routing':>14} {'router kernel':>14}  (routed experts agree with static experts)")
    for seed in seeds:
        rng = np.random.default_rng(seed)
        prompts = [rng.integers(1, vocab, n).tolist() for n in (17, 64, 130)]
        want = decode_run(reference, prompts, args.steps)
        row = {"seed": seed}
        for kernel in (False, True):
            routed = decode_run(sides[(kernel, False)], prompts, args.steps, forced=want)
            static = decode_run(sides[(kernel, True)], prompts, args.steps, forced=want)
            same, n = agreement(routed, static)
            ref_same, _ = agreement(routed, want)
            totals[kernel][0] += same
            totals[kernel][1] += n
            row["router_kernel" if kernel else "torch_routing"] = {"agree": same, "steps": n,
                                                                   "agree_with_reference": ref_same}
        rows.append(row)
        t, k = row["torch_routing"], row["router_kernel"]
        print(f"{seed:4d} {t['agree'] / t['steps']:14.3f} {k['agree'] / k['steps']:14.3f}", flush=True)
    print(f"{'all':>4} {totals[False][0] / totals[False][1]:14.3f} {totals[True][0] / totals[True][1]:14.3f}")
    write_json(args.out, {"machine": machine(), "model": MODEL, "steps": args.steps, "seeds": rows,
                          "totals": {"torch_routing": totals[False], "router_kernel": totals[True]}})


if __name__ == "__main__":
    main()
