"""The sampler's bit-exact numerics in torch (CPU or CUDA tensors). `triton_numerics.py` is the same, op for op.

Everything a token depends on is computed from IEEE fp32 adds and multiplies (no division, no FMA: the
Triton kernels are compiled with `enable_fp_fusion=False`), integer ops and exact conversions, so the
torch reference and the kernels agree bitwise on every device:

- noise: Philox4x32-10 (Salmon et al. 2011; the constants and round of `triton.language.random`), counter
  `(i >> 2, position_lo, position_hi, 0)`, key `(seed_lo, seed_hi)`, word `i & 3` for global token id `i`;
  `u = (2 * (word >> 9) + 1) * 2^-24` in [2^-24, 1 - 2^-24]; Gumbel `g = -plog(-plog(u))`.
- `plog` / `pexp`: Cephes `logf` / `expf` (~1 ulp) from adds, multiplies and exponent bit tricks.
- `ordered_key`: fp32 -> int64 in [0, 2^32), order-preserving, -0.0 mapped to +0.0.
- `mass`: fixed-point probability floor(pexp(z - m) * 2^32) clamped to 2^32 - 1 (0 below z - m < -23).
- `pack`: (ordered score key, lowest index first) -> one int64, so a max is an argmax with lowest-index ties.
"""
from __future__ import annotations

import numpy as np
import torch

M32 = 0xFFFFFFFF
ROUND_A, ROUND_B = 0xD2511F53, 0xCD9E8D57
KEY_A, KEY_B = 0x9E3779B9, 0xBB67AE85
PHILOX_ROUNDS = 10
SENTINEL = -(2 ** 63) + 1  # "nothing allowed" in packed keys: below every finite score
KEY_NEG_INF = 8388607  # ordered_key(-inf)
MASS_CUT = -23.0  # below this z - m the fixed-point mass is 0 (e^-23 < 2^-32)
MASS_ONE = 4294967296.0  # 2^32
MASS_MAX = (1 << 32) - 1

# fp32-exact constants (Cephes), shared with the Triton numerics
_c = lambda x: float(np.float32(x))  # noqa: E731
LOG_P = tuple(_c(v) for v in (7.0376836292e-2, -1.1514610310e-1, 1.1676998740e-1, -1.2420140846e-1,
                              1.4249322787e-1, -1.6668057665e-1, 2.0000714765e-1, -2.4999993993e-1,
                              3.3333331174e-1))
EXP_P = tuple(_c(v) for v in (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2,
                              1.6666665459e-1, 5.0000001201e-1))
SQRTHF = _c(0.70710678118654752440)
LOG2EF = _c(1.44269504088896341)
C1 = 0.693359375
C2 = _c(-2.12194440e-4)
TWO_M24 = 5.9604644775390625e-08


def _mulhilo(a: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) 32-bit words of the 64-bit product of the constant `a` and x int64 in [0, 2^32)."""
    ah, al = a >> 16, a & 0xFFFF
    t_hi = x * ah  # < 2^48
    t_lo = x * al
    hi = (t_hi + (t_lo >> 16)) >> 16
    lo = (((t_hi & 0xFFFF) << 16) + t_lo) & M32
    return hi, lo


def philox4x32(c0: torch.Tensor, c1: torch.Tensor, c2: torch.Tensor, c3: torch.Tensor, k0: torch.Tensor,
               k1: torch.Tensor, rounds: int = PHILOX_ROUNDS) -> tuple[torch.Tensor, ...]:
    """Philox4x32 on int64 tensors holding uint32 values (broadcasting) -> four int64 tensors in [0, 2^32)."""
    for _ in range(rounds):
        hi_b, lo_b = _mulhilo(ROUND_B, c2)
        hi_a, lo_a = _mulhilo(ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0 = (k0 + KEY_A) & M32
        k1 = (k1 + KEY_B) & M32
    return c0, c1, c2, c3


def random_words(seed: torch.Tensor, position: torch.Tensor, start: int, width: int) -> torch.Tensor:
    """seed, position int64 `[B]` -> int64 `[B, width]` uint32 words for global token ids start .. start+width-1."""
    lo_c, hi_c = start >> 2, (start + width - 1) >> 2
    ctr = torch.arange(lo_c, hi_c + 1, dtype=torch.int64, device=seed.device).unsqueeze(0)
    s, p = seed.to(torch.int64).unsqueeze(1), position.to(torch.int64).unsqueeze(1)
    k0, k1 = s & M32, (s >> 32) & M32
    out = philox4x32(ctr, p & M32, (p >> 32) & M32, torch.zeros_like(ctr), k0, k1)
    words = torch.stack(torch.broadcast_tensors(*out), dim=-1).flatten(1)  # [B, 4 * counters], id order
    off = start - 4 * lo_c
    return words[:, off: off + width]


def plog(x: torch.Tensor) -> torch.Tensor:
    """Natural log of fp32 x > 0 (normal numbers), Cephes logf."""
    bits = x.view(torch.int32)
    e = (bits >> 23) - 126
    m = ((bits & 0x007FFFFF) | 0x3F000000).view(torch.float32)
    small = m < SQRTHF
    e = e - small.to(torch.int32)
    f = torch.where(small, m + m, m) - 1.0
    z = f * f
    y = torch.full_like(f, LOG_P[0])
    for c in LOG_P[1:]:
        y = y * f + c
    y = y * f
    y = y * z
    ef = e.to(torch.float32)
    y = y + ef * C2
    y = y + z * -0.5
    r = f + y
    return r + ef * C1


def pexp(x: torch.Tensor) -> torch.Tensor:
    """exp of fp32 x in [-87, 0] (the sampler passes [-23, 0]), Cephes expf."""
    n = torch.floor(x * LOG2EF + 0.5)
    xr = x - n * C1
    xr = xr - n * C2
    z = xr * xr
    y = torch.full_like(x, EXP_P[0])
    for c in EXP_P[1:]:
        y = y * xr + c
    y = y * z + xr
    y = y + 1.0
    scale = ((n.to(torch.int32) + 127) << 23).view(torch.float32)
    return y * scale


def uniform_from_words(words: torch.Tensor) -> torch.Tensor:
    """int64 uint32 words -> fp32 in [2^-24, 1 - 2^-24] (23 random bits, exact)."""
    return ((words >> 9) * 2 + 1).to(torch.float32) * TWO_M24


def gumbel(seed: torch.Tensor, position: torch.Tensor, start: int, width: int) -> torch.Tensor:
    """fp32 `[B, width]` Gumbel noise of global token ids start .. start+width-1 for each row's (seed, position)."""
    u = uniform_from_words(random_words(seed, position, start, width))
    return -plog(-plog(u))


def ordered_key(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> int64 in [0, 2^32) with a < b <=> key(a) < key(b) (not NaN; -0.0 and +0.0 share a key)."""
    b = x.contiguous().view(torch.int32)
    b = torch.where((b & 0x7FFFFFFF) == 0, torch.zeros_like(b), b)
    s = b ^ ((b >> 31) & 0x7FFFFFFF)
    return s.to(torch.int64) + 2147483648


def key_to_float(key: torch.Tensor) -> torch.Tensor:
    """Inverse of `ordered_key` (int64 keys -> fp32)."""
    s = (key - 2147483648).to(torch.int32)
    return (s ^ ((s >> 31) & 0x7FFFFFFF)).view(torch.float32)


def mass(z: torch.Tensor, m: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Fixed-point probability mass int64 `[B, V]` of z fp32 `[B, V]` relative to the row max m `[B]`."""
    d = z - m.unsqueeze(1)
    ok = allowed & (d >= MASS_CUT)
    e = torch.where(ok, pexp(torch.clamp(d, MASS_CUT, 0.0)), torch.zeros_like(d))
    e = torch.clamp(e, max=1.0)
    return torch.clamp((e * MASS_ONE).to(torch.int64), max=MASS_MAX)


def pack(score: torch.Tensor, gid: torch.Tensor) -> torch.Tensor:
    """Packed int64 argmax key of fp32 scores and their global ids (higher score, then lower id, is larger)."""
    s = ordered_key(score) - 2147483648
    return (s << 32) + (M32 - gid)


def unpack_id(packed: torch.Tensor) -> torch.Tensor:
    return M32 - (packed & M32)


def unpack_value(packed: torch.Tensor) -> torch.Tensor:
    return key_to_float((packed >> 32) + 2147483648)


def top_p_target(total: torch.Tensor, top_p_fixed: torch.Tensor) -> torch.Tensor:
    """ceil(total * top_p_fixed / 2^24) exactly in int64 (total < 2^50, top_p_fixed <= 2^24)."""
    hi, lo = total >> 24, total & ((1 << 24) - 1)
    return top_p_fixed * hi + ((top_p_fixed * lo + (1 << 24) - 1) >> 24)
