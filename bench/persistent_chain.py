"""Experiment: a decode step's projection chain as one persistent kernel with grid barriers, against the kernel chain.

    python -m bench.persistent_chain --preset qwen3-1.7b --layers 28 --ctas 1,2

At batch 1 a small model's decode step is bound by its chain of kernels, not by the weight bytes (docs/benchmarks.md,
twenty-second session: ~2 us a kernel boundary). This measures what one persistent kernel would give instead: every
program stays resident for all layers, streams its share of each projection's weight rows, and meets the others at
a grid barrier (an arrival counter in global memory) where the next projection needs the previous one's output. The
first weight tile of a phase is loaded before its barrier wait, so memory keeps streaming across the barrier.

Both sides run one layer's four projections per layer, M = 1 row, bf16, attention left out (o_proj reads the first
`q width` columns of the qkv output), with the numerics of the product's GEMV chain (`triton_gemv`: RMSNorm of the
residual stream in qkv's and gate_up's prologue, SiLU-gate in gate_up's epilogue, the residual add rounded like
`add_rms_norm`):
- `kernels`: the product's GEMV launches as the model makes them (PDL as the default options give it), in a graph;
- `persistent, C CTAs/SM`: one launch of `_chain_kernel` with C programs per SM (only where that many fit);
- `barriers only`: the same launch with no projection work, so the cost of the grid barriers alone shows.
Each is one CUDA graph over all layers (distinct weights per layer, so L2 never holds them), timed in alternating
rounds; the ratio is against the weight bytes over the measured copy bandwidth. The persistent result is checked
against the kernel chain's.
"""
from __future__ import annotations

import argparse
import statistics

import torch
import triton
import triton.language as tl

from bench.common import copy_bandwidth, graph_replay_us, machine, write_json

EPS = 1e-6


@triton.jit
def _arrive(BAR):
    """This program is done with its phase: all its threads' stores are issued (CTA barrier), then one release add."""
    tl.debug_barrier()
    tl.atomic_add(BAR, 1, sem="release", scope="gpu")


@triton.jit
def _wait(BAR, target):
    """Spin until `target` arrivals are counted (acquire), then release the CTA's threads."""
    seen = tl.atomic_add(BAR, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = tl.atomic_add(BAR, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _rstd(X, K, eps, BLOCK_K: tl.constexpr):
    offs = tl.arange(0, BLOCK_K)
    ss = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(X + k0 + offs, cache_modifier=".cg").to(tl.float32)
        ss += x * x
    return tl.rsqrt(tl.sum(ss, axis=0) / K + eps)


@triton.jit
def _x_chunk(X, NW, k0, rstd, NORM: tl.constexpr, BLOCK_K: tl.constexpr):
    offs = k0 + tl.arange(0, BLOCK_K)
    x = tl.load(X + offs, cache_modifier=".cg").to(tl.float32)
    if NORM:
        dt = X.dtype.element_ty
        nw = tl.load(NW + offs).to(tl.float32)
        x = ((x * rstd).to(dt).to(tl.float32) * nw).to(dt).to(tl.float32)
    return x


@triton.jit
def _phase(X, NW, W, OUT, N, K, eps, pid, P, BAR, target, WORK: tl.constexpr, NORM: tl.constexpr,
           GATED: tl.constexpr, ADD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """OUT[:N] = act(norm(X[:K]) @ W^T) over units of BLOCK_N weight rows, unit u on program u % P; W `[N, K]`
    (`[2N, K]` gate then up rows when GATED). ADD: OUT is the residual stream, updated in place to OUT + y
    (rounded). The first unit's first weight chunk is loaded before the wait for `target` arrivals."""
    if WORK:
        dt = W.dtype.element_ty
        n_units = N // BLOCK_N
        offs_n = tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        rows = (pid * BLOCK_N + offs_n).to(tl.int64)
        live = (offs_n[:, None] < tl.where(pid < n_units, BLOCK_N, 0)) & (offs_k[None, :] < BLOCK_K)
        w = tl.load(W + rows[:, None] * K + offs_k[None, :], mask=live, other=0.0)
        wu = w
        if GATED:
            wu = tl.load(W + (rows + N)[:, None] * K + offs_k[None, :], mask=live, other=0.0)
        _wait(BAR, target)
        rstd = 0.0
        if NORM:
            rstd = _rstd(X, K, eps, BLOCK_K)
        for u in range(pid, n_units, P):
            rows = (u * BLOCK_N + offs_n).to(tl.int64)
            acc = tl.zeros([BLOCK_N], dtype=tl.float32)
            acc_u = tl.zeros([BLOCK_N], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                # the next tile (this unit's next chunk, else the next unit's first) is in flight while this one runs
                more = k0 + BLOCK_K < K
                n_rows = tl.where(more, rows, rows + P * BLOCK_N)
                n_k0 = tl.where(more, k0 + BLOCK_K, 0)
                ok = (offs_n[:, None] < tl.where(more | (u + P < n_units), BLOCK_N, 0)) & (offs_k[None, :] < BLOCK_K)
                w_next = tl.load(W + n_rows[:, None] * K + n_k0 + offs_k[None, :], mask=ok, other=0.0)
                wu_next = w_next
                if GATED:
                    wu_next = tl.load(W + (n_rows + N)[:, None] * K + n_k0 + offs_k[None, :], mask=ok, other=0.0)
                x = _x_chunk(X, NW, k0, rstd, NORM, BLOCK_K)
                acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
                if GATED:
                    acc_u += tl.sum(wu.to(tl.float32) * x[None, :], axis=1)
                w = w_next
                wu = wu_next
            y = acc.to(dt).to(tl.float32)
            if GATED:
                act = (y / (1.0 + tl.exp(-y))).to(dt).to(tl.float32)
                y = (act * acc_u.to(dt).to(tl.float32)).to(dt).to(tl.float32)
            if ADD:
                y = y + tl.load(OUT + rows, cache_modifier=".cg").to(tl.float32)
            tl.store(OUT + rows, y.to(dt))
    else:
        _wait(BAR, target)
    _arrive(BAR)


@triton.jit
def _chain_kernel(H, QKV, ACT, NW1, WQKV, WO, NW2, WGU, WD, BAR, L, eps, HID, QKVN, ATT, INTER,
                  WORK: tl.constexpr, BN_QKV: tl.constexpr, BN_O: tl.constexpr, BN_GU: tl.constexpr,
                  BN_D: tl.constexpr, BLOCK_K: tl.constexpr):
    """L layers of qkv, o_proj (+ residual), gate_up (SiLU-gate) and down (+ residual) on the stream H `[HID]`,
    in place. NW1/NW2/WQKV/WO/WGU/WD: int64 `[L]` tables of the layers' bf16 tensors' addresses. BAR: int32 `[1]`,
    zero at launch; every program must be resident (the caller sizes the grid)."""
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    dt = H.dtype.element_ty
    for layer in range(L):
        base = layer * 4 * P
        nw1 = tl.load(NW1 + layer).to(tl.pointer_type(dt))
        nw2 = tl.load(NW2 + layer).to(tl.pointer_type(dt))
        wqkv = tl.load(WQKV + layer).to(tl.pointer_type(dt))
        wo = tl.load(WO + layer).to(tl.pointer_type(dt))
        wgu = tl.load(WGU + layer).to(tl.pointer_type(dt))
        wd = tl.load(WD + layer).to(tl.pointer_type(dt))
        _phase(H, nw1, wqkv, QKV, QKVN, HID, eps, pid, P, BAR, base, WORK, True, False, False, BN_QKV, BLOCK_K)
        _phase(QKV, nw1, wo, H, HID, ATT, eps, pid, P, BAR, base + P, WORK, False, False, True, BN_O, BLOCK_K)
        _phase(H, nw2, wgu, ACT, INTER, HID, eps, pid, P, BAR, base + 2 * P, WORK, True, True, False, BN_GU,
               BLOCK_K)
        _phase(ACT, nw2, wd, H, HID, INTER, eps, pid, P, BAR, base + 3 * P, WORK, False, False, True, BN_D, BLOCK_K)


class ChainWeights:
    """Per-layer bf16 weights of one preset's dense layer (TP=1) and their address tables."""

    def __init__(self, hid: int, qkvn: int, att: int, inter: int, layers: int, device: torch.device, seed: int = 0):
        g = torch.Generator(device=device).manual_seed(seed)

        def w(n: int, k: int) -> torch.Tensor:
            return (torch.randn(n, k, generator=g, device=device) / k ** 0.5).to(torch.bfloat16)

        def nw(k: int) -> torch.Tensor:
            return (1.0 + 0.1 * torch.randn(k, generator=g, device=device)).to(torch.bfloat16)

        self.dims = (hid, qkvn, att, inter)
        self.layers = [dict(nw1=nw(hid), wqkv=w(qkvn, hid), wo=w(hid, att), nw2=nw(hid), wgu=w(2 * inter, hid),
                            wd=w(hid, inter)) for _ in range(layers)]
        self.tables = {name: torch.tensor([lw[name].data_ptr() for lw in self.layers], dtype=torch.int64,
                                          device=device) for name in self.layers[0]}

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for lw in self.layers for name, t in lw.items() if name[0] == "w")


def reference_chain(h: torch.Tensor, cw: ChainWeights) -> torch.Tensor:
    """The chain in torch (fp32 sums, rounded where the kernels round): h `[HID]` bf16 -> the stream after L layers."""
    hid, qkvn, att, inter = cw.dims
    dt = h.dtype

    def normed(x: torch.Tensor, nw: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean() + EPS)
        return ((xf * rstd).to(dt).float() * nw.float()).to(dt).float()

    for lw in cw.layers:
        qkv = (lw["wqkv"].float() @ normed(h, lw["nw1"])).to(dt)
        h = (h.float() + (lw["wo"].float() @ qkv[:att].float()).to(dt).float()).to(dt)
        gu = (lw["wgu"].float() @ normed(h, lw["nw2"])).to(dt).float()
        g, u = gu[:inter], gu[inter:]
        act = ((g / (1.0 + torch.exp(-g))).to(dt).float() * u).to(dt)
        h = (h.float() + (lw["wd"].float() @ act.float()).to(dt).float()).to(dt)
    return h


def launch_chain(h: torch.Tensor, cw: ChainWeights, bar: torch.Tensor, ctas: int, *, work: bool = True,
                 blocks: tuple[int, int, int, int] = (8, 8, 8, 8), block_k: int = 1024, num_warps: int = 8,
                 programs: int | None = None):
    """One `_chain_kernel` launch over h `[HID]` in place (bar zeroed first, on the current stream); returns
    Triton's compiled kernel."""
    hid, qkvn, att, inter = cw.dims
    for n, bn in zip((qkvn, hid, inter, hid), blocks):
        if n % bn:
            raise ValueError(f"width {n} is not a multiple of BLOCK_N {bn}")
    for k in (hid, att, inter):
        if k % block_k:
            raise ValueError(f"K {k} is not a multiple of BLOCK_K {block_k}")
    qkv = torch.empty(qkvn, dtype=h.dtype, device=h.device)
    act = torch.empty(inter, dtype=h.dtype, device=h.device)
    t = cw.tables
    p = programs if programs is not None else ctas * torch.cuda.get_device_properties(h.device).multi_processor_count
    bar.zero_()
    return _chain_kernel[(p,)](h, qkv, act, t["nw1"], t["wqkv"], t["wo"], t["nw2"], t["wgu"], t["wd"], bar, len(cw.layers),
                        EPS, hid, qkvn, att, inter, WORK=work, BN_QKV=blocks[0], BN_O=blocks[1], BN_GU=blocks[2],
                        BN_D=blocks[3], BLOCK_K=block_k, num_warps=num_warps)


def kernel_chain(h: torch.Tensor, cw: ChainWeights, pdl: int) -> torch.Tensor:
    """The product's GEMV launches for the same chain (x, residual carried as the model carries them)."""
    from modeling.ops.triton_gemv import gemv, norm_gemv

    hid, qkvn, att, inter = cw.dims
    x, res = h.view(1, hid), None
    for lw in cw.layers:
        qkv, res = norm_gemv(x, res, lw["nw1"], EPS, lw["wqkv"], pdl=pdl)
        o = gemv(qkv[:, :att], lw["wo"], pdl=pdl)
        act, res = norm_gemv(o, res, lw["nw2"], EPS, lw["wgu"], gated=True, pdl=pdl)
        x = gemv(act, lw["wd"], pdl=pdl)
    return (x.float() + res.float()).to(h.dtype).view(hid)


def max_resident(device: torch.device, h: torch.Tensor, cw: ChainWeights, bar: torch.Tensor, **kw) -> int:
    """Programs of `_chain_kernel` one SM holds at once, from the compiled kernel's registers and shared memory."""
    kern = launch_chain(h.clone(), cw, bar, 1, programs=1, **kw)  # one program: nothing to wait for
    torch.cuda.synchronize(device)
    props = torch.cuda.get_device_properties(device)
    threads = 32 * kern.metadata.num_warps
    by_regs = props.regs_per_multiprocessor // max(1, kern.n_regs * threads)
    shared = kern.metadata.shared
    by_smem = props.shared_memory_per_multiprocessor // shared if shared else 32
    return max(0, min(by_regs, by_smem, props.max_threads_per_multi_processor // threads))


@torch.inference_mode()
def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen3-1.7b")
    ap.add_argument("--layers", type=int, default=0, help="0: the preset's")
    ap.add_argument("--ctas", default="1,2", help="programs per SM to try")
    ap.add_argument("--blocks", default="8,8,8,8", help="BLOCK_N of qkv, o_proj, gate_up, down")
    ap.add_argument("--block-k", type=int, default=1024)
    ap.add_argument("--warps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from modeling.config import PRESETS
    from modeling.ops.pdl import pdl_mode

    c = PRESETS[args.preset]
    dev = torch.device("cuda", 0)
    layers = args.layers or c.num_layers
    dims = (c.hidden_size, (c.num_heads + 2 * c.num_kv_heads) * c.head_dim, c.num_heads * c.head_dim,
            c.intermediate_size)
    cw = ChainWeights(*dims, layers, dev)
    blocks = tuple(int(v) for v in args.blocks.split(","))
    kw = dict(blocks=blocks, block_k=args.block_k, num_warps=args.warps)
    h0 = (torch.randn(dims[0], generator=torch.Generator().manual_seed(1))).to(dev, torch.bfloat16)
    bar = torch.zeros(1, dtype=torch.int32, device=dev)
    bw = copy_bandwidth(dev)
    floor_us = cw.nbytes() / bw * 1e6  # bytes over the copy bandwidth, as every roofline in docs/benchmarks.md
    fits = max_resident(dev, h0, cw, bar, **kw)
    print(f"# {machine()} | {args.preset} x{layers} layers, dims {dims} | weights {cw.nbytes() / 2**20:.0f} MiB, "
          f"floor {floor_us:.1f} us at {bw / 1e12:.2f} TB/s | {fits} programs fit an SM", flush=True)

    pdl = pdl_mode(dev)
    ref = kernel_chain(h0, cw, pdl)
    exact = reference_chain(h0, cw)
    variants = {"kernels": lambda: kernel_chain(h0, cw, pdl)}
    checks = {"kernels vs torch max abs": (ref.float() - exact.float()).abs().max().item()}
    for ctas in (int(v) for v in args.ctas.split(",")):
        if ctas > fits:
            print(f"   {ctas} CTAs/SM: skipped, only {fits} fit", flush=True)
            continue
        h = h0.clone()
        launch_chain(h, cw, bar, ctas, **kw)
        torch.cuda.synchronize()
        checks[f"persistent {ctas} vs kernels max abs"] = (h.float() - ref.float()).abs().max().item()
        checks[f"persistent {ctas} vs torch max abs"] = (h.float() - exact.float()).abs().max().item()
        hp = h0.clone()
        variants[f"persistent, {ctas} CTAs/SM"] = lambda hp=hp, ctas=ctas: launch_chain(hp, cw, bar, ctas, **kw)
        hb = h0.clone()
        variants[f"barriers only, {ctas} CTAs/SM"] = (
            lambda hb=hb, ctas=ctas: launch_chain(hb, cw, bar, ctas, work=False, **kw))
    for name, val in checks.items():
        print(f"   check {name}: {val:.4g}", flush=True)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, g in variants.items():
            times[name].append(graph_replay_us(g, args.replays))
    base = statistics.median(times["kernels"])
    rows = []
    print(f"{'variant':28} {'us/step':>9} {'us/layer':>9} {'x floor':>8} {'vs kernels':>10}")
    for name, ts in times.items():
        us = statistics.median(ts)
        rows.append(dict(variant=name, us=us, us_per_layer=us / layers, x_floor=us / floor_us, vs_kernels=us / base,
                         rounds=ts))
        print(f"{name:28} {us:9.1f} {us / layers:9.2f} {us / floor_us:8.3f} {us / base:10.3f}", flush=True)
    write_json(args.out, dict(machine=machine(), preset=args.preset, layers=layers, dims=dims, bandwidth=bw,
                              floor_us=floor_us, fits=fits, args=vars(args), checks=checks, rows=rows))


if __name__ == "__main__":
    main()
