"""The sampler's Triton kernels. Grid `(B, C)`: program (row, c) owns chunk c (`CH` columns) of one row's
vocabulary shard; the per-row reductions between stages go through small buffers (per-chunk partials, int64
histograms `[6, B, HS]`, per-row state `[5, B, 4]`), summed or gathered over TP ranks by the launcher.

Every program of a stage re-derives the previous stage's per-row result from those buffers (a 2048-bin scan),
program c == 0 stores it for the stage after, so no stage needs a separate resolve launch. Histograms:
0-2 top-k counts of the ordered key of z (digits 11 / 11 / 10 bits); 3-5 top-p masses of the fixed-point mass
q (same digits), bin 0 never written (its mass is the parent's minus the rest; slot 2048 of histogram 3 holds
the row's total mass). State: 0-1 top-k (prefix, remaining count); 2 key_lo; 3-4 top-p (key_lo, prefix,
remaining mass, parent bin mass).
"""
import triton
import triton.language as tl

from .triton_numerics import KEY_NEG_INF, SENTINEL, gumbel_tile, mass, okey, pack, plog, top_p_target, unpack_id, \
    unpack_value  # noqa: F401

HS: tl.constexpr = 2056  # histogram row stride; slot 2048 = total mass
# scalar record columns (modeling.sampler.params)
F_T: tl.constexpr = 0
F_INVT: tl.constexpr = 1
F_LOGMINP: tl.constexpr = 4
F_PRES: tl.constexpr = 5
F_FREQ: tl.constexpr = 6
F_REP: tl.constexpr = 7
F_INVREP: tl.constexpr = 8
I_TOPK: tl.constexpr = 9
Q_SEED: tl.constexpr = 5
Q_POS: tl.constexpr = 6
Q_TOPP: tl.constexpr = 7


@triton.jit
def _find(hptr, NB: tl.constexpr, need, parent, IMPLICIT0: tl.constexpr):
    """Largest bin d with sum(h[d:]) >= need -> (d int64, need left inside bin d, mass of bin d)."""
    ar = tl.arange(0, NB)
    h = tl.load(hptr + ar)
    if IMPLICIT0:
        h = tl.where(ar == 0, parent - tl.sum(h), h)
    tot = tl.sum(h)
    suf = tot - tl.cumsum(h, 0) + h
    d = tl.max(tl.where(suf >= need, ar, 0))
    sel_suf = tl.sum(tl.where(ar == d, suf, 0))
    sel_h = tl.sum(tl.where(ar == d, h, 0))
    return d.to(tl.int64), need - (sel_suf - sel_h), sel_h


@triton.jit
def _hist(digits, mask, NB: tl.constexpr):
    """Counts int32 `[NB]` of the int32 digits where mask (masked ones are counted in bin 0, then taken off)."""
    h = tl.histogram(tl.where(mask, digits, 0), NB)
    return h - tl.where(tl.arange(0, NB) == 0, tl.sum((mask == 0).to(tl.int32)), 0)


@triton.jit
def _row_zmax(parts, row, B, C, NT, NPP2: tl.constexpr):
    """Max of the processed, tempered logits over every chunk of every rank (partials `[NT, B, C, 4]`)."""
    i = tl.arange(0, NPP2)
    ok = i < NT * C
    base = ((i // C) * B + row) * C + i % C
    return tl.max(tl.load(parts + base * 4 + 2, mask=ok, other=float("-inf")))


@triton.jit
def _key_lo(row, B, sampled, topk_on, log_min_p, m, st, hist, HAS_TOPK: tl.constexpr):
    """Lowest allowed ordered key after top-k and min-p (always above -inf)."""
    key_lo = tl.full((), KEY_NEG_INF + 1, tl.int64)
    if HAS_TOPK:
        prefix = tl.load(st + (1 * B + row) * 4)
        krem = tl.load(st + (1 * B + row) * 4 + 1)
        d, _r, _h = _find(hist + (2 * B + row) * HS, 1024, krem, 0, False)
        key_lo = tl.where(topk_on, tl.maximum(key_lo, (prefix << 10) | d), key_lo)
    minp_on = sampled & (log_min_p > float("-inf"))
    return tl.where(minp_on, tl.maximum(key_lo, okey(m + log_min_p)), key_lo)


@triton.jit
def _load_z(logits, sl, work, sw, row, offs, msk, invt, PROCESSED: tl.constexpr):
    if PROCESSED:
        x = tl.load(work + row * sw + offs, mask=msk, other=float("-inf"))
    else:
        x = tl.load(logits + row * sl + offs, mask=msk, other=float("-inf")).to(tl.float32)
    return x * invt


@triton.jit
def _merge_top(run, pk, N: tl.constexpr, NP2: tl.constexpr):
    """The N largest of run (`[NP2]`, N used) and pk (any shape), keys unique."""
    ar = tl.arange(0, NP2)
    floor = tl.min(tl.where(ar < N, run, 9223372036854775807))
    if tl.max(pk) > floor:
        new = tl.full([NP2], SENTINEL, tl.int64)
        for j in tl.static_range(N):
            t = tl.maximum(tl.max(pk), tl.max(run))
            new = tl.where(ar == j, t, new)
            pk = tl.where(pk == t, SENTINEL, pk)
            run = tl.where(run == t, SENTINEL, run)
        run = new
    return run


@triton.jit
def copy_kernel(logits, sl, work, sw, V, CH, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    lo = tl.program_id(1) * CH
    for s in range(0, CH, BLOCK):
        offs = lo + s + tl.arange(0, BLOCK)
        msk = offs < V
        tl.store(work + row * sw + offs, tl.load(logits + row * sl + offs, mask=msk).to(tl.float32), mask=msk)


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
        ids = tl.load(li + lrow + OFF_PI + k, mask=k < MP, other=-1)
        cnt = tl.load(li + lrow + OFF_PC + k, mask=k < MP, other=0)
        loc = ids - voff
        ok = (ids >= 0) & (loc >= 0) & (loc < V)
        x = tl.load(wrow + loc, mask=ok, other=0.0)
        x = tl.where(x > 0, x * inv, x * rep)
        x = x - freq * cnt.to(tl.float32)
        x = x - pres * (cnt > 0).to(tl.float32)
        tl.store(wrow + loc, x, mask=ok)


@triton.jit
def stats_kernel(logits, sl, work, sw, recf, reci, rs, parts, cands, hist, B, V, CH, C, voff,
                 BLOCK: tl.constexpr, N: tl.constexpr, NP2: tl.constexpr, PROCESSED: tl.constexpr,
                 TOPK: tl.constexpr):
    """Per chunk: raw max and sum of exp (log-softmax), max of z, top-N raw candidates, top-k level-1 counts."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    t = tl.load(recf + row * rs + F_T)
    invt = tl.load(recf + row * rs + F_INVT)
    topk_on = (t > 0) & (tl.load(reci + row * rs + I_TOPK) > 0)
    rmax = float("-inf")
    rsum = 0.0
    zmax = float("-inf")
    hacc = tl.zeros([2048], tl.int32)
    run = tl.full([NP2], SENTINEL, tl.int64)
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
        zmax = tl.maximum(zmax, tl.max(z))
        if TOPK:
            hacc += _hist((okey(z) >> 21).to(tl.int32), tl.where(topk_on, msk, False), 2048)
        if N > 0:
            run = _merge_top(run, tl.where(msk, pack(raw, offs + voff), SENTINEL), N, NP2)
    pbase = parts + (row * C + c) * 4
    tl.store(pbase, rmax)
    tl.store(pbase + 1, rsum)
    tl.store(pbase + 2, zmax)
    if TOPK:
        ar = tl.arange(0, 2048)
        tl.atomic_add(hist + row * HS + ar, hacc.to(tl.int64), mask=hacc > 0)
    if N > 0:
        tl.store(cands + (row * C + c) * NP2 + tl.arange(0, NP2), run)


@triton.jit
def topk_level_kernel(logits, sl, work, sw, recf, reci, rs, st, hist, B, V, CH, LEVEL: tl.constexpr,
                      BLOCK: tl.constexpr, PROCESSED: tl.constexpr):
    """Resolve top-k digit LEVEL-1, count keys inside it by digit LEVEL."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    t = tl.load(recf + row * rs + F_T)
    invt = tl.load(recf + row * rs + F_INVT)
    k = tl.load(reci + row * rs + I_TOPK).to(tl.int64)
    on = (t > 0) & (k > 0)
    if LEVEL == 2:
        d, krem, _h = _find(hist + (0 * B + row) * HS, 2048, k, 0, False)
        prefix = d
        SHIFT_IN: tl.constexpr = 21
        SHIFT_D: tl.constexpr = 10
        DMASK: tl.constexpr = 2047
    else:
        p1 = tl.load(st + (0 * B + row) * 4)
        d, krem, _h = _find(hist + (1 * B + row) * HS, 2048, tl.load(st + (0 * B + row) * 4 + 1), 0, False)
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
            key = okey(_load_z(logits, sl, work, sw, row, offs, msk, invt, PROCESSED))
            inb = msk & ((key >> SHIFT_IN) == prefix)
            hacc += _hist(((key >> SHIFT_D) & DMASK).to(tl.int32), inb, 2048)
        ar = tl.arange(0, 2048)
        tl.atomic_add(hist + ((LEVEL - 1) * B + row) * HS + ar, hacc.to(tl.int64), mask=hacc > 0)


@triton.jit
def topp_level_kernel(logits, sl, work, sw, recf, reci, recq, rs, rsq, parts, st, hist, B, V, CH, C, NT,
                      LEVEL: tl.constexpr, BLOCK: tl.constexpr, PROCESSED: tl.constexpr, HAS_TOPK: tl.constexpr,
                      NPP2: tl.constexpr):
    """Resolve the previous top-p digit (or, at LEVEL 1, key_lo and the total), add masses by digit LEVEL."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    t = tl.load(recf + row * rs + F_T)
    invt = tl.load(recf + row * rs + F_INVT)
    fixed = tl.load(recq + row * rsq + Q_TOPP)
    on = (t > 0) & (fixed > 0)
    m = _row_zmax(parts, row, B, C, NT, NPP2)
    if LEVEL == 1:
        topk_on = (t > 0) & (tl.load(reci + row * rs + I_TOPK) > 0)
        key_lo = _key_lo(row, B, t > 0, topk_on, tl.load(recf + row * rs + F_LOGMINP), m, st, hist, HAS_TOPK)
        prefix = tl.full((), 0, tl.int64)
        if c == 0:
            tl.store(st + (2 * B + row) * 4, key_lo)
        SHIFT_IN: tl.constexpr = 32
        SHIFT_D: tl.constexpr = 21
        DMASK: tl.constexpr = 2047
    elif LEVEL == 2:
        key_lo = tl.load(st + (2 * B + row) * 4)
        total = tl.load(hist + (3 * B + row) * HS + 2048)
        d, need, parent = _find(hist + (3 * B + row) * HS, 2048, top_p_target(total, fixed), total, True)
        prefix = d
        SHIFT_IN: tl.constexpr = 21
        SHIFT_D: tl.constexpr = 10
        DMASK: tl.constexpr = 2047
    else:
        sp = st + (3 * B + row) * 4
        key_lo = tl.load(sp)
        d, need, parent = _find(hist + (4 * B + row) * HS, 2048, tl.load(sp + 2), tl.load(sp + 3), True)
        prefix = (tl.load(sp + 1) << 11) | d
        SHIFT_IN: tl.constexpr = 10
        SHIFT_D: tl.constexpr = 0
        DMASK: tl.constexpr = 1023
    if LEVEL > 1:
        if c == 0:
            sp = st + ((LEVEL + 1) * B + row) * 4
            tl.store(sp, key_lo)
            tl.store(sp + 1, prefix)
            tl.store(sp + 2, need)
            tl.store(sp + 3, parent)
    if on:
        hrow = hist + ((LEVEL + 2) * B + row) * HS
        total = tl.zeros((), tl.int64)
        lo = c * CH
        for s in range(0, CH, BLOCK):
            offs = lo + s + tl.arange(0, BLOCK)
            msk = offs < V
            z = _load_z(logits, sl, work, sw, row, offs, msk, invt, PROCESSED)
            q = mass(z, m, msk & (okey(z) >= key_lo))
            dig = (q >> SHIFT_D) & DMASK
            tl.atomic_add(hrow + dig, q, mask=((q >> SHIFT_IN) == prefix) & (dig > 0))
            if LEVEL == 1:
                total += tl.sum(q)
        if LEVEL == 1:
            tl.atomic_add(hrow + 2048, total)


@triton.jit
def sample_kernel(logits, sl, work, sw, recf, reci, recq, rs, rsq, parts, st, hist, best, B, V, CH, C, NT, voff,
                  BLOCK: tl.constexpr, PROCESSED: tl.constexpr, HAS_TOPK: tl.constexpr, HAS_TOPP: tl.constexpr,
                  NPP2: tl.constexpr):
    """Per chunk: the allowed token maximising z + Gumbel noise (z alone for greedy rows), lowest id on ties.
    Tiles of `[BLOCK / 4, 4]` ids aligned to 4 globally: one Philox call serves 4 ids."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    t = tl.load(recf + row * rs + F_T)
    invt = tl.load(recf + row * rs + F_INVT)
    seed = tl.load(recq + row * rsq + Q_SEED)
    position = tl.load(recq + row * rsq + Q_POS)
    m = _row_zmax(parts, row, B, C, NT, NPP2)
    if HAS_TOPP:
        sp = st + (4 * B + row) * 4
        key_lo = tl.load(sp)
        d, _n, _h = _find(hist + (5 * B + row) * HS, 1024, tl.load(sp + 2), tl.load(sp + 3), True)
        on_p = (t > 0) & (tl.load(recq + row * rsq + Q_TOPP) > 0)
        q_t = tl.where(on_p, (tl.load(sp + 1) << 10) | d, 0)
    else:
        topk_on = (t > 0) & (tl.load(reci + row * rs + I_TOPK) > 0)
        key_lo = _key_lo(row, B, t > 0, topk_on, tl.load(recf + row * rs + F_LOGMINP), m, st, hist, HAS_TOPK)
        q_t = 0
    greedy = t == 0
    bound = tl.where(greedy, 0.0, 17.0)  # > the largest noise value, 16.7
    lo = c * CH
    hi = tl.minimum(lo + CH, V)
    g_lo = voff + lo
    a = g_lo - g_lo % 4
    R: tl.constexpr = BLOCK // 4
    r = tl.arange(0, R)[:, None]
    j = tl.arange(0, 4)[None, :]
    top = tl.full((), SENTINEL, tl.int64)
    top_score = float("-inf")
    for g0 in range(a, voff + hi, BLOCK):
        gid = g0 + 4 * r + j
        loc = gid - voff
        msk = (loc >= lo) & (loc < hi)
        z = _load_z(logits, sl, work, sw, row, loc, msk, invt, PROCESSED)
        allowed = msk & (okey(z) >= key_lo)
        if HAS_TOPP:
            allowed = allowed & (mass(z, m, allowed) >= q_t)
        zb = tl.max(tl.where(allowed, z, float("-inf")))
        if (zb > float("-inf")) & (zb + bound >= top_score):
            if greedy:
                score = z
            else:
                score = z + gumbel_tile(g0, seed, position, R)
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


@triton.jit
def finish_kernel(parts, cands, best, tokens, chosen, top_ids, top_lp, B, C, NT, N: tl.constexpr,
                  NP2: tl.constexpr, NPP2: tl.constexpr, CB: tl.constexpr):
    """One program per row: log-sum-exp, the winning chunk's token, the top-N candidates over chunks and ranks."""
    row = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, NPP2)
    ok = i < NT * C
    base = ((i // C) * B + row) * C + i % C
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
        total = NT * C * NP2
        per_rank = C * NP2
        prev = tl.full((), 9223372036854775807, tl.int64)
        for jn in tl.static_range(N):
            cur = tl.full((), SENTINEL, tl.int64)
            for s in range(0, total, CB):
                ii = s + tl.arange(0, CB)
                v = tl.load(cands + ((ii // per_rank) * B + row) * per_rank + ii % per_rank, mask=ii < total,
                            other=SENTINEL)
                cur = tl.maximum(cur, tl.max(tl.where(v < prev, v, SENTINEL)))
            prev = cur
            tl.store(top_ids + row * N + jn, unpack_id(cur))
            tl.store(top_lp + row * N + jn, unpack_value(cur) - lse)
