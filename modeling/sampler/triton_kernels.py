"""The sampler's Triton kernels around the selection: logit processing, per-chunk statistics, Gumbel-max and
logprobs. Grid `(B, C)`: program (row, c) owns chunk c (`CH` columns) of one row's vocabulary shard; the per-row
reductions between stages go through small buffers (per-chunk partials and candidates, and the histograms and
per-row state of the top-k / top-p passes, `triton_select.py`), summed or gathered over TP ranks by the launcher
(`triton_sampler.py`).

copy + patch (processed rows: fp32 copy, bias / bans / penalties) -> stats (raw max and sum-exp, max z, the
top-N and top-k group maxima, top-k level-1 counts) -> [TP: topn (each rank's top N)] -> [`triton_select.py`:
top-k candidates; `triton_topp.py`: top-p] -> sample (each chunk's Gumbel-max winner over the allowed set) ->
finish (token, chosen logprob, top-N).

Top-N logprobs (N <= 20, NP2 = the power of two >= N): stats stores the int32 key of the largest raw logit of
every GN consecutive ids (`nmax` `[B, M]`); one program per row (`local_top`, in finish or, under TP, topn) narrows
in registers, exactly, to the NP2 best super groups, their NP2 best groups, and the NP2 best ids of those (Triton's
bitonic `tl.topk` on unique int64 keys), reading back the raw logits of NP2 groups only; finish keeps N.
"""
import triton
import triton.language as tl

from .triton_numerics import (
    NOISE_MAX,
    SENTINEL,
    gumbel_bits,
    gumbel_of,
    noise_bound,
    okey,
    pack,
    unpack_id,
    unpack_value,
)
from .triton_select import (
    F_FREQ,
    F_INVREP,
    F_INVT,
    F_LOGMINP,
    F_PRES,
    F_REP,
    F_T,
    HS,
    I_TOPK,
    Q_POS,
    Q_SEED,
    Q_TOPP,
    digit_hist,
    find_bin,
    load_z,
    lowest_key,
    row_chunks,
    row_zmax_id,
)
from .triton_topp import resolved_threshold


@triton.jit
def copy_kernel(logits, sl, work, sw, bits, bs, V, CH, voff, BLOCK: tl.constexpr, HAS_MASK: tl.constexpr):
    """fp32 copy of chunk c of a row; HAS_MASK: -inf where the row's allow mask (`bits` int32 `[B, bs]`, bit
    (j & 31) of word j >> 5 for global id j = voff + column) is clear. Without it `bits` / `bs` are not read."""
    row = tl.program_id(0).to(tl.int64)
    lo = tl.program_id(1) * CH
    for s in range(0, CH, BLOCK):
        offs = lo + s + tl.arange(0, BLOCK)
        msk = offs < V
        x = tl.load(logits + row * sl + offs, mask=msk).to(tl.float32)
        if HAS_MASK:
            gid = voff + offs
            word = tl.load(bits + row * bs + (gid >> 5), mask=msk, other=0)
            x = tl.where(((word >> (gid & 31)) & 1) != 0, x, float("-inf"))
        tl.store(work + row * sw + offs, x, mask=msk)


@triton.jit
def patch_kernel(work, sw, recf, rs, li, lf, lrs, V, voff, OFF_BI: tl.constexpr, OFF_BV: tl.constexpr,
                 OFF_BAN: tl.constexpr, OFF_PI: tl.constexpr, OFF_PC: tl.constexpr, MB: tl.constexpr,
                 MBP2: tl.constexpr, MBAN: tl.constexpr, MBANP2: tl.constexpr, MP: tl.constexpr, PB: tl.constexpr):
    """One program per row: bias, then bans, then penalties on the listed ids (barriers order the stages)."""
    row = tl.program_id(0).to(tl.int64)
    wrow = work + row * sw
    lrow = row * lrs
    j = tl.arange(0, MBP2)
    ids = tl.load(li + lrow + OFF_BI + j, mask=j < MB, other=-1)
    loc = ids - voff
    ok = (ids >= 0) & (loc >= 0) & (loc < V)
    x = tl.load(wrow + loc, mask=ok, other=0.0)
    tl.store(wrow + loc, x + tl.load(lf + lrow + OFF_BV + j, mask=j < MB, other=0.0), mask=ok)
    tl.debug_barrier()
    j2 = tl.arange(0, MBANP2)
    ids = tl.load(li + lrow + OFF_BAN + j2, mask=j2 < MBAN, other=-1)
    loc = ids - voff
    ok = (ids >= 0) & (loc >= 0) & (loc < V)
    tl.store(wrow + loc, tl.full([MBANP2], float("-inf"), tl.float32), mask=ok)
    tl.debug_barrier()
    rep = tl.load(recf + row * rs + F_REP)
    inv = tl.load(recf + row * rs + F_INVREP)
    freq = tl.load(recf + row * rs + F_FREQ)
    pres = tl.load(recf + row * rs + F_PRES)
    for s in range(0, MP, PB):
        k = s + tl.arange(0, PB)
        pids = tl.load(li + lrow + OFF_PI + k, mask=k < MP, other=-1)
        cnt = tl.load(li + lrow + OFF_PC + k, mask=k < MP, other=0)
        ploc = pids - voff
        pok = (pids >= 0) & (ploc >= 0) & (ploc < V)
        y = tl.load(wrow + ploc, mask=pok, other=0.0)
        y = tl.where(y > 0, y * inv, y * rep)
        y = y - freq * cnt.to(tl.float32)
        y = y - pres * (cnt > 0).to(tl.float32)
        tl.store(wrow + ploc, y, mask=pok)


@triton.jit(do_not_specialize=("B", "C"))
def stats_kernel(logits, sl, work, sw, recf, reci, rs, parts, nmax, gmax, hist, B, V, CH, C, KF, voff,
                 BLOCK: tl.constexpr, N: tl.constexpr, GN: tl.constexpr, G: tl.constexpr,
                 GMAX: tl.constexpr, PROCESSED: tl.constexpr, TOPK_LARGE: tl.constexpr):
    """Per chunk: raw max and sum of exp (log-softmax), max of z and the global id of one token holding it (as
    int32 bits: `parts[row, c]` = rmax, rsum, zmax, id), (top-N) the int32 key of the largest raw logit
    of every GN consecutive ids (`nmax` `[B, C * CH / GN]`; ids past V: -2^31), (GMAX: top-k / top-p candidates)
    the int32 key of the largest z of every G consecutive ids (`gmax` `[B, C * CH / G]`), top-k level-1 counts
    of rows with k > KF."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    t = tl.load(recf + row * rs + F_T)
    invt = tl.load(recf + row * rs + F_INVT)
    k = tl.load(reci + row * rs + I_TOPK)
    topk_on = (t > 0) & (k > 0)
    rmax = float("-inf")
    rsum = 0.0
    zmax = float("-inf")
    zid = tl.zeros((), tl.int32)
    hacc = tl.zeros([2048], tl.int32)
    lo = c * CH
    for s in range(0, CH, BLOCK):
        offs = lo + s + tl.arange(0, BLOCK)
        msk = offs < V
        raw = tl.load(logits + row * sl + offs, mask=msk, other=float("-inf")).to(tl.float32)
        nm = tl.maximum(rmax, tl.max(raw))
        ex = tl.where(raw > float("-inf"), tl.exp(raw - nm), 0.0)
        rsum = rsum * tl.where(rmax > float("-inf"), tl.exp(rmax - nm), 0.0) + tl.sum(ex)
        rmax = nm
        if PROCESSED:
            z = tl.load(work + row * sw + offs, mask=msk, other=float("-inf")) * invt
        else:
            z = raw * invt
        zb = tl.max(z)
        if zb > zmax:
            zid = tl.min(tl.where(z == zb, offs, 2147483647))
        zmax = tl.maximum(zmax, zb)
        if GMAX:
            gk = tl.max(tl.reshape((okey(z) - 2147483648).to(tl.int32), [BLOCK // G, G]), axis=1)
            tl.store(gmax + row * (C * (CH // G)) + (lo + s) // G + tl.arange(0, BLOCK // G), gk)
        if TOPK_LARGE:
            hacc += digit_hist((okey(z) >> 21).to(tl.int32), tl.where(topk_on & (k > KF), msk, False), 2048)
        if N > 0:
            rk = tl.where(msk, okey(raw) - 2147483648, -2147483648).to(tl.int32)
            gn = tl.max(tl.reshape(rk, [BLOCK // GN, GN]), axis=1)
            tl.store(nmax + row * (C * (CH // GN)) + (lo + s) // GN + tl.arange(0, BLOCK // GN), gn)
    pbase = parts + (row * C + c) * 4
    tl.store(pbase, rmax)
    tl.store(pbase + 1, rsum)
    tl.store(pbase + 2, zmax)
    tl.store(pbase + 3, (voff + zid).to(tl.float32, bitcast=True))
    if TOPK_LARGE:
        ar = tl.arange(0, 2048)
        tl.atomic_add(hist + row * HS + ar, hacc.to(tl.int64), mask=hacc > 0)


@triton.jit
def _max_keep_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit(do_not_specialize=("B", "C"))
def sample_kernel(logits, sl, work, sw, recf, reci, recq, rs, rsq, parts, st, hist, best, B, V, CH, C, NT, voff, KF,
                  BLOCK: tl.constexpr, PROCESSED: tl.constexpr, HAS_TOPK: tl.constexpr, TOPK_LARGE: tl.constexpr,
                  HAS_TOPP: tl.constexpr, NPP2: tl.constexpr, SKIP: tl.constexpr):
    """Per chunk: the allowed token maximising z + Gumbel noise (z alone for greedy rows), lowest id on ties.
    Tiles of `[BLOCK / 4, 4]` ids aligned to 4 globally: one Philox call serves 4 ids. SKIP: a sampled tile's
    logs are computed only where its largest z plus `noise_bound` of its largest random bits reaches the best
    score so far, which starts at the score of a token holding the row's largest z (else every tile within
    NOISE_MAX of the best score is computed); the same tokens either way."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    t = tl.load(recf + row * rs + F_T)
    invt = tl.load(recf + row * rs + F_INVT)
    seed = tl.load(recq + row * rsq + Q_SEED)
    position = tl.load(recq + row * rsq + Q_POS)
    k = tl.load(reci + row * rs + I_TOPK)
    m, mid = row_zmax_id(parts, row, B, C, NT, NPP2)
    key_lo = lowest_key(row, B, k, (t > 0) & (k > 0), t > 0, tl.load(recf + row * rs + F_LOGMINP), m, st, hist,
                        KF, HAS_TOPK, TOPK_LARGE)
    if HAS_TOPP:
        if (t > 0) & (tl.load(recq + row * rsq + Q_TOPP) > 0):
            thr = resolved_threshold(st, B, row)  # from the candidates, else the radix's last digit
            if thr == 0:
                sp = st + (4 * B + row) * 4
                d, _n = find_bin(hist + (5 * B + row) * HS, 1024, tl.load(sp + 2))
                thr = (tl.load(sp + 1) << 10) | d
            key_lo = tl.maximum(key_lo, thr)
    greedy = t == 0
    bound = tl.where(greedy, 0.0, NOISE_MAX)
    lo = c * CH
    hi = tl.minimum(lo + CH, V)
    g_lo = voff + lo
    a = g_lo - g_lo % 4
    R: tl.constexpr = BLOCK // 4
    r = tl.arange(0, R)[:, None]
    j = tl.arange(0, 4)[None, :]
    top = tl.full((), SENTINEL, tl.int64)
    # A tile whose best possible score is below top_score cannot hold the row's winner. It starts at a score the
    # winner's is at least: that of a token holding the row's largest z (the largest z is always allowed).
    top_score = float("-inf")
    if SKIP & (m > float("-inf")) & (mid >= 0):
        if greedy:
            top_score = m
        else:
            lane = tl.arange(0, 4)
            gs = mid - mid % 4
            top_score = m + tl.sum(tl.where(lane == mid - gs, gumbel_of(gumbel_bits(gs, seed, position, 1)), 0.0))
    for g0 in range(a, voff + hi, BLOCK):
        gid = g0 + 4 * r + j
        loc = gid - voff
        msk = (loc >= lo) & (loc < hi)
        z = load_z(logits, sl, work, sw, row, loc, msk, invt, PROCESSED)
        allowed = msk & (okey(z) >= key_lo)
        zb = tl.max(tl.where(allowed, z, float("-inf")))
        go = (zb > float("-inf")) & (zb + bound >= top_score)
        if go:
            noise = tl.zeros([R, 4], tl.float32)
            if t != 0:
                bits = gumbel_bits(g0, seed, position, R)
                if SKIP:  # the logs only where the tile's largest z plus its largest noise can win
                    go = zb + noise_bound(tl.max(tl.where(allowed, bits, 0))) >= top_score
                if go:
                    noise = gumbel_of(bits)
            if go:
                score = tl.where(allowed, z + noise, float("-inf"))
                smax = tl.reduce(score, None, _max_keep_nan)  # NaN where an allowed score is (pack ranks it high)
                if (smax >= top_score) | (smax != smax):
                    pk = tl.where(allowed, pack(score, gid), SENTINEL)
                    bm = tl.max(pk)
                    sc = tl.max(tl.where(pk == bm, score, float("-inf")))
                    top_score = tl.where(bm > top, sc, top_score)
                    top = tl.maximum(top, bm)
    rawbits = tl.zeros((), tl.int64)
    if top != SENTINEL:
        raw = tl.load(logits + row * sl + (unpack_id(top) - voff)).to(tl.float32)
        rawbits = raw.to(tl.int32, bitcast=True).to(tl.int64)
    tl.store(best + (row * C + c) * 2, top)
    tl.store(best + (row * C + c) * 2 + 1, rawbits)


BITONIC = tl.constexpr(hasattr(tl, "topk"))  # Triton's bitonic top-k (3.3 on); before it, K extractions


@triton.jit
def _largest(keys, K: tl.constexpr):
    """The K (a power of two) largest of the int64 keys (a tile of any shape of at least K), descending, `[K]`:
    Triton's bitonic top-k (compare-and-swap rounds, no serial dependence on K), else K extractions of the max."""
    flat = tl.reshape(keys, [keys.numel])
    if BITONIC:
        out = tl.topk(flat, K)
    else:
        j = tl.arange(0, K)
        out = tl.full([K], SENTINEL, tl.int64)
        for n in range(K):
            t = tl.max(flat)
            flat = tl.where(flat == t, SENTINEL, flat)
            out = tl.where(j == n, t, out)
    return out


@triton.jit
def _group_key(v, i):
    """int32 group maxima v, group indices i -> int64 keys: larger maximum, then lower index, is larger (unique)."""
    return (v.to(tl.int64) << 32) + (4294967295 - i.to(tl.int64))


@triton.jit
def local_top(logits, sl, nmax, row, V, M, voff, NP2: tl.constexpr, GN: tl.constexpr, S: tl.constexpr,
              TB: tl.constexpr):
    """The NP2 largest pack(raw, global id) of this rank's shard of the row, descending, `[NP2]` (SENTINEL where
    the shard has fewer), from its M group maxima (`nmax`, stats). Three narrowings, each to the NP2 largest keys
    of a tile: the NS = TB / S super maxima (super group s: the group keys i = s mod NS; strided, which keeps
    Triton's layouts cheap) -> the S groups of each of the NP2 best super groups `[NP2, S]` -> the GN ids of each
    of the NP2 best groups `[NP2, GN]`. Exact: group keys are unique and order groups by their best element, then
    by lower index, as pack orders ids (groups are consecutive ids); a key outside the NP2 best groups (super
    groups) is beaten, in each of them, by their maximum (larger, or equal at a lower id), so it is not among the
    NP2 best."""
    NS: tl.constexpr = TB // S
    i = tl.arange(0, TB)
    gk = tl.where(i < M, _group_key(tl.load(nmax + row * M + i, mask=i < M, other=0), i), SENTINEL)
    sk = _largest(tl.max(tl.reshape(gk, [S, NS]), axis=0), NP2)
    gi = (unpack_id(sk) % NS)[:, None] + NS * tl.arange(0, S)[None, :]
    ok = (sk != SENTINEL)[:, None] & (gi < M)
    gk = _largest(tl.where(ok, _group_key(tl.load(nmax + row * M + gi, mask=ok, other=0), gi), SENTINEL), NP2)
    loc = unpack_id(gk)[:, None] * GN + tl.arange(0, GN)[None, :]
    ok = (gk != SENTINEL)[:, None] & (loc < V)
    raw = tl.load(logits + row * sl + loc, mask=ok, other=0.0).to(tl.float32)
    return _largest(tl.where(ok, pack(raw, loc + voff), SENTINEL), NP2)


@triton.jit(do_not_specialize=("M",))
def topn_kernel(logits, sl, nmax, cands, V, M, voff, N: tl.constexpr, NP2: tl.constexpr, GN: tl.constexpr,
                S: tl.constexpr, TB: tl.constexpr):
    """TP only, one program per row: this rank's top N packed raw keys (`local_top`) into `cands` `[B, NP2]`."""
    row = tl.program_id(0).to(tl.int64)
    tl.store(cands + row * NP2 + tl.arange(0, NP2), local_top(logits, sl, nmax, row, V, M, voff, NP2, GN, S, TB))


@triton.jit(do_not_specialize=("B", "C", "M"))
def finish_kernel(parts, cands, best, logits, sl, nmax, tokens, chosen, top_ids, top_lp, B, C, NT, V, M, voff,
                  N: tl.constexpr, NP2: tl.constexpr, GN: tl.constexpr, S: tl.constexpr, TB: tl.constexpr,
                  NPP2: tl.constexpr, NTP2: tl.constexpr, LOCAL: tl.constexpr):
    """One program per row: log-sum-exp, the winning chunk's token, the top N: `local_top` of the whole row
    (LOCAL, one rank), else the N largest of every rank's top N (`cands` `[NT, B, NP2]`, topn_kernel)."""
    row = tl.program_id(0).to(tl.int64)
    base, ok = row_chunks(row, B, C, NT, NPP2)
    mx = tl.load(parts + base * 4, mask=ok, other=float("-inf"))
    sm = tl.load(parts + base * 4 + 1, mask=ok, other=0.0)
    big = tl.max(mx)
    lse = big + tl.log(tl.sum(tl.where(mx > float("-inf"), sm * tl.exp(mx - big), 0.0)))
    bk = tl.load(best + base * 2, mask=ok, other=SENTINEL)
    bb = tl.max(bk)
    rawbits = tl.max(tl.where(bk == bb, tl.load(best + base * 2 + 1, mask=ok, other=0), -4294967296))
    tl.store(tokens + row, tl.where(bb == SENTINEL, 0, unpack_id(bb)))
    tl.store(chosen + row, rawbits.to(tl.int32).to(tl.float32, bitcast=True) - lse)
    if N > 0:
        if LOCAL:
            top = local_top(logits, sl, nmax, row, V, M, voff, NP2, GN, S, TB)
        else:
            ii = tl.arange(0, NTP2 * NP2)
            top = _largest(tl.load(cands + ((ii // NP2) * B + row) * NP2 + ii % NP2, mask=ii < NT * NP2,
                                   other=SENTINEL), NP2)
        j = tl.arange(0, NP2)
        tl.store(top_ids + row * N + j, unpack_id(top), mask=j < N)
        tl.store(top_lp + row * N + j, unpack_value(top) - lse, mask=j < N)
