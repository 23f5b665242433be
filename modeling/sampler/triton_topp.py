"""The sampler's Triton top-p passes: the largest key of z whose tokens at or above it hold the target share of
the fixed-point mass q (`triton_numerics.mass`) of the allowed tokens, exactly (the torch path's `radix_select`).

Radix select on the key weighted by q adds one int64 atomic per token and digit; the tokens of bf16 logits share
few keys, so those atomics serialise on a few addresses. The passes therefore narrow the threshold first, with
counts only (`tl.histogram` over 64 bins, then one atomic per touched bin and program):

  count 1  tokens with q > 0 by coarse bin a = floor(u), u = (m - z) * 2.75 (64 bins: q > 0 needs m - z <= 23),
           and their total mass (exact); key_lo (top-k / min-p) into state 6
  count 2  the band of coarse bins that can hold the threshold (`band`: q of a bin's tokens lies within bounds
           from its edges, so cumulative bounds bracket the crossing); that band's tokens by sub-bin s (64 equal
           parts of the band's range of u), and the exact masses above the band and in it
  level 1  the band of sub-bins that can hold it (the target less the mass above); the weighted radix digit 1
           (key >> 21) over that band's tokens alone, and the exact mass of every token above it
  level 2, 3  digits 2 (11 bits) and 3 (10 bits), over the same tokens

Buffers (launcher: `triton_sampler.py`): counts int64 `[2, B, CS]` (bins 0-63; row 0 slot 64 = the total mass,
row 1 slots 64, 65 = the mass above the coarse band and in it), histograms 3-5 of `[6, B, HS]` (slot 2048 of 3 =
the mass above the sub-bin band), state 6 (key_lo, first and last coarse bin, target), 2 (first and last
sub-bin), 3-4 (key_lo, prefix, remaining mass, which `sample_kernel` reads). A bin of u spans a factor
e^(1/2.75) of q, a sub-bin e^(width / 2.75); the bounds are widened by 2^-12 and 2 units for pexp's and these
exps' roundings. The band is only a filter: the threshold
is the radix's over the tokens it keeps, with the mass above it added, so it equals the unfiltered radix's.
"""
import triton
import triton.language as tl

from .triton_numerics import mass, okey, top_p_target
from .triton_select import (
    F_INVT,
    F_LOGMINP,
    F_T,
    HS,
    I_TOPK,
    Q_TOPP,
    digit_hist,
    find_bin,
    load_z,
    lowest_key,
    row_zmax,
)

CS = tl.constexpr(72)  # count row stride: 64 bins, slot 64 = a mass sum
U_SCALE = tl.constexpr(2.75)  # coarse bins of u per unit of m - z


@triton.jit
def bins_of(d, first, last):
    """d = z - m fp32 -> (coarse bin a, sub-bin s within the coarse band [first, last]) int32, each in 0..63."""
    u = d * -U_SCALE
    a = tl.minimum(u, 63.0).to(tl.int32)
    rate = 64.0 / (last - first + 1).to(tl.float32)
    s = tl.minimum(tl.maximum((u - first.to(tl.float32)) * rate, 0.0), 63.0).to(tl.int32)
    return a, s


@triton.jit
def band(counts, u0, width, target, total):
    """(first, last) int32 of the bins j = 0..63 (u in [u0 + j width, u0 + (j + 1) width)) that can hold the token
    where the mass summed from bin 0 reaches target, from the counts int64 `[64]` of tokens with q > 0 per bin and
    their exact total mass. A bin's mass lies within count * [q_lo, q_hi], so the mass of bins 0..j lies within
    [max(lower prefix, total - upper suffix), min(upper prefix, total - lower suffix)]: the upper bound first
    reaches target at `first` (so bins < first hold less), the lower bound at `last`."""
    j = tl.arange(0, 64)
    n = tl.load(counts + j)
    e_hi = tl.exp((u0 + j.to(tl.float32) * width) / -U_SCALE) * 1.000244140625
    e_lo = tl.exp((u0 + (j + 1).to(tl.float32) * width) / -U_SCALE) * 0.999755859375
    hi = n * tl.minimum((e_hi * 4294967296.0).to(tl.int64) + 2, 4294967295)
    lo = n * tl.maximum((e_lo * 4294967296.0).to(tl.int64) - 2, 0)
    hi_pre = tl.cumsum(hi, 0)
    lo_pre = tl.cumsum(lo, 0)
    upper = tl.minimum(hi_pre, total - (tl.sum(lo) - lo_pre))
    lower = tl.maximum(lo_pre, total - (tl.sum(hi) - hi_pre))
    first = tl.min(tl.where(upper >= target, j, 63))
    last = tl.min(tl.where(lower >= target, j, 63))
    return first, last


@triton.jit(do_not_specialize=("B", "C"))
def topp_count_kernel(logits, sl, work, sw, recf, reci, recq, rs, rsq, parts, st, hist, cnt, B, V, CH, C, NT, KF,
                      STAGE: tl.constexpr, BLOCK: tl.constexpr, PROCESSED: tl.constexpr, HAS_TOPK: tl.constexpr,
                      TOPK_LARGE: tl.constexpr, NPP2: tl.constexpr):
    """Count stage 1 or 2 of the top-p rows (see the module docstring) into counts row STAGE - 1."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    t = tl.load(recf + row * rs + F_T)
    invt = tl.load(recf + row * rs + F_INVT)
    fixed = tl.load(recq + row * rsq + Q_TOPP)
    on = (t > 0) & (fixed > 0)
    m = row_zmax(parts, row, B, C, NT, NPP2)
    sp = st + (6 * B + row) * 4
    if STAGE == 1:
        k = tl.load(reci + row * rs + I_TOPK)
        key_lo = lowest_key(row, B, k, (t > 0) & (k > 0), t > 0, tl.load(recf + row * rs + F_LOGMINP), m, st, hist,
                            KF, HAS_TOPK, TOPK_LARGE)
        first = tl.full((), 0, tl.int32)
        last = tl.full((), 63, tl.int32)
        if c == 0:
            tl.store(sp, key_lo)
    else:
        key_lo = tl.load(sp)
        total = tl.load(cnt + row * CS + 64)
        target = top_p_target(total, fixed)
        first, last = band(cnt + row * CS, 0.0, 1.0, target, total)
        if c == 0:
            tl.store(sp + 1, first)
            tl.store(sp + 2, last)
            tl.store(sp + 3, target)
    if on:
        hacc = tl.zeros([64], tl.int32)
        msum = tl.zeros((), tl.int64)
        bsum = tl.zeros((), tl.int64)
        lo = c * CH
        for s0 in range(0, CH, BLOCK):
            offs = lo + s0 + tl.arange(0, BLOCK)
            msk = offs < V
            z = load_z(logits, sl, work, sw, row, offs, msk, invt, PROCESSED)
            q = mass(z, m, msk & (okey(z) >= key_lo))
            a, s = bins_of(z - m, first, last)
            if STAGE == 1:
                hacc += digit_hist(a, q > 0, 64)
                msum += tl.sum(q)
            else:
                in1 = (a >= first) & (a <= last)
                hacc += digit_hist(s, (q > 0) & in1, 64)
                msum += tl.sum(tl.where(a < first, q, 0))
                bsum += tl.sum(tl.where(in1, q, 0))
        crow = cnt + ((STAGE - 1) * B + row) * CS
        tl.atomic_add(crow + tl.arange(0, 64), hacc.to(tl.int64), mask=hacc > 0)
        tl.atomic_add(crow + 64, msum)
        if STAGE == 2:
            tl.atomic_add(crow + 65, bsum)


@triton.jit(do_not_specialize=("B", "C"))
def topp_level_kernel(logits, sl, work, sw, recf, recq, rs, rsq, parts, st, hist, cnt, B, V, CH, C, NT,
                      LEVEL: tl.constexpr, BLOCK: tl.constexpr, PROCESSED: tl.constexpr, NPP2: tl.constexpr):
    """Resolve the previous top-p digit (at LEVEL 1: the band of sub-bins), add the masses q of the band's tokens
    by digit LEVEL of their key (at LEVEL 1 also the exact mass of the tokens above the band)."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    t = tl.load(recf + row * rs + F_T)
    invt = tl.load(recf + row * rs + F_INVT)
    on = (t > 0) & (tl.load(recq + row * rsq + Q_TOPP) > 0)
    m = row_zmax(parts, row, B, C, NT, NPP2)
    sp6 = st + (6 * B + row) * 4
    sp2 = st + (2 * B + row) * 4
    first = tl.load(sp6 + 1).to(tl.int32)
    last = tl.load(sp6 + 2).to(tl.int32)
    if LEVEL == 1:
        key_lo = tl.load(sp6)
        c1 = cnt + (B + row) * CS
        width = (last - first + 1).to(tl.float32) / 64.0
        f2, l2 = band(c1, first.to(tl.float32), width, tl.load(sp6 + 3) - tl.load(c1 + 64), tl.load(c1 + 65))
        prefix = tl.full((), 0, tl.int64)
        SHIFT_IN: tl.constexpr = 32
        SHIFT_D: tl.constexpr = 21
        DMASK: tl.constexpr = 2047
    elif LEVEL == 2:
        key_lo = tl.load(sp6)
        f2 = tl.load(sp2).to(tl.int32)
        l2 = tl.load(sp2 + 1).to(tl.int32)
        h1 = hist + (3 * B + row) * HS
        d, need = find_bin(h1, 2048, tl.load(sp6 + 3) - tl.load(h1 + 2048))
        prefix = d
        SHIFT_IN: tl.constexpr = 21
        SHIFT_D: tl.constexpr = 10
        DMASK: tl.constexpr = 2047
    else:
        sp = st + (3 * B + row) * 4
        key_lo = tl.load(sp)
        f2 = tl.load(sp2).to(tl.int32)
        l2 = tl.load(sp2 + 1).to(tl.int32)
        d, need = find_bin(hist + (4 * B + row) * HS, 2048, tl.load(sp + 2))
        prefix = (tl.load(sp + 1) << 11) | d
        SHIFT_IN: tl.constexpr = 10
        SHIFT_D: tl.constexpr = 0
        DMASK: tl.constexpr = 1023
    if c == 0:
        if LEVEL == 1:
            tl.store(sp2, f2)
            tl.store(sp2 + 1, l2)
        else:
            sp = st + ((LEVEL + 1) * B + row) * 4
            tl.store(sp, key_lo)
            tl.store(sp + 1, prefix)
            tl.store(sp + 2, need)
    if on:
        hrow = hist + ((LEVEL + 2) * B + row) * HS
        above = tl.zeros((), tl.int64)
        lo = c * CH
        for s0 in range(0, CH, BLOCK):
            offs = lo + s0 + tl.arange(0, BLOCK)
            msk = offs < V
            z = load_z(logits, sl, work, sw, row, offs, msk, invt, PROCESSED)
            key = okey(z)
            q = mass(z, m, msk & (key >= key_lo))
            a, s = bins_of(z - m, first, last)
            in1 = (a >= first) & (a <= last)
            keep = (q > 0) & in1 & (s >= f2) & (s <= l2) & ((key >> SHIFT_IN) == prefix)
            tl.atomic_add(hrow + ((key >> SHIFT_D) & DMASK), q, mask=keep)
            if LEVEL == 1:
                above += tl.sum(tl.where((a < first) | (in1 & (s < f2)), q, 0))
        if LEVEL == 1:
            tl.atomic_add(hrow + 2048, above)
