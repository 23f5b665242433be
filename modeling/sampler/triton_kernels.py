"""The sampler's Triton kernels. Grid `(B, C)`: program (row, c) owns chunk c (`CH` columns) of one row's
vocabulary shard; the per-row reductions between stages go through small buffers (per-chunk partials and
candidates, int64 histograms `[6, B, HS]`, per-row state `[6, B, 4]`), summed or gathered over TP ranks by the
launcher.

Every program of a stage re-derives the previous stage's per-row result from those buffers (a 2048-bin scan),
program c == 0 stores it for the stage after, so no stage needs a separate resolve launch. Top-k with
k <= KF: each chunk keeps its k largest z (a superset of its share of the row's k largest), one program per
row bisects the union for the k-th largest key (state 5). Larger k: radix select on the ordered key of z
(digits 11 / 11 / 10 bits; histograms 0-2 count, state 0-1 (prefix, remaining count)). Top-p: the same radix
on the key of z, each token weighted by its fixed-point mass q (histograms 3-5, slot 2048 of histogram 3 = the
row's total mass; state 2 key_lo, 3-4 (key_lo, prefix, remaining mass)).
"""
import triton
import triton.language as tl

from .triton_numerics import KEY_NEG_INF, SENTINEL, gumbel_tile, mass, okey, pack, plog, top_p_target, unpack_id, \
    unpack_value  # noqa: F401

HS = tl.constexpr(2056)  # histogram row stride; slot 2048 = total mass
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
def _find(hptr, NB: tl.constexpr, need):
    """Largest bin d with sum(h[d:]) >= need -> (d int64, need left inside bin d)."""
    ar = tl.arange(0, NB)
    h = tl.load(hptr + ar)
    suf = tl.sum(h) - tl.cumsum(h, 0) + h
    d = tl.max(tl.where(suf >= need, ar, 0))
    sel = tl.sum(tl.where(ar == d, suf - h, 0))
    return d.to(tl.int64), need - sel


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
def _key_lo(row, B, k, topk_on, sampled, log_min_p, m, st, hist, KF, HAS_TOPK: tl.constexpr,
            TOPK_LARGE: tl.constexpr):
    """Lowest allowed ordered key after top-k and min-p (always above -inf)."""
    key_lo = tl.full((), KEY_NEG_INF + 1, tl.int64)
    if HAS_TOPK:
        key_k = tl.load(st + (5 * B + row) * 4)
        if TOPK_LARGE:
            if k > KF:
                d, _r = _find(hist + (2 * B + row) * HS, 1024, tl.load(st + (1 * B + row) * 4 + 1))
                key_k = (tl.load(st + (1 * B + row) * 4) << 10) | d
        key_lo = tl.where(topk_on, tl.maximum(key_lo, key_k), key_lo)
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
def _merge_top(run, pk, n, NP2: tl.constexpr):
    """Keep the n (<= NP2) largest of run and pk (keys unique; run's unused entries SENTINEL + i, distinct).
    Only the keys of pk above run's n-th largest are inserted, one by one."""
    ar = tl.arange(0, NP2)
    used = ar < n
    floor = tl.min(tl.where(used, run, 9223372036854775807))
    cnt = tl.minimum(tl.sum((pk > floor).to(tl.int32)), n)
    for _ in range(cnt):
        t = tl.max(pk)
        pk = tl.where(pk == t, SENTINEL, pk)
        rmin = tl.min(tl.where(used, run, 9223372036854775807))
        run = tl.where(used & (run == rmin) & (t > rmin), t, run)
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
        pids = tl.load(li + lrow + OFF_PI + k, mask=k < MP, other=-1)
        cnt = tl.load(li + lrow + OFF_PC + k, mask=k < MP, other=0)
        ploc = pids - voff
        pok = (pids >= 0) & (ploc >= 0) & (ploc < V)
        y = tl.load(wrow + ploc, mask=pok, other=0.0)
        y = tl.where(y > 0, y * inv, y * rep)
        y = y - freq * cnt.to(tl.float32)
        y = y - pres * (cnt > 0).to(tl.float32)
        tl.store(wrow + ploc, y, mask=pok)


@triton.jit
def stats_kernel(logits, sl, work, sw, recf, reci, rs, parts, cands, kc, hist, B, V, CH, C, voff,
                 BLOCK: tl.constexpr, N: tl.constexpr, NP2: tl.constexpr, KF: tl.constexpr, FASTK: tl.constexpr,
                 PROCESSED: tl.constexpr, TOPK_LARGE: tl.constexpr):
    """Per chunk: raw max and sum of exp (log-softmax), max of z, top-N raw candidates, the k largest z of rows
    with top-k <= KF, top-k level-1 counts of rows with larger k."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    t = tl.load(recf + row * rs + F_T)
    invt = tl.load(recf + row * rs + F_INVT)
    k = tl.load(reci + row * rs + I_TOPK)
    topk_on = (t > 0) & (k > 0)
    rmax = float("-inf")
    rsum = 0.0
    zmax = float("-inf")
    hacc = tl.zeros([2048], tl.int32)
    run = tl.full([NP2], SENTINEL, tl.int64) + tl.arange(0, NP2)
    krun = tl.full([KF], SENTINEL, tl.int64) + tl.arange(0, KF)
    kn = tl.where(topk_on & (k <= KF), k, 0)
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
        if FASTK:
            krun = _merge_top(krun, tl.where(msk, pack(z, offs + voff), SENTINEL), kn, KF)
        if TOPK_LARGE:
            hacc += _hist((okey(z) >> 21).to(tl.int32), tl.where(topk_on & (k > KF), msk, False), 2048)
        if N > 0:
            run = _merge_top(run, tl.where(msk, pack(raw, offs + voff), SENTINEL), N, NP2)
    pbase = parts + (row * C + c) * 4
    tl.store(pbase, rmax)
    tl.store(pbase + 1, rsum)
    tl.store(pbase + 2, zmax)
    if TOPK_LARGE:
        ar = tl.arange(0, 2048)
        tl.atomic_add(hist + row * HS + ar, hacc.to(tl.int64), mask=hacc > 0)
    if N > 0:
        tl.store(cands + (row * C + c) * NP2 + tl.arange(0, NP2), run)
    if FASTK:
        tl.store(kc + (row * C + c) * KF + tl.arange(0, KF), krun)


@triton.jit
def topk_fast_kernel(recf, reci, rs, kc, st, B, C, NT, KF: tl.constexpr, CB: tl.constexpr):
    """One program per row with 0 < k <= KF: the k-th largest key of z over every chunk's k largest (bisection
    over the 32-bit key, counting candidates), into state 5."""
    row = tl.program_id(0).to(tl.int64)
    k = tl.load(reci + row * rs + I_TOPK)
    key_k = tl.zeros((), tl.int64)
    if (tl.load(recf + row * rs + F_T) > 0) & (k > 0) & (k <= KF):
        total = NT * C * KF
        per_rank = C * KF
        lo = tl.zeros((), tl.int64)
        hi = tl.full((), 4294967296, tl.int64)
        for _ in range(32):
            mid = lo + (hi - lo) // 2
            cnt = tl.zeros((), tl.int32)
            for s in range(0, total, CB):
                ii = s + tl.arange(0, CB)
                v = tl.load(kc + ((ii // per_rank) * B + row) * per_rank + ii % per_rank, mask=ii < total,
                            other=SENTINEL)
                real = v > SENTINEL + 4096
                cnt += tl.sum((real & (((v >> 32) + 2147483648) >= mid)).to(tl.int32))
            big = cnt >= k
            lo = tl.where(big, mid, lo)
            hi = tl.where(big, hi, mid)
        key_k = lo
    tl.store(st + (5 * B + row) * 4, key_k)


@triton.jit
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
        d, krem = _find(hist + (0 * B + row) * HS, 2048, k)
        prefix = d
        SHIFT_IN: tl.constexpr = 21
        SHIFT_D: tl.constexpr = 10
        DMASK: tl.constexpr = 2047
    else:
        p1 = tl.load(st + (0 * B + row) * 4)
        d, krem = _find(hist + (1 * B + row) * HS, 2048, tl.load(st + (0 * B + row) * 4 + 1))
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
def topp_level_kernel(logits, sl, work, sw, recf, reci, recq, rs, rsq, parts, st, hist, B, V, CH, C, NT, KF,
                      LEVEL: tl.constexpr, BLOCK: tl.constexpr, PROCESSED: tl.constexpr, HAS_TOPK: tl.constexpr,
                      TOPK_LARGE: tl.constexpr, NPP2: tl.constexpr):
    """Resolve the previous top-p digit (or, at LEVEL 1, key_lo), add the masses q of allowed tokens by digit
    LEVEL of their key (and, at LEVEL 1, their total)."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    t = tl.load(recf + row * rs + F_T)
    invt = tl.load(recf + row * rs + F_INVT)
    fixed = tl.load(recq + row * rsq + Q_TOPP)
    on = (t > 0) & (fixed > 0)
    m = _row_zmax(parts, row, B, C, NT, NPP2)
    if LEVEL == 1:
        k = tl.load(reci + row * rs + I_TOPK)
        key_lo = _key_lo(row, B, k, (t > 0) & (k > 0), t > 0, tl.load(recf + row * rs + F_LOGMINP), m, st, hist,
                         KF, HAS_TOPK, TOPK_LARGE)
        prefix = tl.full((), 0, tl.int64)
        need = tl.full((), 0, tl.int64)
        SHIFT_IN: tl.constexpr = 32
        SHIFT_D: tl.constexpr = 21
        DMASK: tl.constexpr = 2047
    elif LEVEL == 2:
        key_lo = tl.load(st + (2 * B + row) * 4)
        total = tl.load(hist + (3 * B + row) * HS + 2048)
        d, need = _find(hist + (3 * B + row) * HS, 2048, top_p_target(total, fixed))
        prefix = d
        SHIFT_IN: tl.constexpr = 21
        SHIFT_D: tl.constexpr = 10
        DMASK: tl.constexpr = 2047
    else:
        sp = st + (3 * B + row) * 4
        key_lo = tl.load(sp)
        d, need = _find(hist + (4 * B + row) * HS, 2048, tl.load(sp + 2))
        prefix = (tl.load(sp + 1) << 11) | d
        SHIFT_IN: tl.constexpr = 10
        SHIFT_D: tl.constexpr = 0
        DMASK: tl.constexpr = 1023
    if c == 0:
        sp = st + ((LEVEL + 1) * B + row) * 4
        tl.store(sp, key_lo)
        tl.store(sp + 1, prefix)
        tl.store(sp + 2, need)
    if on:
        hrow = hist + ((LEVEL + 2) * B + row) * HS
        total = tl.zeros((), tl.int64)
        lo = c * CH
        for s in range(0, CH, BLOCK):
            offs = lo + s + tl.arange(0, BLOCK)
            msk = offs < V
            z = _load_z(logits, sl, work, sw, row, offs, msk, invt, PROCESSED)
            key = okey(z)
            q = mass(z, m, msk & (key >= key_lo))
            tl.atomic_add(hrow + ((key >> SHIFT_D) & DMASK), q, mask=((key >> SHIFT_IN) == prefix) & (q > 0))
            if LEVEL == 1:
                total += tl.sum(q)
        if LEVEL == 1:
            tl.atomic_add(hrow + 2048, total)


@triton.jit
def sample_kernel(logits, sl, work, sw, recf, reci, recq, rs, rsq, parts, st, hist, best, B, V, CH, C, NT, voff, KF,
                  BLOCK: tl.constexpr, PROCESSED: tl.constexpr, HAS_TOPK: tl.constexpr, TOPK_LARGE: tl.constexpr,
                  HAS_TOPP: tl.constexpr, NPP2: tl.constexpr):
    """Per chunk: the allowed token maximising z + Gumbel noise (z alone for greedy rows), lowest id on ties.
    Tiles of `[BLOCK / 4, 4]` ids aligned to 4 globally: one Philox call serves 4 ids."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    t = tl.load(recf + row * rs + F_T)
    invt = tl.load(recf + row * rs + F_INVT)
    seed = tl.load(recq + row * rsq + Q_SEED)
    position = tl.load(recq + row * rsq + Q_POS)
    if HAS_TOPP:
        sp = st + (4 * B + row) * 4
        key_lo = tl.load(sp)
        d, _n = _find(hist + (5 * B + row) * HS, 1024, tl.load(sp + 2))
        on_p = (t > 0) & (tl.load(recq + row * rsq + Q_TOPP) > 0)
        key_lo = tl.where(on_p, tl.maximum(key_lo, (tl.load(sp + 1) << 10) | d), key_lo)
    else:
        k = tl.load(reci + row * rs + I_TOPK)
        m = _row_zmax(parts, row, B, C, NT, NPP2)
        key_lo = _key_lo(row, B, k, (t > 0) & (k > 0), t > 0, tl.load(recf + row * rs + F_LOGMINP), m, st, hist,
                         KF, HAS_TOPK, TOPK_LARGE)
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
