"""Launcher of the Triton sampler (CUDA logits; the tests also run it under TRITON_INTERPRET=1 on CPU).
The kernels: `triton_kernels` (processing, stats, sample, finish), `triton_select` (top-k), `triton_topp`
(top-p).

Stages per call, each a `(B, C)` grid over chunks of the vocabulary shard unless noted; TP collectives between:

  [processed]  copy (logits -> fp32 work; -inf off the allow mask when the step has one) + patch
               (grid B: bias, bans, penalties)                                        1 pass (write)
  stats        raw max / sum-exp, max z, (top-N) the max raw key of every 32 ids, (top-k) the
               max key of z of every 32 ids, top-k level-1 counts (larger k)          1 pass   gather, sum
  [top-N, TP]  grid B: this rank's top N from its group maxima (`local_top`)         -        gather
  [top_k / top_p] grid B: tau, the k-th largest group max (top-p rows without top-k: the
               512th); candidates above tau (and the total mass of those top-p rows); grid B:
               the k-th largest candidate (k <= 128)                                 1 pass    gather each
  [large_top_k] top-k levels 2, 3 (rows with k > 128)                                2 passes  sum each
  [top_p]      (`triton_topp`) grid B: the threshold from the candidates where they hold
               it; the other rows: radix levels 1, 2, 3 on the key of z weighted by
               fixed-point mass (passes that skip the resolved rows)                  3 passes  sum each
  sample       Gumbel-max over the allowed set, per chunk                            1 pass    gather
  finish       grid B: token, chosen logprob, top-N (one rank: `local_top` itself; TP: the
               N best of the ranks' top N)                                           -

So 2 passes over the logits for temperature / min-p / greedy batches, 3 with top-k (k <= 128) or top-p whose
candidates hold the threshold, 6 with top-p rows that need the radix, +2
with larger k, +1 when processed; top-N reads back only the raw logits of its (<= 32) best groups of 32 ids.
All buffers are allocated per call (inside a capture: from the graph's pool, so the outputs stay valid until the
next replay). No host synchronisation.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from . import triton_kernels as tk
from . import triton_select as tsel
from . import triton_topp as ttp
from .collectives import ShardGroup
from .host import LOGPROB_CLASSES, TOP_K_FAST, SamplerVariant
from .params import I_TOP_K, SamplerParams  # noqa: F401  (record layout shared with triton_select)
from .reference import SampleOutput

BLOCK = 1024  # elements per inner step (tests lower it under the interpreter)
MAX_CHUNK = 16384
SAMPLE_BLOCK = 512  # ids per step of the Gumbel-max kernel (smaller steps skip more of the noise's logs)
SAMPLE_WARPS = 4
SAMPLE_SKIP = True  # skip the noise's logs in tiles that cannot win (False: the plain path, the same tokens)
TARGET_PROGRAMS = 264  # ~2 programs per SM of an H100 / H200
TOPK_GROUP = 32  # top-k: ids per group maximum (at least; doubled until the row's maxima fit TOPK_MAX_GROUPS)
TOPK_MAX_GROUPS = 8192  # group maxima one program per row holds in registers
TOPP_GROUPS = 512  # top-p rows without top-k: candidates above their 512th largest group maximum (tests lower it)
SELECT_BLOCK = 1024  # candidates per load of the top-k bisection (tests lower it)
TOPN_GROUP = 32  # top-N logprobs: ids per group maximum (at least; doubled until a row's maxima fit TOPN_MAX_GROUPS)
TOPN_MAX_GROUPS = 8192  # group maxima (int64 keys) one program per row holds in registers
TOPN_SUPERS = 256  # super groups of the first top-N narrowing (fewer for short rows)
NUM_WARPS = 4
_OPTS = {"num_warps": NUM_WARPS, "enable_fp_fusion": False}


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def chunking(batch: int, width: int, target: int = TARGET_PROGRAMS, max_chunks: int = 1 << 30) -> tuple[int, int]:
    """(chunk size, chunks per row): a multiple of BLOCK, about `target` programs at small batches, at most about
    `max_chunks` per row. Depends only on its arguments, so every TP rank passing the same shard_width chunks
    alike."""
    want = max(1, min(-(-target // batch), max_chunks))
    ch = max(BLOCK, min(MAX_CHUNK, width // want))
    ch = 1 << (ch.bit_length() - 1)  # round down to a power of two (>= BLOCK, itself one)
    ch = max(ch, BLOCK)
    return ch, -(-width // ch)


class LaunchShape(NamedTuple):
    """The compile-time constants of one shard width, TP size and top-N class, the same for every batch size
    (each the largest any batch's chunking needs), so a variant compiled at one batch serves every batch: a
    captured head's compile serves the eager path too. g / gn: ids per top-k / top-N group maximum; npp2: the
    power of two >= every rank's chunks of a row; tb_k: of every rank's top-k group maxima; topn: the top-N
    constexprs of `local_top`."""

    g: int
    gn: int
    npp2: int
    tb_k: int
    topn: dict  # read-only (shared by every launch of the shape)


def launch_shape(width: int, nt: int, n: int) -> LaunchShape:
    """`width`: the chunking width (the widest shard); `nt`: TP ranks; `n`: the kernels' top N (0 or a class)."""
    return _launch_shape(width, nt, n, BLOCK, MAX_CHUNK)  # the tests lower BLOCK and MAX_CHUNK


@functools.lru_cache(maxsize=64)
def _launch_shape(width: int, nt: int, n: int, _block: int, _max_chunk: int) -> LaunchShape:
    shapes = {chunking(b, width) for b in range(1, TARGET_PROGRAMS + 1)}  # b >= TARGET_PROGRAMS chunks as b does
    padded = max(ch * c for ch, c in shapes)  # ids per row a chunking covers, at most
    g = TOPK_GROUP
    while nt * padded // g > TOPK_MAX_GROUPS and g < BLOCK:
        g *= 2
    gn = TOPN_GROUP
    while n and padded // gn > TOPN_MAX_GROUPS and gn < BLOCK:
        gn *= 2
    mn = padded // gn
    np2 = max(2, _pow2(n)) if n else 2
    sup = max(2, _pow2(mn) // TOPN_SUPERS)  # group maxima per super group
    topn = {"N": n, "NP2": np2, "GN": gn, "S": sup, "TB": sup * max(np2, _pow2(mn) // sup)}  # >= NP2 supers
    return LaunchShape(g, gn, _pow2(nt * max(c for _ch, c in shapes)), _pow2(nt * padded // g), topn)


def topn_class(n: int) -> int:
    """The top N the kernels compute for `n` logprobs (0: none)."""
    return 0 if n <= 0 else next((k for k in LOGPROB_CLASSES if k >= n), n)


def sample_triton(logits: torch.Tensor, p: SamplerParams, variant: SamplerVariant, n_asked: int, voff: int,
                  group: ShardGroup, shard_width: int, state: dict | None = None) -> SampleOutput:
    """`state` (diagnostics and tests): when a dict, receives the selection's per-row state "st" `[6, B, 4]`
    and histograms "hist" `[6, B, HS]` (int64, this call's buffers; layouts in `triton_select` and
    `triton_topp`)."""
    b, v = logits.shape
    if n_asked > v:
        raise ValueError(f"num_logprobs {n_asked} exceeds the shard width {v}")
    n = min(topn_class(n_asked), v)
    dev = logits.device
    width = max(shard_width, v)
    ch, c = chunking(b, width)
    nt = group.size
    shape = launch_shape(width, nt, n)
    npp2, topn = shape.npp2, shape.topn
    np2 = topn["NP2"]
    grid = (b, c)
    recf, reci, recq = p.scalars.view(torch.float32), p.scalars.view(torch.int32), p.scalars.view(torch.int64)
    rs, rsq = recf.stride(0), recq.stride(0)
    sl = logits.stride(0)
    work, sw = logits, sl
    if variant.processed:
        work = torch.empty((b, v), dtype=torch.float32, device=dev)
        sw = work.stride(0)
        bits, bs = (p.allow_bits, p.allow_bits.stride(0)) if p.masked else (work, 0)  # work: a pointer not read
        if p.masked and voff + v > 32 * bits.shape[1]:
            raise ValueError(f"allow_bits of {bits.shape[1]} words do not cover global ids [{voff}, {voff + v})")
        tk.copy_kernel[grid](logits, sl, work, sw, bits, bs, v, ch, voff, BLOCK=BLOCK, HAS_MASK=p.masked, **_OPTS)
        lay = p.layout
        tk.patch_kernel[(b,)](work, sw, recf, rs, p.lists, p.lists.view(torch.float32), p.lists.stride(0), v, voff,
                              OFF_BI=lay.bias_ids, OFF_BV=lay.bias_vals, OFF_BAN=lay.ban_ids, OFF_PI=lay.pen_ids,
                              OFF_PC=lay.pen_counts, MB=lay.max_bias, MBP2=_pow2(lay.max_bias), MBAN=lay.max_ban,
                              MBANP2=_pow2(lay.max_ban), MP=lay.max_pen, PB=min(1024, _pow2(lay.max_pen)), **_OPTS)
    need_hist = variant.large_top_k or variant.top_p
    hist = (torch.zeros if need_hist else torch.empty)((6 if need_hist else 1, b, tsel.HS), dtype=torch.int64,
                                                        device=dev)
    st = torch.empty((6, b, 4), dtype=torch.int64, device=dev)
    parts = torch.empty((b, c, 4), dtype=torch.float32, device=dev)
    gather_cands = variant.top_k or variant.top_p
    kf = TOP_K_FAST if gather_cands else 2
    g, gn = shape.g, shape.gn
    m = c * (ch // g)  # group maxima per row and rank
    gmax = torch.empty((b, m) if gather_cands else (1,), dtype=torch.int32, device=dev)
    mn = c * (ch // gn)  # top-N group maxima per row (this rank's)
    nmax = torch.empty((b, mn) if n else (1,), dtype=torch.int32, device=dev)
    common = (logits, sl, work, sw)
    flags = {"PROCESSED": variant.processed}
    tk.stats_kernel[grid](*common, recf, reci, rs, parts, nmax, gmax, hist, b, v, ch, c, kf, voff, BLOCK=BLOCK, N=n,
                          GN=gn, G=g, GMAX=gather_cands, TOPK_LARGE=variant.large_top_k, **flags, **_OPTS)
    parts = group.gather(parts)
    cands = nmax  # one rank: finish selects the top N itself
    if n and nt > 1:  # each rank's top N, gathered; finish merges them
        cands = torch.empty((b, np2), dtype=torch.int64, device=dev)
        tk.topn_kernel[(b,)](logits, sl, nmax, cands, v, mn, voff, **topn, num_warps=8, enable_fp_fusion=False)
        cands = group.gather(cands)
    sel = {"HAS_TOPK": variant.top_k, "TOPK_LARGE": variant.large_top_k}
    topp = {"TOPP": variant.top_p}
    if gather_cands:  # k <= kf (top-p rows without top-k: TOPP_GROUPS): tau, the candidates above it
        tsel.topk_tau_kernel[(b,)](recf, reci, recq, rs, rsq, group.gather(gmax), st, b, m, nt, kf, TOPP_GROUPS,
                                   TB=shape.tb_k, **topp, num_warps=8, enable_fp_fusion=False)
        cap = kf * g  # > (k - 1) * g, the most candidates a top-k row can have over all ranks
        cand = torch.empty((b, cap), dtype=torch.int32, device=dev)
        count = torch.zeros((b,), dtype=torch.int32, device=dev)
        tmass = torch.zeros((2, b), dtype=torch.int64, device=dev)
        tsel.topk_compact_kernel[grid](*common, recf, reci, recq, rs, rsq, parts, st, cand, count, tmass, b, v, ch, c,
                                       nt, kf, TOPP_GROUPS, cap, BLOCK=BLOCK, **flags, **topp, NPP2=npp2, **_OPTS)
        cand, count = group.gather(cand), group.gather(count)
        if variant.top_k:  # the k-th largest candidate
            tsel.topk_select_kernel[(b,)](recf, reci, rs, st, cand, count, b, nt, kf, cap, CB=SELECT_BLOCK, **_OPTS)
    if variant.large_top_k:
        group.sum_(hist[0])
        for level in (2, 3):
            tsel.topk_level_kernel[grid](*common, recf, reci, rs, st, hist, b, v, ch, kf, LEVEL=level, BLOCK=BLOCK,
                                       **flags, **_OPTS)
            group.sum_(hist[level - 1])
    if variant.top_p:
        group.sum_(tmass)
        qbuf = torch.empty((b, nt * cap), dtype=torch.int64, device=dev)
        ttp.topp_cand_kernel[(b,)](recf, reci, recq, rs, rsq, parts, st, hist, cand, count, tmass, qbuf, b, c, nt, kf,
                                   cap, CB=SELECT_BLOCK, **sel, NPP2=npp2, **_OPTS)
        for level in (1, 2, 3):
            ttp.topp_level_kernel[grid](*common, recf, reci, recq, rs, rsq, parts, st, hist, b, v, ch, c, nt, kf,
                                        LEVEL=level, BLOCK=BLOCK, **flags, **sel, NPP2=npp2, **_OPTS)
            group.sum_(hist[level + 2])
    if state is not None:
        state.update(st=st, hist=hist)
    best = torch.empty((b, c, 2), dtype=torch.int64, device=dev)
    tk.sample_kernel[grid](*common, recf, reci, recq, rs, rsq, parts, st, hist, best, b, v, ch, c, nt, voff, kf,
                           BLOCK=min(BLOCK, SAMPLE_BLOCK), **flags, **sel, HAS_TOPP=variant.top_p, NPP2=npp2,
                           SKIP=SAMPLE_SKIP, **{**_OPTS, "num_warps": SAMPLE_WARPS})
    best = group.gather(best)
    tokens = torch.empty((b,), dtype=torch.int64, device=dev)
    chosen = torch.empty((b,), dtype=torch.float32, device=dev)
    top_ids = torch.empty((b, max(n, 1)), dtype=torch.int64, device=dev)  # no empty tensors into a launch
    top_lp = torch.empty((b, max(n, 1)), dtype=torch.float32, device=dev)
    tk.finish_kernel[(b,)](parts, cands, best, logits, sl, nmax, tokens, chosen, top_ids, top_lp, b, c, nt, v, mn,
                           voff, **topn, NPP2=npp2, NTP2=_pow2(nt), LOCAL=nt == 1, num_warps=8 if n else NUM_WARPS,
                           enable_fp_fusion=False)
    return SampleOutput(tokens, chosen, top_ids[:, :n_asked], top_lp[:, :n_asked])
