"""The sampler's Triton top-k / top-p selection: the passes that find each row's lowest allowed key, and the
histogram helpers the other kernels (`triton_kernels.py`) read it back with; the scalar record's columns
(`modeling.sampler.params`) every kernel loads.

Buffers (allocated by the launcher, `triton_sampler.py`): int64 histograms `[7, B, HS]` and per-row state
`[7, B, 4]`, summed or gathered over TP ranks between passes. Every program of a pass re-derives the previous
pass's per-row result from those buffers (a 2048-bin scan), program c == 0 stores it for the pass after, so no
pass needs a separate resolve launch. Top-k with k <= KF: `stats_kernel` stores the maximum key of every group
of G consecutive ids; one program per row finds tau, the k-th largest of those maxima (state 5 slot 1); a pass
appends every key above tau to the row's candidates (at most (k - 1) * G of them, since fewer than k groups
reach above tau); one program per row bisects them for the k-th largest key (state 5 slot 0), or takes tau
when fewer than k lie above it. Larger k: radix select on the ordered key of z (digits 11 / 11 / 10 bits;
histograms 0-2 count, state 0-1 (prefix, remaining count)). Top-p: the largest key whose tokens above it hold the
target share of the fixed-point mass q. A pass first counts the tokens with q > 0 by their bin of z - m on a grid
of 1/64 (`mass_bin`; histogram 6, slot 2048 = the row's total mass). Within a bin q varies by at most e^(1/64), so
bounds on the bins' masses (`mass_band`) narrow the threshold to a band of bins; the band's tokens alone then go
through the radix on the key of z, weighted by q (histograms 3-5; slot 2048 of histogram 3 = the exact mass above
the band; state 6 key_lo, 2 (key_lo, first and last band bin, target), 3-4 (key_lo, prefix, remaining mass)). So
the weighted radix adds one atomic per band token, not per token, and hot bins no longer serialise the whole row.
"""
import triton
import triton.language as tl

from .triton_numerics import KEY_NEG_INF, mass, okey, top_p_target

HS = tl.constexpr(2056)  # histogram row stride; slot 2048 = a mass sum (see above)
MASS_BINS = tl.constexpr(64)  # top-p: bins of z - m per unit
# scalar record columns (modeling.sampler.params)
F_T = tl.constexpr(0)
F_INVT = tl.constexpr(1)
F_LOGMINP = tl.constexpr(4)
F_PRES = tl.constexpr(5)
F_FREQ = tl.constexpr(6)
F_REP = tl.constexpr(7)
F_INVREP = tl.constexpr(8)
I_TOPK = tl.constexpr(9)
Q_SEED = tl.constexpr(5)
Q_POS = tl.constexpr(6)
Q_TOPP = tl.constexpr(7)


@triton.jit
def find_bin(hptr, NB: tl.constexpr, need):
    """Largest bin d with sum(h[d:]) >= need -> (d int64, need left inside bin d)."""
    ar = tl.arange(0, NB)
    h = tl.load(hptr + ar)
    suf = tl.sum(h) - tl.cumsum(h, 0) + h
    d = tl.max(tl.where(suf >= need, ar, 0))
    sel = tl.sum(tl.where(ar == d, suf - h, 0))
    return d.to(tl.int64), need - sel


@triton.jit
def digit_hist(digits, mask, NB: tl.constexpr):
    """Counts int32 `[NB]` of the int32 digits where mask (masked ones are counted in bin 0, then taken off)."""
    h = tl.histogram(tl.where(mask, digits, 0), NB)
    return h - tl.where(tl.arange(0, NB) == 0, tl.sum((mask == 0).to(tl.int32)), 0)


@triton.jit
def mass_bin(d):
    """Bin int32 of d = z - m <= 0: floor(-d * 64), at most 2047 (tokens with q > 0 lie in bins 0..1472)."""
    return tl.minimum(d * -64.0, 2047.0).to(tl.int32)


@triton.jit
def mass_band(counts, target):
    """(first, last) int32: the bins of z - m that can hold the top-p threshold token, from the counts int64
    `[2048]` of tokens with q > 0 per `mass_bin`. A token of bin j has -d in [j/64, (j+1)/64), so its q lies within
    [q_lo(j), q_hi(j)] (the exact exp of the edges, widened by 2^-12 for pexp's and these exps' roundings, and by 2
    units). The cumulative upper bound first reaches the target at `first`, so the tokens of bins < first hold less
    than it; the cumulative lower bound reaches it at `last`, so the threshold lies at or above bin last."""
    j = tl.arange(0, 2048)
    n = tl.load(counts + j)
    e_hi = tl.exp(j.to(tl.float32) * (-1.0 / 64.0)) * 1.000244140625
    e_lo = tl.exp((j + 1).to(tl.float32) * (-1.0 / 64.0)) * 0.999755859375
    q_hi = tl.minimum((e_hi * 4294967296.0).to(tl.int64) + 2, 4294967295)
    q_lo = tl.maximum((e_lo * 4294967296.0).to(tl.int64) - 2, 0)
    first = tl.min(tl.where(tl.cumsum(n * q_hi, 0) >= target, j, 2047))
    last = tl.min(tl.where(tl.cumsum(n * q_lo, 0) >= target, j, 2047))
    return first, last


@triton.jit
def row_zmax(parts, row, B, C, NT, NPP2: tl.constexpr):
    """Max of the processed, tempered logits over every chunk of every rank (partials `[NT, B, C, 4]`)."""
    i = tl.arange(0, NPP2)
    ok = i < NT * C
    base = ((i // C) * B + row) * C + i % C
    return tl.max(tl.load(parts + base * 4 + 2, mask=ok, other=float("-inf")))


@triton.jit
def lowest_key(row, B, k, topk_on, sampled, log_min_p, m, st, hist, KF, HAS_TOPK: tl.constexpr,
            TOPK_LARGE: tl.constexpr):
    """Lowest allowed ordered key after top-k and min-p (always above -inf)."""
    key_lo = tl.full((), KEY_NEG_INF + 1, tl.int64)
    if HAS_TOPK:
        key_k = tl.load(st + (5 * B + row) * 4)
        if TOPK_LARGE:
            if k > KF:
                d, _r = find_bin(hist + (2 * B + row) * HS, 1024, tl.load(st + (1 * B + row) * 4 + 1))
                key_k = (tl.load(st + (1 * B + row) * 4) << 10) | d
        key_lo = tl.where(topk_on, tl.maximum(key_lo, key_k), key_lo)
    minp_on = sampled & (log_min_p > float("-inf"))
    return tl.where(minp_on, tl.maximum(key_lo, okey(m + log_min_p)), key_lo)


@triton.jit
def load_z(logits, sl, work, sw, row, offs, msk, invt, PROCESSED: tl.constexpr):
    if PROCESSED:
        x = tl.load(work + row * sw + offs, mask=msk, other=float("-inf"))
    else:
        x = tl.load(logits + row * sl + offs, mask=msk, other=float("-inf")).to(tl.float32)
    return x * invt


@triton.jit(do_not_specialize=("B", "M"))
def topk_tau_kernel(recf, reci, rs, gmax, st, B, M, NT, KF, TB: tl.constexpr):
    """One program per row with 0 < k <= KF: tau, the k-th largest of the row's group maxima (int32 keys
    `[NT, B, M]`, every rank's; -2^31 when fewer than k groups), into state 5 slot 1. Fewer than k groups have a
    maximum above tau, so at most (k - 1) * G tokens lie above it, and at least k at or above it."""
    row = tl.program_id(0).to(tl.int64)
    k = tl.load(reci + row * rs + I_TOPK)
    tau = tl.full((), -2147483648, tl.int64)
    if (tl.load(recf + row * rs + F_T) > 0) & (k > 0) & (k <= KF):
        i = tl.arange(0, TB)
        v = tl.load(gmax + ((i // M) * B + row) * M + i % M, mask=i < NT * M, other=-2147483648)
        lo = tl.full((), -2147483648, tl.int64)
        hi = tl.full((), 2147483648, tl.int64)
        for _ in range(32):  # the largest x with count(v >= x) >= k
            mid = lo + (hi - lo) // 2
            big = tl.sum((v.to(tl.int64) >= mid).to(tl.int32)) >= k
            lo = tl.where(big, mid, lo)
            hi = tl.where(big, hi, mid)
        tau = lo
    tl.store(st + (5 * B + row) * 4 + 1, tau)


@triton.jit(do_not_specialize=("B",))
def topk_compact_kernel(logits, sl, work, sw, recf, reci, rs, st, cand, ccount, B, V, CH, KF, CAP,
                        BLOCK: tl.constexpr, PROCESSED: tl.constexpr):
    """Rows with 0 < k <= KF: append the int32 key of every z above tau to the row's candidates `[B, CAP]`
    (order arbitrary; the count `[B]` by one atomic per block that has any)."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    k = tl.load(reci + row * rs + I_TOPK)
    if (tl.load(recf + row * rs + F_T) > 0) & (k > 0) & (k <= KF):
        invt = tl.load(recf + row * rs + F_INVT)
        tau = tl.load(st + (5 * B + row) * 4 + 1)
        lo = c * CH
        for s in range(0, CH, BLOCK):
            offs = lo + s + tl.arange(0, BLOCK)
            msk = offs < V
            key = okey(load_z(logits, sl, work, sw, row, offs, msk, invt, PROCESSED)) - 2147483648
            sel = msk & (key > tau)
            n = tl.sum(sel.to(tl.int32))
            if n > 0:
                pos = tl.atomic_add(ccount + row, n) + tl.cumsum(sel.to(tl.int32), 0) - 1
                tl.store(cand + row * CAP + pos, key.to(tl.int32), mask=sel & (pos < CAP))


@triton.jit(do_not_specialize=("B",))
def topk_select_kernel(recf, reci, rs, st, cand, ccount, B, NT, KF, CAP, CB: tl.constexpr):
    """One program per row with 0 < k <= KF: the k-th largest key of z, into state 5: bisection over the
    candidates above tau (every rank's, `[NT, B, CAP]`) when there are at least k of them, else tau itself."""
    row = tl.program_id(0).to(tl.int64)
    k = tl.load(reci + row * rs + I_TOPK)
    key_k = tl.zeros((), tl.int64)
    if (tl.load(recf + row * rs + F_T) > 0) & (k > 0) & (k <= KF):
        res = tl.load(st + (5 * B + row) * 4 + 1)
        total = tl.zeros((), tl.int32)
        for r in range(NT):
            total += tl.minimum(tl.load(ccount + r * B + row), CAP)
        if total >= k:
            lo = res + 1
            hi = tl.full((), 2147483648, tl.int64)
            for _ in range(32):
                mid = lo + (hi - lo) // 2
                cnt = tl.zeros((), tl.int32)
                for r in range(NT):
                    nr = tl.minimum(tl.load(ccount + r * B + row), CAP)
                    base = cand + (r * B + row) * CAP
                    for s in range(0, nr, CB):
                        ii = s + tl.arange(0, CB)
                        v = tl.load(base + ii, mask=ii < nr, other=-2147483648)
                        cnt += tl.sum((v.to(tl.int64) >= mid).to(tl.int32))
                big = cnt >= k
                lo = tl.where(big, mid, lo)
                hi = tl.where(big, hi, mid)
            res = lo
        key_k = res + 2147483648
    tl.store(st + (5 * B + row) * 4, key_k)


@triton.jit(do_not_specialize=("B",))
def topk_level_kernel(logits, sl, work, sw, recf, reci, rs, st, hist, B, V, CH, KF, LEVEL: tl.constexpr,
                      BLOCK: tl.constexpr, PROCESSED: tl.constexpr):
    """Rows with k > KF: resolve top-k digit LEVEL-1, count keys inside it by digit LEVEL."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    t = tl.load(recf + row * rs + F_T)
    invt = tl.load(recf + row * rs + F_INVT)
    k = tl.load(reci + row * rs + I_TOPK).to(tl.int64)
    on = (t > 0) & (k > KF)
    if LEVEL == 2:
        d, krem = find_bin(hist + (0 * B + row) * HS, 2048, k)
        prefix = d
        SHIFT_IN: tl.constexpr = 21
        SHIFT_D: tl.constexpr = 10
        DMASK: tl.constexpr = 2047
    else:
        p1 = tl.load(st + (0 * B + row) * 4)
        d, krem = find_bin(hist + (1 * B + row) * HS, 2048, tl.load(st + (0 * B + row) * 4 + 1))
        prefix = (p1 << 11) | d
        SHIFT_IN: tl.constexpr = 10
        SHIFT_D: tl.constexpr = 0
        DMASK: tl.constexpr = 1023
    if c == 0:
        tl.store(st + ((LEVEL - 2) * B + row) * 4, prefix)
        tl.store(st + ((LEVEL - 2) * B + row) * 4 + 1, krem)
    if on:
        hacc = tl.zeros([2048], tl.int32)
        lo = c * CH
        for s in range(0, CH, BLOCK):
            offs = lo + s + tl.arange(0, BLOCK)
            msk = offs < V
            key = okey(load_z(logits, sl, work, sw, row, offs, msk, invt, PROCESSED))
            inb = msk & ((key >> SHIFT_IN) == prefix)
            hacc += digit_hist(((key >> SHIFT_D) & DMASK).to(tl.int32), inb, 2048)
        ar = tl.arange(0, 2048)
        tl.atomic_add(hist + ((LEVEL - 1) * B + row) * HS + ar, hacc.to(tl.int64), mask=hacc > 0)


@triton.jit(do_not_specialize=("B", "C"))
def topp_bins_kernel(logits, sl, work, sw, recf, reci, recq, rs, rsq, parts, st, hist, B, V, CH, C, NT, KF,
                     BLOCK: tl.constexpr, PROCESSED: tl.constexpr, HAS_TOPK: tl.constexpr, TOPK_LARGE: tl.constexpr,
                     NPP2: tl.constexpr):
    """Top-p rows: count the allowed tokens with q > 0 by `mass_bin` (histogram 6) and add their total mass (its
    slot 2048): one atomic per touched bin and program. Program 0 of the row stores key_lo (state 6)."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    t = tl.load(recf + row * rs + F_T)
    invt = tl.load(recf + row * rs + F_INVT)
    on = (t > 0) & (tl.load(recq + row * rsq + Q_TOPP) > 0)
    m = row_zmax(parts, row, B, C, NT, NPP2)
    k = tl.load(reci + row * rs + I_TOPK)
    key_lo = lowest_key(row, B, k, (t > 0) & (k > 0), t > 0, tl.load(recf + row * rs + F_LOGMINP), m, st, hist, KF,
                        HAS_TOPK, TOPK_LARGE)
    if c == 0:
        tl.store(st + (6 * B + row) * 4, key_lo)
    if on:
        hacc = tl.zeros([2048], tl.int32)
        total = tl.zeros((), tl.int64)
        lo = c * CH
        for s in range(0, CH, BLOCK):
            offs = lo + s + tl.arange(0, BLOCK)
            msk = offs < V
            z = load_z(logits, sl, work, sw, row, offs, msk, invt, PROCESSED)
            q = mass(z, m, msk & (okey(z) >= key_lo))
            hacc += digit_hist(mass_bin(z - m), q > 0, 2048)
            total += tl.sum(q)
        hrow = hist + (6 * B + row) * HS
        tl.atomic_add(hrow + tl.arange(0, 2048), hacc.to(tl.int64), mask=hacc > 0)
        tl.atomic_add(hrow + 2048, total)


@triton.jit(do_not_specialize=("B", "C"))
def topp_level_kernel(logits, sl, work, sw, recf, reci, recq, rs, rsq, parts, st, hist, B, V, CH, C, NT, KF,
                      LEVEL: tl.constexpr, BLOCK: tl.constexpr, PROCESSED: tl.constexpr, NPP2: tl.constexpr):
    """Resolve the previous top-p digit (at LEVEL 1: the band of bins, `mass_band`), add the masses q of the band's
    tokens by digit LEVEL of their key (at LEVEL 1 also the exact mass of the tokens above the band)."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    t = tl.load(recf + row * rs + F_T)
    invt = tl.load(recf + row * rs + F_INVT)
    fixed = tl.load(recq + row * rsq + Q_TOPP)
    on = (t > 0) & (fixed > 0)
    m = row_zmax(parts, row, B, C, NT, NPP2)
    sp2 = st + (2 * B + row) * 4
    if LEVEL == 1:
        key_lo = tl.load(st + (6 * B + row) * 4)
        counts = hist + (6 * B + row) * HS
        target = top_p_target(tl.load(counts + 2048), fixed)
        first, last = mass_band(counts, target)
        prefix = tl.full((), 0, tl.int64)
        SHIFT_IN: tl.constexpr = 32
        SHIFT_D: tl.constexpr = 21
        DMASK: tl.constexpr = 2047
    elif LEVEL == 2:
        key_lo = tl.load(sp2)
        first = tl.load(sp2 + 1)
        last = tl.load(sp2 + 2)
        h1 = hist + (3 * B + row) * HS
        d, need = find_bin(h1, 2048, tl.load(sp2 + 3) - tl.load(h1 + 2048))
        prefix = d
        SHIFT_IN: tl.constexpr = 21
        SHIFT_D: tl.constexpr = 10
        DMASK: tl.constexpr = 2047
    else:
        sp = st + (3 * B + row) * 4
        key_lo = tl.load(sp)
        first = tl.load(sp2 + 1)
        last = tl.load(sp2 + 2)
        d, need = find_bin(hist + (4 * B + row) * HS, 2048, tl.load(sp + 2))
        prefix = (tl.load(sp + 1) << 11) | d
        SHIFT_IN: tl.constexpr = 10
        SHIFT_D: tl.constexpr = 0
        DMASK: tl.constexpr = 1023
    if c == 0:
        sp = st + ((LEVEL + 1) * B + row) * 4
        tl.store(sp, key_lo)
        if LEVEL == 1:
            tl.store(sp + 1, first)
            tl.store(sp + 2, last)
            tl.store(sp + 3, target)
        else:
            tl.store(sp + 1, prefix)
            tl.store(sp + 2, need)
    if on:
        hrow = hist + ((LEVEL + 2) * B + row) * HS
        above = tl.zeros((), tl.int64)
        lo = c * CH
        for s in range(0, CH, BLOCK):
            offs = lo + s + tl.arange(0, BLOCK)
            msk = offs < V
            z = load_z(logits, sl, work, sw, row, offs, msk, invt, PROCESSED)
            key = okey(z)
            q = mass(z, m, msk & (key >= key_lo))
            j = mass_bin(z - m)
            band = (q > 0) & (j >= first) & (j <= last)
            tl.atomic_add(hrow + ((key >> SHIFT_D) & DMASK), q, mask=band & ((key >> SHIFT_IN) == prefix))
            if LEVEL == 1:
                above += tl.sum(tl.where(j < first, q, 0))
        if LEVEL == 1:
            tl.atomic_add(hrow + 2048, above)
