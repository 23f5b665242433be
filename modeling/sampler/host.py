"""Host-side sampling parameters: per-row Python values -> validated numpy arrays (no torch).

`HostBatch` holds one step's parameters as numpy arrays of `n` rows, in the dtypes the device block stores
(`modeling.sampler.params.SamplerParams`). `HostBatch.from_rows` builds it from `RowSpec`s; constructing a
`HostBatch` from arrays validates them too. Every range error is a `SamplerParamError` naming the row and the
field. Request validation proper lives in `engine/`; this is the last check before values reach the device.

Derived fields the kernels read instead of dividing or taking logs on the device (so every device computes
the same bits): `inv_temperature` = fp32(1 / T) (1 for greedy rows), `inv_repetition` = fp32(1 / r),
`log_min_p` = fp32(log(min_p)) (-inf = off), `top_p_fixed` = round(top_p * 2^24) (0 = off).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Mapping, Optional, Sequence

import numpy as np

from .allow_bits import allow_bits_error

TEMPERATURE_EPS = 1e-5  # below it a row is greedy (vLLM's _SAMPLING_EPS)
TOP_P_ONE = 1 << 24  # top_p fixed point: round(top_p * 2^24)
TOP_K_FAST = 128  # top-k up to this k takes the per-chunk candidate path on the device
LOGPROB_CLASSES = (5, 20)  # top-N the kernels compute: the smallest class >= N asked for, cut to N after
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for one bias value


class SamplerParamError(ValueError):
    """A sampling parameter out of range; the message names the row and the field."""


@dataclass(frozen=True)
class RowSpec:
    """One row's sampling parameters as the driver knows them.

    temperature 0 = greedy; top_k 0 or -1 = off (k >= vocab is off too); top_p 1 = off; min_p 0 = off; seed:
    always set (the driver picks one for unseeded requests), any int in [-2^63, 2^64); position: index of the
    token being sampled (prompt length + tokens generated so far). Penalties follow vLLM: repetition_penalty
    over prompt + output tokens, presence / frequency over output tokens only. `banned_ids`: token ids that
    must not be drawn this step (e.g. EOS while fewer than min_tokens were generated).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0
    position: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Optional[Mapping[int, float]] = None
    banned_ids: Sequence[int] = ()
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()


@dataclass(frozen=True)
class SamplerVariant:
    """Which optional stages a captured sampler launches. A graph captured for a variant serves every batch
    whose `HostBatch.variant()` it `covers`; rows that do not use a stage pass through it unchanged.

    processed: logit bias, banned ids or penalties (an fp32 copy of the logits is patched first);
    top_k: top-k with k <= TOP_K_FAST (per-chunk candidates); large_top_k: larger k too (a 3-level radix
    select); top_p: the 3-level radix select weighted by fixed-point probability mass."""

    processed: bool = False
    top_k: bool = False
    top_p: bool = False
    large_top_k: bool = False

    def __post_init__(self) -> None:
        if self.large_top_k and not self.top_k:
            raise SamplerParamError("SamplerVariant: large_top_k needs top_k")

    def covers(self, other: "SamplerVariant") -> bool:
        return all(getattr(self, f.name) or not getattr(other, f.name) for f in fields(self))

    @classmethod
    def full(cls) -> "SamplerVariant":
        return cls(True, True, True, True)


_VARIANTS: dict[tuple[bool, bool, bool, bool], SamplerVariant] = {}


def _variant(processed: bool, top_k: bool, top_p: bool, large_top_k: bool) -> SamplerVariant:
    """`SamplerVariant(processed, top_k, top_p, large_top_k)`, one shared (frozen) instance per combination."""
    key = (processed, top_k, top_p, large_top_k)
    v = _VARIANTS.get(key)
    if v is None:
        v = _VARIANTS[key] = SamplerVariant(*key)
    return v


def _f32(x: float) -> np.float32:
    return np.float32(x)


@dataclass
class HostBatch:
    """One step's parameters for `n` rows (numpy). Shapes: scalars `[n]`; lists `[n, W]` with -1 = unused id.

    fp32: temperature, inv_temperature, top_p, min_p, log_min_p, presence, frequency, repetition,
    inv_repetition, bias_vals; int32: top_k, bias_ids, ban_ids, pen_ids (unique per row), pen_counts (output
    occurrences; 0 = prompt only); int64: seed, position, top_p_fixed. allow_bits: None, or int32 `[n, W]`
    (W = ceil(vocab_size / 32): id j may be drawn when bit j & 31 of word j >> 5 is set; a mask makes the batch
    `processed`; may view the caller's buffer, read only when staged). Validated on construction."""

    temperature: np.ndarray
    inv_temperature: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray
    top_p_fixed: np.ndarray
    min_p: np.ndarray
    log_min_p: np.ndarray
    seed: np.ndarray
    position: np.ndarray
    presence: np.ndarray
    frequency: np.ndarray
    repetition: np.ndarray
    inv_repetition: np.ndarray
    bias_ids: np.ndarray
    bias_vals: np.ndarray
    ban_ids: np.ndarray
    pen_ids: np.ndarray
    pen_counts: np.ndarray
    vocab_size: int = field(default=0)
    allow_bits: Optional[np.ndarray] = field(default=None)

    SCALARS = {"temperature": np.float32, "inv_temperature": np.float32, "top_k": np.int32, "top_p": np.float32,
               "top_p_fixed": np.int64, "min_p": np.float32, "log_min_p": np.float32, "seed": np.int64,
               "position": np.int64, "presence": np.float32, "frequency": np.float32, "repetition": np.float32,
               "inv_repetition": np.float32}
    LISTS = {"bias_ids": np.int32, "bias_vals": np.float32, "ban_ids": np.int32, "pen_ids": np.int32,
             "pen_counts": np.int32}

    def __post_init__(self) -> None:
        self.validate()

    @property
    def n(self) -> int:
        return int(self.temperature.shape[0])

    # ---- validation ---------------------------------------------------------------------------------------
    def validate(self) -> None:
        n = self.n
        for name, dt in {**self.SCALARS, **self.LISTS}.items():
            a = getattr(self, name)
            if not isinstance(a, np.ndarray) or a.dtype != dt:
                raise SamplerParamError(f"{name}: expected a numpy {np.dtype(dt).name} array, got "
                                        f"{getattr(a, 'dtype', type(a).__name__)}")
            want = 1 if name in self.SCALARS else 2
            if a.ndim != want or a.shape[0] != n:
                raise SamplerParamError(f"{name}: expected {'[n]' if want == 1 else '[n, W]'} with n = {n}, "
                                        f"got shape {a.shape}")
        if self.bias_vals.shape != self.bias_ids.shape or self.pen_counts.shape != self.pen_ids.shape:
            raise SamplerParamError("bias_vals / pen_counts: must have the shape of bias_ids / pen_ids")
        self._check("temperature", np.isfinite(self.temperature) & (self.temperature >= 0), "finite and >= 0")
        self._check("temperature", (self.temperature == 0) | (self.temperature >= TEMPERATURE_EPS),
                    f"0 (greedy) or >= {TEMPERATURE_EPS}")
        want_inv = np.where(self.temperature > 0, np.float32(1) / np.maximum(self.temperature, np.float32(1e-30)),
                            np.float32(1)).astype(np.float32)
        self._check("inv_temperature", self.inv_temperature == want_inv, "fp32(1 / temperature), 1 if greedy")
        self._check("top_k", self.top_k >= 0, ">= 0 (0 = off)")
        if self.vocab_size:
            self._check("top_k", self.top_k < self.vocab_size, f"< vocab_size {self.vocab_size} (0 = off)")
        self._check("top_p", np.isfinite(self.top_p) & (self.top_p > 0) & (self.top_p <= 1), "in (0, 1]")
        self._check("top_p_fixed", (self.top_p_fixed >= 0) & (self.top_p_fixed < TOP_P_ONE),
                    "in [0, 2^24) (0 = off)")
        self._check("min_p", np.isfinite(self.min_p) & (self.min_p >= 0) & (self.min_p <= 1), "in [0, 1]")
        self._check("log_min_p", ~np.isnan(self.log_min_p) & (self.log_min_p <= 0), "<= 0 or -inf (off)")
        self._check("position", self.position >= 0, ">= 0")
        for name in ("presence", "frequency"):
            a = getattr(self, name)
            self._check(name, np.isfinite(a) & (np.abs(a) <= 2), "finite, in [-2, 2]")
        self._check("repetition", np.isfinite(self.repetition) & (self.repetition > 0), "finite and > 0")
        self._check("inv_repetition", np.isfinite(self.inv_repetition) & (self.inv_repetition > 0), "finite and > 0")
        self._check("bias_vals", np.isfinite(self.bias_vals) & (np.abs(self.bias_vals) <= MAX_LOGIT_BIAS),
                    f"finite, in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
        for name in ("bias_ids", "ban_ids", "pen_ids"):
            a = getattr(self, name)
            hi = self.vocab_size if self.vocab_size else np.iinfo(np.int32).max
            self._check(name, (a == -1) | ((a >= 0) & (a < hi)), f"-1 (unused) or a token id in [0, {hi})")
        self._check("pen_counts", self.pen_counts >= 0, ">= 0")
        if (bad := allow_bits_error(self.allow_bits, n, self.vocab_size)) is not None:
            raise SamplerParamError(bad)
        for name in ("bias_ids", "pen_ids"):  # read-modify-write on the device: one entry per id and row
            s = np.sort(getattr(self, name), axis=1)
            dup = ((s[:, 1:] == s[:, :-1]) & (s[:, 1:] >= 0)).any(axis=1)
            if dup.any():
                raise SamplerParamError(f"row {int(np.flatnonzero(dup)[0])}: {name}: duplicate token ids")

    def _check(self, name: str, ok: np.ndarray, what: str) -> None:
        bad = np.flatnonzero(~np.asarray(ok).reshape(ok.shape[0], -1).all(axis=1)) if ok.ndim else []
        if len(bad):
            i = int(bad[0])
            raise SamplerParamError(f"row {i}: {name} must be {what}, got {getattr(self, name)[i]!r}")

    def with_position(self, position: np.ndarray) -> Optional["HostBatch"]:
        """This batch with `position` instead (the next decode step of the same rows: every other field is a
        function of inputs that did not change), or None when `position` is not a valid int64 `[n]` (>= 0)."""
        if not (isinstance(position, np.ndarray) and position.dtype == np.int64 and position.shape == (self.n,)
                and self.n and int(position.min()) >= 0):
            return None
        out = HostBatch.__new__(HostBatch)  # validated: self was, and position is
        out.__dict__.update(self.__dict__, position=position)
        return out

    # ---- per-step flags -----------------------------------------------------------------------------------
    def variant(self) -> SamplerVariant:
        """The smallest variant that serves this batch (the caller picks a captured graph covering it). Once per
        sampled step: a list holds an id when its largest entry is >= 0; without a sampled row no stage but the
        processing one can apply."""
        processed = self.allow_bits is not None or any(a.size and int(a.max()) >= 0
                                                       for a in (self.bias_ids, self.ban_ids, self.pen_ids))
        sampled = self.temperature > 0
        if not sampled.any():
            return _variant(processed, False, False, False)
        return _variant(processed, bool((sampled & (self.top_k > 0)).any()),
                        bool((sampled & (self.top_p_fixed > 0)).any()),
                        bool((sampled & (self.top_k > TOP_K_FAST)).any()))

    # ---- construction from Python values -------------------------------------------------------------------
    @classmethod
    def from_rows(cls, rows: Sequence[RowSpec], *, vocab_size: int, max_bias: int, max_ban: int,
                  max_penalty_tokens: int, allow_bits: Optional[np.ndarray] = None) -> "HostBatch":
        """Validate and convert. Lists wider than the given capacities raise. Penalty lists are built only for
        rows with a penalty on: the union of prompt and output ids, each with its output count. `allow_bits`: the
        rows' allow mask (see the class), taken as it is."""
        n = len(rows)
        a = {k: np.zeros(n, dtype=dt) for k, dt in cls.SCALARS.items()}
        lists = {"bias_ids": np.full((n, max_bias), -1, np.int32), "bias_vals": np.zeros((n, max_bias), np.float32),
                 "ban_ids": np.full((n, max_ban), -1, np.int32),
                 "pen_ids": np.full((n, max_penalty_tokens), -1, np.int32),
                 "pen_counts": np.zeros((n, max_penalty_tokens), np.int32)}
        for i, r in enumerate(rows):
            _row_scalars(i, r, a, vocab_size)
            _row_lists(i, r, lists, vocab_size)
        return cls(**a, **lists, vocab_size=vocab_size, allow_bits=allow_bits)


def _fail(i: int, name: str, what: str, got: object) -> None:
    raise SamplerParamError(f"row {i}: {name} must be {what}, got {got!r}")


def _finite(i: int, name: str, x: float, lo: float, hi: float) -> float:
    if not isinstance(x, (int, float, np.floating, np.integer)) or not math.isfinite(x) or not lo <= x <= hi:
        _fail(i, name, f"a finite number in [{lo:g}, {hi:g}]", x)
    return float(x)


def _int(i: int, name: str, x: object, lo: int, hi: int) -> int:
    if isinstance(x, bool) or not isinstance(x, (int, np.integer)) or not lo <= int(x) < hi:
        _fail(i, name, f"an int in [{lo}, {hi})", x)
    return int(x)


def _row_scalars(i: int, r: RowSpec, a: dict, vocab: int) -> None:
    t = _finite(i, "temperature", r.temperature, 0.0, 1e6)
    t = 0.0 if t < TEMPERATURE_EPS else t
    a["temperature"][i] = t
    a["inv_temperature"][i] = np.float32(1) / _f32(t) if t > 0 else 1.0
    k = _int(i, "top_k", r.top_k, -1, 1 << 31)
    a["top_k"][i] = 0 if k < 0 or k >= vocab else k
    p = _finite(i, "top_p", r.top_p, 0.0, 1.0)
    if p <= 0:
        _fail(i, "top_p", "in (0, 1]", r.top_p)
    a["top_p"][i] = p
    fixed = max(1, round(p * TOP_P_ONE))
    a["top_p_fixed"][i] = 0 if fixed >= TOP_P_ONE else fixed
    mp = _finite(i, "min_p", r.min_p, 0.0, 1.0)
    a["min_p"][i] = mp
    a["log_min_p"][i] = np.float32(math.log(mp)) if mp > 0 else -np.inf
    a["seed"][i] = np.int64(np.uint64(_int(i, "seed", r.seed, -(1 << 63), 1 << 64) % (1 << 64)).view(np.int64))
    a["position"][i] = _int(i, "position", r.position, 0, 1 << 62)
    a["presence"][i] = _finite(i, "presence_penalty", r.presence_penalty, -2.0, 2.0)
    a["frequency"][i] = _finite(i, "frequency_penalty", r.frequency_penalty, -2.0, 2.0)
    rep = _finite(i, "repetition_penalty", r.repetition_penalty, 0.0, 1e6)
    if rep <= 0:
        _fail(i, "repetition_penalty", "> 0", r.repetition_penalty)
    a["repetition"][i] = rep
    a["inv_repetition"][i] = np.float32(1) / _f32(rep)


def _ids(i: int, name: str, ids: Sequence[int], vocab: int) -> np.ndarray:
    arr = np.asarray(list(ids), dtype=np.int64)
    if arr.size and (arr.min() < 0 or arr.max() >= vocab):
        bad = arr[(arr < 0) | (arr >= vocab)][0]
        _fail(i, name, f"token ids in [0, {vocab})", int(bad))
    return arr


def _row_lists(i: int, r: RowSpec, lists: dict, vocab: int) -> None:
    bias = dict(r.logit_bias or {})
    if len(bias) > lists["bias_ids"].shape[1]:
        _fail(i, "logit_bias", f"at most {lists['bias_ids'].shape[1]} entries", len(bias))
    ids = _ids(i, "logit_bias", list(bias.keys()), vocab)
    for j, (tok, val) in enumerate(zip(ids, bias.values())):
        lists["bias_ids"][i, j] = tok
        lists["bias_vals"][i, j] = _finite(i, "logit_bias", val, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
    ban = np.unique(_ids(i, "banned_ids", r.banned_ids, vocab))
    if ban.size > lists["ban_ids"].shape[1]:
        _fail(i, "banned_ids", f"at most {lists['ban_ids'].shape[1]} distinct ids", int(ban.size))
    lists["ban_ids"][i, : ban.size] = ban
    if r.presence_penalty == 0 and r.frequency_penalty == 0 and r.repetition_penalty == 1:
        return
    out = _ids(i, "output_token_ids", r.output_token_ids, vocab)
    prompt = _ids(i, "prompt_token_ids", r.prompt_token_ids, vocab) if r.repetition_penalty != 1 else out[:0]
    uniq, counts = np.unique(out, return_counts=True)
    extra = np.setdiff1d(np.unique(prompt), uniq, assume_unique=True)
    pen = np.concatenate([uniq, extra])
    cap = lists["pen_ids"].shape[1]
    if pen.size > cap:
        _fail(i, "prompt_token_ids/output_token_ids", f"at most {cap} distinct penalised ids", int(pen.size))
    lists["pen_ids"][i, : pen.size] = pen
    lists["pen_counts"][i, : uniq.size] = counts


def host_batch_from_arrays(temperature: np.ndarray, top_k: np.ndarray, top_p: np.ndarray, seed: np.ndarray,
                           position: np.ndarray, *, vocab_size: int, min_p: Optional[np.ndarray] = None,
                           penalties: Optional[np.ndarray] = None, bias_ids: Optional[np.ndarray] = None,
                           bias_vals: Optional[np.ndarray] = None, ban_ids: Optional[np.ndarray] = None,
                           pen_ids: Optional[np.ndarray] = None, pen_counts: Optional[np.ndarray] = None,
                           allow_bits: Optional[np.ndarray] = None) -> HostBatch:
    """A `HostBatch` from a step's arrays (`[n]` scalars, `[n, W]` lists with -1 = unused; `allow_bits` as it is),
    the derived fields computed vectorised as `from_rows` computes them one row at a time: temperatures below
    `TEMPERATURE_EPS` are greedy, top_k 0 or >= vocab is off, seeds are taken modulo 2^64 as int64. Validated
    (`SamplerParamError`; `HostBatch.validate` only when `_plainly_valid` cannot tell). Per sampled step: a few
    dozen numpy calls."""
    n = int(temperature.shape[0])
    t = np.asarray(temperature, np.float32)
    t = np.where(t < TEMPERATURE_EPS, np.float32(0), t)
    k = np.asarray(top_k).astype(np.int64)
    p = np.asarray(top_p, np.float32)
    fixed = np.rint(p.astype(np.float64) * TOP_P_ONE).astype(np.int64)
    mp = np.zeros(n, np.float32) if min_p is None else np.asarray(min_p, np.float32)
    if penalties is None:  # presence, frequency, repetition off
        pres, freq, rep = np.zeros(n, np.float32), np.zeros(n, np.float32), np.ones(n, np.float32)
    else:
        pen = np.asarray(penalties, np.float32)
        pres, freq, rep = (np.ascontiguousarray(pen[:, j]) for j in range(3))
    if mp.any():
        with np.errstate(divide="ignore"):
            log_mp = np.where(mp > 0, np.log(np.maximum(mp, np.float32(1e-38))), -np.inf).astype(np.float32)
    else:
        log_mp = np.full(mp.shape, -np.inf, np.float32)

    def lists(a: Optional[np.ndarray], dtype, fill) -> np.ndarray:
        return np.full((n, 1), fill, dtype) if a is None else np.ascontiguousarray(a, dtype)

    sampled = t.any()  # all-greedy / no-top-k batches skip the arithmetic: the same values
    kw = dict(
        temperature=t, inv_temperature=np.where(t > 0, np.float32(1) / np.maximum(t, np.float32(1e-30)),
                                                np.float32(1)).astype(np.float32) if sampled else
        np.ones(t.shape, np.float32),
        top_k=np.where((k < 0) | (k >= vocab_size), 0, k).astype(np.int32) if k.any() else np.zeros(k.shape, np.int32),
        top_p=p, top_p_fixed=np.where(fixed >= TOP_P_ONE, 0, np.maximum(fixed, 1)), min_p=mp, log_min_p=log_mp,
        seed=np.asarray(seed).astype(np.int64), position=np.asarray(position).astype(np.int64),
        presence=pres, frequency=freq, repetition=rep, inv_repetition=(np.float32(1) / rep).astype(np.float32),
        bias_ids=lists(bias_ids, np.int32, -1), bias_vals=lists(bias_vals, np.float32, 0.0),
        ban_ids=lists(ban_ids, np.int32, -1), pen_ids=lists(pen_ids, np.int32, -1),
        pen_counts=lists(pen_counts, np.int32, 0))
    given = bias_ids is not None or bias_vals is not None or ban_ids is not None or pen_ids is not None \
        or pen_counts is not None
    if _plainly_valid(kw, vocab_size, given) and allow_bits_error(allow_bits, n, vocab_size) is None:
        out = HostBatch.__new__(HostBatch)  # the dataclass without its __post_init__ validation
        out.__dict__.update(kw, vocab_size=vocab_size, allow_bits=allow_bits)
        return out
    return HostBatch(**kw, vocab_size=vocab_size, allow_bits=allow_bits)


_F32_MAX = float(np.finfo(np.float32).max)
_F32_MIN_POSITIVE = float(np.finfo(np.float32).smallest_subnormal)
# `_plainly_valid`'s bounds (lo <= x <= hi, which NaN fails; "> 0" is ">= the least positive") of these rows:
_LO = np.array([0.0, _F32_MIN_POSITIVE, 0.0, -2.0, -2.0, _F32_MIN_POSITIVE, _F32_MIN_POSITIVE], np.float32)
_HI = np.array([_F32_MAX, 1.0, 1.0, 2.0, 2.0, _F32_MAX, _F32_MAX], np.float32)
_STACKED = ("temperature", "top_p", "min_p", "presence", "frequency", "repetition", "inv_repetition")


def _plainly_valid(kw: dict, vocab_size: int, lists: bool = True) -> bool:
    """True only when `HostBatch.validate` passes for the fields `kw` that `host_batch_from_arrays` derived (about a
    dozen numpy calls); False decides nothing (the caller runs `validate`). Not repeated: what the derivation
    guarantees once these hold (temperature 0 or >= TEMPERATURE_EPS; inv_temperature, top_k, top_p_fixed, log_min_p
    as `validate` recomputes or bounds them), and with `lists=False` the default lists."""
    n = kw["temperature"].shape[0]
    if not n:
        return False
    shape = (n,)
    for name, dt in HostBatch.SCALARS.items():
        a = kw[name]
        if a.shape != shape or a.dtype != dt:
            return False
    for name, dt in HostBatch.LISTS.items():
        a = kw[name]
        if a.ndim != 2 or a.shape[0] != n or a.dtype != dt:
            return False
    bias_ids, bias_vals, pen_ids, pen_counts = kw["bias_ids"], kw["bias_vals"], kw["pen_ids"], kw["pen_counts"]
    if bias_vals.shape != bias_ids.shape or pen_counts.shape != pen_ids.shape or bias_ids.shape[1] > 1 \
            or pen_ids.shape[1] > 1:  # wider lists: `validate` looks for duplicate ids
        return False
    s = np.stack([kw[name] for name in _STACKED])
    if not ((s.min(axis=1) >= _LO) & (s.max(axis=1) <= _HI)).all() or int(kw["position"].min()) < 0:
        return False
    if not lists:
        return True
    if bias_vals.size and not float(np.abs(bias_vals).max()) <= MAX_LOGIT_BIAS:
        return False
    if pen_counts.size and int(pen_counts.min()) < 0:
        return False
    ids = np.concatenate([bias_ids.ravel(), kw["ban_ids"].ravel(), pen_ids.ravel()])
    hi = vocab_size if vocab_size else np.iinfo(np.int32).max
    return not ids.size or (int(ids.min()) >= -1 and int(ids.max()) < hi)
