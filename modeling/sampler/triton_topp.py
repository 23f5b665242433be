"""The sampler's Triton top-p: the largest key of z whose tokens at or above it hold the target share of the
fixed-point mass q (`triton_numerics.mass`) of the allowed tokens, exactly (the torch path's `radix_select`).

Two ways, both exact, per row:

  from candidates  `topp_cand_kernel`, one program per row, after the top-k candidate passes
                   (`triton_select`): the candidates are every token above tau (tau: the KP-th largest group
                   maximum, or the top-k row's own), so when their mass reaches the target (and none
                   overflowed the buffer) the threshold lies among them, and a bisection over their keys finds
                   it. Top-k rows (k <= KF) always resolve this way: their allowed tokens are the candidates
                   and (ties) the tokens at tau, which the candidate pass counts. Rows whose mass is spread
                   wider than the candidates, whose candidates overflowed, or with k > KF are left to
  the radix        `topp_level_kernel`, levels 1-3: radix select on the key of z, each token weighted by q
                   (one int64 atomic per token and digit), passes over the whole row that skip resolved rows.

Buffers (launcher: `triton_sampler.py`): state 5 slot 2 int64 `[B]`, the threshold found from candidates (0:
none, the radix's rows); histograms 3-5 of `[6, B, HS]` (slot 2048 of 3 = the row's total mass) and state 2
(key_lo), 3-4 (key_lo, prefix, remaining mass), which `sample_kernel` resolves its last digit from.
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
    find_bin,
    load_z,
    lowest_key,
    row_zmax,
)


@triton.jit
def z_of_key(key):
    """int64 ordered key in [0, 2^32) -> the fp32 z whose `okey` it is (+0.0 for the key of -0.0)."""
    s = (key - 2147483648).to(tl.int32)
    return (s ^ ((s >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def cand_key(cand, at, ok):
    """Candidates at `cand + at` (int32 keys - 2^31, loaded where `ok`) -> their int64 keys in [0, 2^32)."""
    return tl.load(cand + at, mask=ok, other=0).to(tl.int64) + 2147483648


@triton.jit
def cand_key_mass(cand, at, ok, m, key_lo):
    """`cand_key` and the candidates' masses q (0 where not `ok` or below `key_lo`)."""
    key = cand_key(cand, at, ok)
    return key, mass(z_of_key(key), m, ok & (key >= key_lo))


@triton.jit
def resolved_threshold(st, B, row):
    """The row's threshold found from candidates (state 5 slot 2), 0 when the radix levels find it."""
    return tl.load(st + (5 * B + row) * 4 + 2)


@triton.jit(do_not_specialize=("B", "C"))
def topp_cand_kernel(recf, reci, recq, rs, rsq, parts, st, hist, cand, ccount, tmass, qbuf, B, C, NT, KF, CAP,
                     CB: tl.constexpr, HAS_TOPK: tl.constexpr, TOPK_LARGE: tl.constexpr, NPP2: tl.constexpr):
    """One program per row: the top-p threshold from the candidates (int32 keys - 2^31 `[NT, B, CAP]` and counts
    `[NT, B]`, every rank's; `tmass` int64 `[2, B]` summed over ranks: the total mass of rows without top-k, the
    tokens at tau of top-k rows) into state 5 slot 2, or 0 where they cannot hold it (rows without top-k whose
    candidates hold less than the target or overflowed CAP on some rank; k > KF). `qbuf` int64 `[B, NT * CAP]`:
    the candidates' masses."""
    row = tl.program_id(0).to(tl.int64)
    t = tl.load(recf + row * rs + F_T)
    fixed = tl.load(recq + row * rsq + Q_TOPP)
    k = tl.load(reci + row * rs + I_TOPK)
    res = tl.zeros((), tl.int64)
    if (t > 0) & (fixed > 0) & (k <= KF):
        m = row_zmax(parts, row, B, C, NT, NPP2)
        key_lo = lowest_key(row, B, k, k > 0, t > 0, tl.load(recf + row * rs + F_LOGMINP), m, st, hist, KF,
                            HAS_TOPK, TOPK_LARGE)
        tau = tl.load(st + (5 * B + row) * 4 + 1)
        cmass = tl.zeros((), tl.int64)
        whole = tl.full((), 1, tl.int1)  # no rank's candidates overflowed CAP (top-p rows without top-k may)
        qrow = qbuf + row * (NT * CAP)
        for r in range(NT):
            nr = tl.load(ccount + r * B + row)
            whole = whole & (nr <= CAP)
            nr = tl.minimum(nr, CAP)
            for s in range(0, nr, CB):
                ii = s + tl.arange(0, CB)
                ok = ii < nr
                _key, q = cand_key_mass(cand, (r * B + row) * CAP + ii, ok, m, key_lo)
                tl.store(qrow + r * CAP + ii, q, mask=ok)
                cmass += tl.sum(q)
        # top-k rows: the allowed tokens are the candidates and, when key_lo = key_k = tau (fewer than k
        # candidates), the tokens at tau
        key_tau = tau + 2147483648
        at_tau = tl.where(key_lo <= key_tau, tl.load(tmass + B + row), 0)
        total = tl.where(k > 0, cmass + at_tau * mass(z_of_key(key_tau), m, at_tau > 0), tl.load(tmass + row))
        target = top_p_target(total, fixed)
        if (k > 0) & (cmass < target):  # S(tau) = total >= target > S(tau + 1) = cmass
            res = key_tau
        if whole & (cmass >= target):
            lo = tl.maximum(key_lo, key_tau + 1)  # S(lo) = cmass >= target; S(2^32) = 0 < target
            hi = tl.full((), 4294967296, tl.int64)
            n0 = tl.minimum(tl.load(ccount + row), CAP)
            if (NT == 1) & (n0 <= CB):  # one block of candidates: the bisection in registers
                ii = tl.arange(0, CB)
                key, q = cand_key_mass(cand, row * CAP + ii, ii < n0, m, key_lo)  # the gather loop's one block
                for _ in range(32):  # the largest K with S(K) = sum of q over candidates with key >= K >= target
                    mid = lo + (hi - lo) // 2
                    big = tl.sum(tl.where(key >= mid, q, 0)) >= target
                    lo = tl.where(big, mid, lo)
                    hi = tl.where(big, hi, mid)
            else:
                tl.debug_barrier()  # qbuf's stores before any thread of the program reads them
                for _ in range(32):
                    mid = lo + (hi - lo) // 2
                    acc = tl.zeros((), tl.int64)
                    for r in range(NT):
                        nr = tl.minimum(tl.load(ccount + r * B + row), CAP)
                        for s in range(0, nr, CB):
                            ii = s + tl.arange(0, CB)
                            ok = ii < nr
                            key = cand_key(cand, (r * B + row) * CAP + ii, ok)
                            q = tl.load(qrow + r * CAP + ii, mask=ok, other=0)
                            acc += tl.sum(tl.where(key >= mid, q, 0))
                    big = acc >= target
                    lo = tl.where(big, mid, lo)
                    hi = tl.where(big, hi, mid)
            res = lo
    tl.store(st + (5 * B + row) * 4 + 2, res)


@triton.jit(do_not_specialize=("B", "C"))
def topp_level_kernel(logits, sl, work, sw, recf, reci, recq, rs, rsq, parts, st, hist, B, V, CH, C, NT, KF,
                      LEVEL: tl.constexpr, BLOCK: tl.constexpr, PROCESSED: tl.constexpr, HAS_TOPK: tl.constexpr,
                      TOPK_LARGE: tl.constexpr, NPP2: tl.constexpr):
    """Rows the candidates did not resolve: resolve the previous top-p digit (or, at LEVEL 1, key_lo), add the
    masses q of allowed tokens by digit LEVEL of their key (and, at LEVEL 1, their total). Other rows' programs
    return at once (the sample pass reads this state only for the rows it serves)."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    t = tl.load(recf + row * rs + F_T)
    fixed = tl.load(recq + row * rsq + Q_TOPP)
    if (t > 0) & (fixed > 0) & (resolved_threshold(st, B, row) == 0):
        invt = tl.load(recf + row * rs + F_INVT)
        m = row_zmax(parts, row, B, C, NT, NPP2)
        if LEVEL == 1:
            k = tl.load(reci + row * rs + I_TOPK)
            key_lo = lowest_key(row, B, k, k > 0, t > 0, tl.load(recf + row * rs + F_LOGMINP), m, st, hist, KF,
                                HAS_TOPK, TOPK_LARGE)
            prefix = tl.full((), 0, tl.int64)
            need = tl.full((), 0, tl.int64)
            SHIFT_IN: tl.constexpr = 32
            SHIFT_D: tl.constexpr = 21
            DMASK: tl.constexpr = 2047
        elif LEVEL == 2:
            key_lo = tl.load(st + (2 * B + row) * 4)
            total = tl.load(hist + (3 * B + row) * HS + 2048)
            d, need = find_bin(hist + (3 * B + row) * HS, 2048, top_p_target(total, fixed))
            prefix = d
            SHIFT_IN: tl.constexpr = 21
            SHIFT_D: tl.constexpr = 10
            DMASK: tl.constexpr = 2047
        else:
            sp = st + (3 * B + row) * 4
            key_lo = tl.load(sp)
            d, need = find_bin(hist + (4 * B + row) * HS, 2048, tl.load(sp + 2))
            prefix = (tl.load(sp + 1) << 11) | d
            SHIFT_IN: tl.constexpr = 10
            SHIFT_D: tl.constexpr = 0
            DMASK: tl.constexpr = 1023
        if c == 0:
            sp = st + ((LEVEL + 1) * B + row) * 4
            tl.store(sp, key_lo)
            tl.store(sp + 1, prefix)
            tl.store(sp + 2, need)
        hrow = hist + ((LEVEL + 2) * B + row) * HS
        total = tl.zeros((), tl.int64)
        lo = c * CH
        for s in range(0, CH, BLOCK):
            offs = lo + s + tl.arange(0, BLOCK)
            msk = offs < V
            z = load_z(logits, sl, work, sw, row, offs, msk, invt, PROCESSED)
            key = okey(z)
            q = mass(z, m, msk & (key >= key_lo))
            tl.atomic_add(hrow + ((key >> SHIFT_D) & DMASK), q, mask=((key >> SHIFT_IN) == prefix) & (q > 0))
            if LEVEL == 1:
                total += tl.sum(q)
        if LEVEL == 1:
            tl.atomic_add(hrow + 2048, total)
