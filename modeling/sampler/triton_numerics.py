"""`numerics.py` in Triton, op for op (same constants, same order of fp32 adds and multiplies). The kernels that
call these are launched with `enable_fp_fusion=False`, so no multiply-add is contracted into an FMA and every
device (and the CPU interpreter) rounds exactly as the torch reference does."""
import triton
import triton.language as tl

SENTINEL = tl.constexpr(-9223372036854775807)
KEY_NEG_INF = tl.constexpr(8388607)


@triton.jit
def philox(c0, c1, c2, c3, k0, k1):
    """Philox4x32-10 on uint32 tensors of one shape (the rounds of `triton.language.random`)."""
    for _ in tl.static_range(10):
        a0 = c0
        a2 = c2
        c0 = tl.umulhi(a2, 0xCD9E8D57) ^ c1 ^ k0
        c2 = tl.umulhi(a0, 0xD2511F53) ^ c3 ^ k1
        c1 = a2 * 0xCD9E8D57
        c3 = a0 * 0xD2511F53
        k0 = k0 + 0x9E3779B9
        k1 = k1 + 0xBB67AE85
    return c0, c1, c2, c3


@triton.jit
def plog(x):
    """Natural log of fp32 x > 0 (normal), Cephes logf."""
    bits = x.to(tl.int32, bitcast=True)
    e = (bits >> 23) - 126
    m = ((bits & 0x007FFFFF) | 0x3F000000).to(tl.float32, bitcast=True)
    small = m < 0.70710678118654752440
    e = e - small.to(tl.int32)
    f = tl.where(small, m + m, m) - 1.0
    z = f * f
    y = f * 7.0376836292e-2 + -1.1514610310e-1
    y = y * f + 1.1676998740e-1
    y = y * f + -1.2420140846e-1
    y = y * f + 1.4249322787e-1
    y = y * f + -1.6668057665e-1
    y = y * f + 2.0000714765e-1
    y = y * f + -2.4999993993e-1
    y = y * f + 3.3333331174e-1
    y = y * f
    y = y * z
    ef = e.to(tl.float32)
    y = y + ef * -2.12194440e-4
    y = y + z * -0.5
    r = f + y
    return r + ef * 0.693359375


@triton.jit
def pexp(x):
    """exp of fp32 x in [-87, 0], Cephes expf."""
    n = tl.floor(x * 1.44269504088896341 + 0.5)
    xr = x - n * 0.693359375
    xr = xr - n * -2.12194440e-4
    z = xr * xr
    y = xr * 1.9875691500e-4 + 1.3981999507e-3
    y = y * xr + 8.3334519073e-3
    y = y * xr + 4.1665795894e-2
    y = y * xr + 1.6666665459e-1
    y = y * xr + 5.0000001201e-1
    y = y * z + xr
    y = y + 1.0
    scale = ((n.to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True)
    return y * scale


@triton.jit
def okey(x):
    """fp32 -> int64 order-preserving key in [0, 2^32), -0.0 -> key of +0.0."""
    b = x.to(tl.int32, bitcast=True)
    b = tl.where((b & 0x7FFFFFFF) == 0, 0, b)
    s = b ^ ((b >> 31) & 0x7FFFFFFF)
    return s.to(tl.int64) + 2147483648


@triton.jit
def pack(score, gid):
    """fp32 score, int64 global id -> int64 key: larger score, then lower id, is larger."""
    s = okey(score) - 2147483648
    return (s << 32) + (4294967295 - gid.to(tl.int64))


@triton.jit
def unpack_id(p):
    return 4294967295 - (p & 4294967295)


@triton.jit
def unpack_value(p):
    s = (p >> 32).to(tl.int32)
    return (s ^ ((s >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def mass(z, m, allowed):
    """Fixed-point probability int64: floor(pexp(z - m) * 2^32) <= 2^32 - 1, 0 where not allowed or z - m < -23."""
    d = z - m
    ok = allowed & (d >= -23.0)
    dc = tl.minimum(tl.maximum(d, -23.0), 0.0)
    e = tl.where(ok, pexp(dc), 0.0)
    e = tl.minimum(e, 1.0)
    q = (e * 4294967296.0).to(tl.int64)
    return tl.minimum(q, 4294967295)


@triton.jit
def mass_sum(z, m, allowed):
    """int64: the sum of `mass(z, m, allowed)` over a 1-D block of at most 2^15 tokens, bit for bit, with int32
    work per token: q = hi 2^16 + lo, hi = floor(e 2^16) and lo = floor((e 2^16 - hi) 2^16) (both exact in fp32:
    scaling by powers of two, and Sterbenz's lemma for the subtraction)."""
    d = z - m
    ok = allowed & (d >= -23.0)
    dc = tl.minimum(tl.maximum(d, -23.0), 0.0)
    e = tl.minimum(tl.where(ok, pexp(dc), 0.0), 1.0)
    s = e * 65536.0
    sf = tl.floor(s)
    top = e >= 1.0  # mass caps q at 2^32 - 1
    hi = tl.where(top, 65535, sf.to(tl.int32))
    lo = tl.where(top, 65535, ((s - sf) * 65536.0).to(tl.int32))
    return tl.sum(hi).to(tl.int64) * 65536 + tl.sum(lo).to(tl.int64)


NOISE_MAX = tl.constexpr(16.65)  # above the largest Gumbel noise, 24 ln 2 = 16.6355


@triton.jit
def noise_bound(bits):
    """An upper bound of `gumbel_of(bits)`, non-decreasing in bits, from integer work: -log(-log u) <=
    -log(1 - u) = ln 2 (24 - log2 n) for n = 2^24 (1 - u) = 2^24 - 2 bits - 1 >= 1, with floor(log2 n) read from
    n's exponent as fp32 (exact below 2^24); plus 0.01 for the logs' rounding (tests/unit/
    test_sampler_gumbel_bound.py checks every value)."""
    n = (16777215 - 2 * bits).to(tl.float32)
    e = (n.to(tl.int32, bitcast=True) >> 23) - 127
    return (24 - e).to(tl.float32) * 0.6931471805599453 + 0.01


@triton.jit
def gumbel_bits(g0, seed, position, R: tl.constexpr):
    """The 23 random bits int32 `[R, 4]` (u = (2 bits + 1) 2^-24) of global ids g0 + 4 r + j (g0 a multiple of
    4); seed, position int64. One Philox call serves 4 ids."""
    ctr = ((g0 >> 2) + tl.arange(0, R)).to(tl.uint32)
    zero = ctr * 0
    p_lo = zero + (position & 0xFFFFFFFF).to(tl.uint32)
    p_hi = zero + ((position >> 32) & 0xFFFFFFFF).to(tl.uint32)
    s_lo = zero + (seed & 0xFFFFFFFF).to(tl.uint32)
    s_hi = zero + ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    w0, w1, w2, w3 = philox(ctr, p_lo, p_hi, zero, s_lo, s_hi)
    j = tl.arange(0, 4)[None, :]
    w = tl.where(j == 0, w0[:, None], tl.where(j == 1, w1[:, None], tl.where(j == 2, w2[:, None], w3[:, None])))
    return (w >> 9).to(tl.int32)


@triton.jit
def gumbel_of(bits):
    """fp32 Gumbel noise of `gumbel_bits` (any shape, or a scalar): -log(-log(u)), `numerics.gumbel`'s rounding."""
    u = (bits * 2 + 1).to(tl.float32) * 5.9604644775390625e-08
    return -plog(-plog(u))


@triton.jit
def top_p_target(total, fixed):
    """ceil(total * fixed / 2^24) in int64 without overflow (total < 2^50)."""
    hi = total >> 24
    lo = total & 16777215
    return fixed * hi + ((fixed * lo + 16777215) >> 24)
