"""The sampler's Triton top-k selection: the passes that find each row's lowest allowed key, and the histogram
helpers the other kernels (`triton_kernels.py`, `triton_topp.py`) read it back with; the scalar record's columns
(`modeling.sampler.params`) every kernel loads.

Buffers (allocated by the launcher, `triton_sampler.py`): int64 histograms `[6, B, HS]` and per-row state
`[6, B, 4]`, summed or gathered over TP ranks between passes. Every program of a pass re-derives the previous
pass's per-row result from those buffers (a 2048-bin scan), program c == 0 stores it for the pass after, so no
pass needs a separate resolve launch. Top-k with k <= KF: `stats_kernel` stores the maximum key of every group
of G consecutive ids; one program per row finds tau, the k-th largest of those maxima (state 5 slot 1); a pass
appends every key above tau to the row's candidates (at most (k - 1) * G of them, since fewer than k groups
reach above tau); one program per row bisects them for the k-th largest key (state 5 slot 0), or takes tau
when fewer than k lie above it. Top-p rows without top-k gather candidates the same way with k = KP
(`cand_k`), and the same pass adds up their total mass (`tmass`), for `triton_topp.topp_cand_kernel`. Larger k: radix
select on the ordered key of z (digits 11 / 11 / 10 bits; histograms 0-2 count, state 0-1 (prefix, remaining
count)). Top-p (`triton_topp.py`) uses histograms 3-5, state 2-4 and state 5 slot 2, and the helpers here.
"""
import triton
import triton.language as tl

from .triton_numerics import KEY_NEG_INF, mass_sum, okey

HS = tl.constexpr(2056)  # histogram row stride; slot 2048 = a mass sum (top-p, `triton_topp.py`)
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
def row_chunks(row, B, C, NT, NPP2: tl.constexpr):
    """(the row's entries of the per-chunk partials `[NT, B, C, ...]` over every rank, `[NPP2]`, and which are
    real: NPP2 >= NT * C)."""
    i = tl.arange(0, NPP2)
    return ((i // C) * B + row) * C + i % C, i < NT * C


@triton.jit
def row_zmax(parts, row, B, C, NT, NPP2: tl.constexpr):
    """Max of the processed, tempered logits over every chunk of every rank (partials `[NT, B, C, 4]`)."""
    base, ok = row_chunks(row, B, C, NT, NPP2)
    return tl.max(tl.load(parts + base * 4 + 2, mask=ok, other=float("-inf")))


@triton.jit
def row_zmax_id(parts, row, B, C, NT, NPP2: tl.constexpr):
    """(max z of the row, the global id int32 of a token holding it) from the partials `[NT, B, C, 4]`."""
    base, ok = row_chunks(row, B, C, NT, NPP2)
    zm = tl.load(parts + base * 4 + 2, mask=ok, other=float("-inf"))
    m = tl.max(zm)
    ids = tl.load(parts + base * 4 + 3, mask=ok, other=0.0).to(tl.int32, bitcast=True)
    return m, tl.max(tl.where(ok & (zm == m), ids, -1))


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


@triton.jit
def cand_k(recf, reci, recq, rs, rsq, row, KF, KP, TOPP: tl.constexpr):
    """How many of a row's largest group maxima its candidates must hold (0: the row gathers none): k for a
    sampled row with top-k 0 < k <= KF; KP for a sampled top-p row without top-k (TOPP: the variant has top-p
    rows; their candidates may overflow the buffer, which `topp_cand_kernel` detects)."""
    k = tl.load(reci + row * rs + I_TOPK)
    kc = tl.where((k > 0) & (k <= KF), k, 0)
    if TOPP:
        kc = tl.where((k == 0) & (tl.load(recq + row * rsq + Q_TOPP) > 0), KP, kc)
    return tl.where(tl.load(recf + row * rs + F_T) > 0, kc, 0)


@triton.jit(do_not_specialize=("B", "M"))
def topk_tau_kernel(recf, reci, recq, rs, rsq, gmax, st, B, M, NT, KF, KP, TB: tl.constexpr, TOPP: tl.constexpr):
    """One program per row with k = `cand_k` > 0: tau, the k-th largest of the row's group maxima (int32 keys
    `[NT, B, M]`, every rank's; -2^31 when fewer than k groups), into state 5 slot 1. Fewer than k groups have a
    maximum above tau, so at most (k - 1) * G tokens lie above it, and at least k at or above it."""
    row = tl.program_id(0).to(tl.int64)
    k = cand_k(recf, reci, recq, rs, rsq, row, KF, KP, TOPP)
    tau = tl.full((), -2147483648, tl.int64)
    if k > 0:
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


@triton.jit(do_not_specialize=("B", "C"))
def topk_compact_kernel(logits, sl, work, sw, recf, reci, recq, rs, rsq, parts, st, cand, ccount, tmass, B, V, CH, C,
                        NT, KF, KP, CAP, BLOCK: tl.constexpr, PROCESSED: tl.constexpr, TOPP: tl.constexpr,
                        NPP2: tl.constexpr):
    """Rows with k = `cand_k` > 0: append the int32 key of every z above tau to the row's candidates `[B, CAP]`
    (order arbitrary; the count `[B]` by one atomic per block that has any). TOPP: rows without top-k also add
    the fixed-point mass of their allowed tokens (min-p) to `tmass[0]` (blocks whose largest z is over 24 below
    the row's maximum hold none: q needs z - m >= -23), top-k rows the number of their tokens at tau to
    `tmass[1]` (`tmass` int64 `[2, B]`, one atomic per program)."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    k = cand_k(recf, reci, recq, rs, rsq, row, KF, KP, TOPP)
    if k > 0:
        invt = tl.load(recf + row * rs + F_INVT)
        tau = tl.load(st + (5 * B + row) * 4 + 1)
        if TOPP:
            with_mass = tl.load(reci + row * rs + I_TOPK) == 0
            at_tau = tl.zeros((), tl.int64)
            m = row_zmax(parts, row, B, C, NT, NPP2)
            log_min_p = tl.load(recf + row * rs + F_LOGMINP)
            key_lo = tl.where(log_min_p > float("-inf"), okey(m + log_min_p), KEY_NEG_INF + 1)
            msum = tl.zeros((), tl.int64)
        lo = c * CH
        for s in range(0, CH, BLOCK):
            offs = lo + s + tl.arange(0, BLOCK)
            msk = offs < V
            z = load_z(logits, sl, work, sw, row, offs, msk, invt, PROCESSED)
            key = okey(z)
            sel = msk & (key - 2147483648 > tau)
            n = tl.sum(sel.to(tl.int32))
            if n > 0:
                pos = tl.atomic_add(ccount + row, n) + tl.cumsum(sel.to(tl.int32), 0) - 1
                tl.store(cand + row * CAP + pos, (key - 2147483648).to(tl.int32), mask=sel & (pos < CAP))
            if TOPP:
                if with_mass & (tl.max(z) >= m - 24.0):
                    msum += mass_sum(z, m, msk & (key >= key_lo))
                at_tau += tl.sum((msk & (key - 2147483648 == tau)).to(tl.int64))
        if TOPP:
            if with_mass:
                tl.atomic_add(tmass + row, msum)
            else:
                tl.atomic_add(tmass + B + row, at_tau)


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
