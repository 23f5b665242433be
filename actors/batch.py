"""The step description that crosses the process boundary: plain numpy arrays, cheap to pickle.

One `StepBatch` per DP rank per step, built by that rank's scheduler. Sequences are
in batch order; `token_ids` is the flat concatenation of each sequence's new tokens.

Previous-step references: a token id `-(j + 1)` (`prev_token(j)`) stands for the token this
DP rank's previous step sampled for its row j (the last step's, for a multi-step decode).
The rank fills it in on the device, so a driver can submit step k+1 before step k's tokens
have come back (`Coordinator.submit`) and the device never waits for the host.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from itertools import accumulate
from typing import NamedTuple, Optional, Sequence

import numpy as np

_I32 = np.dtype(np.int32)
_ONE_I32 = np.ones(1, dtype=np.int32).tobytes()
_LIST_BOUNDS = 48  # `_bounds` of arrays up to this many elements in all: through Python lists


class BatchError(ValueError):
    """A step batch is malformed (shapes, lengths, ids)."""


def prev_token(row: int) -> int:
    """The token id that refers to row `row` of the previous step's tokens (see the module docstring)."""
    if row < 0:
        raise ValueError(f"row must be >= 0, got {row}")
    return -(row + 1)


MAX_LOGPROBS = 20  # top log-probabilities a step may return per row
_PENALTIES_OFF = np.array([0.0, 0.0, 1.0], np.float32)  # presence, frequency, repetition
_PENALTIES_OFF_BYTES = _PENALTIES_OFF.tobytes()
_UNUSED_BYTE = b"\xff"  # every byte of an int32 -1 (an unused list entry)
_F32 = np.dtype(np.float32)
# SamplerExtras' arrays: (name, dtype, ndim)
_EXTRAS_ARRAYS = (("min_p", _F32, 1), ("penalties", _F32, 2), ("bias_ids", _I32, 2), ("bias_vals", _F32, 2),
                  ("ban_ids", _I32, 2), ("pen_ids", _I32, 2), ("pen_counts", _I32, 2))
_EXTRAS_LAYOUT = tuple((dtype, ndim) for _, dtype, ndim in _EXTRAS_ARRAYS)


# batch size -> `SamplerExtras.off`'s shared arrays (at most _MAX_OFF sizes, then forgotten all at once)
_OFF: dict[int, tuple[np.ndarray, ...]] = {}
_MAX_OFF = 512


def _off_arrays(b: int) -> tuple[np.ndarray, ...]:
    got = _OFF.get(b)
    if got is None:
        if len(_OFF) >= _MAX_OFF:
            _OFF.clear()
        got = (np.zeros(b, np.float32), np.tile(_PENALTIES_OFF, (b, 1)), np.full((b, 1), -1, np.int32),
               np.zeros((b, 1), np.float32), np.full((b, 1), -1, np.int32), np.full((b, 1), -1, np.int32),
               np.zeros((b, 1), np.int32))
        for a in got:
            a.flags.writeable = False
        _OFF[b] = got
    return got


def _unused(a: np.ndarray) -> bool:
    """Whether every entry of int32 list `a` is -1 (unused), by its bytes (no reduction): True decides it, False
    decides nothing."""
    return a.tobytes() == _UNUSED_BYTE * a.nbytes


@dataclass
class SamplerExtras:
    """The per-row sampling inputs beyond temperature / top_k / top_p / seed; a batch carries them only when some
    row needs one (penalties, logit bias, banned ids, min_p, logprobs), so greedy and plain sampled steps stay as
    small as they were. `B` rows, in batch order:

    min_p float32 `[B]` (0 = off); penalties float32 `[B, 3]`: presence, frequency, repetition (0, 0, 1 = off);
    bias_ids int32 `[B, K]` (-1 = unused) with bias_vals float32 `[B, K]`; ban_ids int32 `[B, M]` (-1 = unused:
    tokens that must not be drawn this step, e.g. the stop ids before `min_tokens`); pen_ids int32 `[B, P]`
    (-1 = unused: the distinct tokens of the row's prompt and output) with pen_counts int32 `[B, P]` (their
    occurrences among the output tokens; 0 = prompt only); num_logprobs: -1 = none, else every row returns its
    chosen token's log-probability and the top `num_logprobs` (0..20); allow_bits: None (no row constrained), or
    int32 `[B, W]`, W = ceil(V / 32) of the full vocabulary V: structured outputs' allowed tokens, token id j may be
    drawn when bit (j & 31) of word j >> 5 is set (`(word >> (j & 31)) & 1`, llguidance's / xgrammar's bitmask
    layout); an unconstrained row of a masked batch is all -1 words; a row allowing nothing draws token 0. The
    sampler sets masked ids to -inf where bias and bans apply (logprobs stay those of the raw logits). A mask alone
    rides on `off`'s arrays: `dataclasses.replace(SamplerExtras.off(b, n), allow_bits=bits)`."""

    min_p: np.ndarray
    penalties: np.ndarray
    bias_ids: np.ndarray
    bias_vals: np.ndarray
    ban_ids: np.ndarray
    pen_ids: np.ndarray
    pen_counts: np.ndarray
    num_logprobs: int = -1
    allow_bits: Optional[np.ndarray] = None

    @classmethod
    def off(cls, b: int, num_logprobs: int) -> "SamplerExtras":
        """The extras of `b` rows that only ask for logprobs: every array off (min_p 0, penalties (0, 0, 1), lists
        of one unused column), read-only and shared by every such `SamplerExtras` of `b` rows (`logprobs_only`)."""
        return cls(*_off_arrays(b), num_logprobs)

    @property
    def logprobs_only(self) -> bool:
        """Whether every array is `off`'s own (identity, no reduction) and no mask: nothing but logprobs. False
        decides nothing (other arrays may hold off values too)."""
        if self.allow_bits is not None:
            return False
        got = _OFF.get(self.min_p.shape[0]) if type(self.min_p) is np.ndarray and self.min_p.ndim == 1 else None
        return got is not None and self.min_p is got[0] and self.penalties is got[1] and self.bias_ids is got[2] \
            and self.bias_vals is got[3] and self.ban_ids is got[4] and self.pen_ids is got[5] \
            and self.pen_counts is got[6]

    @property
    def processed(self) -> bool:
        """Whether a row needs the logits patched (bias, banned ids, penalties, an allow mask) before sampling."""
        if self.allow_bits is not None:
            return True
        if self.logprobs_only:
            return False
        # a list holds an id when its largest entry is >= 0; penalties are off at exactly (0, 0, 1). The usual
        # case (lists unused, penalties off bit for bit) is decided by bytes; anything else by reductions.
        pen = self.penalties
        off = pen.dtype == _F32 and pen.ndim == 2 and pen.shape[1] == 3 \
            and pen.tobytes() == _PENALTIES_OFF_BYTES * pen.shape[0]
        if not off and (pen != _PENALTIES_OFF).any():
            return True
        return any(a.size and not (a.dtype == _I32 and _unused(a)) and int(a.max()) >= 0
                   for a in (self.bias_ids, self.ban_ids))

    def validate(self, b: int, vocab_size: int) -> None:
        if self.logprobs_only and self.min_p.shape[0] == b:  # `off`'s arrays: valid by construction
            if not -1 <= self.num_logprobs <= MAX_LOGPROBS:
                raise BatchError(f"sampler extras: num_logprobs must be in [-1, {MAX_LOGPROBS}]")
            return
        arrays = (self.min_p, self.penalties, self.bias_ids, self.bias_vals, self.ban_ids, self.pen_ids,
                  self.pen_counts)
        if not all(type(a) is np.ndarray and (a.dtype, a.ndim) == want and a.shape[0] == b
                   for a, want in zip(arrays, _EXTRAS_LAYOUT)):
            for a, (name, dtype, ndim) in zip(arrays, _EXTRAS_ARRAYS):
                if not isinstance(a, np.ndarray) or a.dtype != dtype or a.ndim != ndim or a.shape[0] != b:
                    raise BatchError(f"sampler extras: {name} must be {dtype.name} with {ndim} dims and {b} rows")
        if self.penalties.shape[1] != 3 or self.bias_vals.shape != self.bias_ids.shape \
                or self.pen_counts.shape != self.pen_ids.shape:
            raise BatchError("sampler extras: inconsistent list shapes")
        for name, a in (("bias_ids", self.bias_ids), ("ban_ids", self.ban_ids), ("pen_ids", self.pen_ids)):
            if a.size and not _unused(a) and (a.min() < -1 or a.max() >= vocab_size):
                raise BatchError(f"sampler extras: {name} must be token ids in [0, {vocab_size}) or -1")
        if not -1 <= self.num_logprobs <= MAX_LOGPROBS:
            raise BatchError(f"sampler extras: num_logprobs must be in [-1, {MAX_LOGPROBS}]")
        bits = self.allow_bits
        if bits is not None:
            want = (b, -(-vocab_size // 32))
            if not isinstance(bits, np.ndarray) or bits.dtype != _I32 or bits.shape != want:
                got = f"{getattr(bits, 'dtype', type(bits).__name__)} {getattr(bits, 'shape', '')}"
                raise BatchError(f"sampler extras: allow_bits must be int32 of shape {want} (B, ceil(vocab_size / 32)),"
                                 f" got {got}")


class StepLogprobs(NamedTuple):
    """Log-probabilities of one step's rows (of the raw logits): chosen float32 `[B]`, top_ids int32 `[B, N]`,
    top_logprobs float32 `[B, N]` (N = the step's `num_logprobs`, best first)."""

    chosen: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray


class SampledTokens(NamedTuple):
    """A step's result for a DP rank when logprobs were asked for: tokens int64 `[B]`, their `StepLogprobs` (None
    when only prompt log-probabilities were), and `actors.prompt_logprobs.PromptLogprobs` when the batch asked for
    them (`StepBatch.prompt_lp`)."""

    tokens: np.ndarray
    logprobs: Optional[StepLogprobs]
    prompt: Optional["PromptLogprobs"] = None  # noqa: F821 (actors.prompt_logprobs imports this module)


@dataclass
class StepBatch:
    """token_ids int64 `[T]`; q_seqlens int32 `[B]` (new tokens); num_history int32 `[B]` (cached tokens);
    block_tables int32 `[B, W]` (blocks covering history + new tokens; block 0 never used);
    temperature float32 `[B]` (0 = greedy), top_k int32 `[B]` (0 = off), top_p float32 `[B]`,
    seeds int64 `[B]` (the driver gives every sampled row one; -1 only for greedy rows); extras: the rarer sampling
    inputs (`SamplerExtras`), None when no row needs them; prompt_lp: the prompt positions whose log-probabilities
    the step returns (`actors.prompt_logprobs.PromptLogprobsAsk`), None for none. The next token of each sequence
    is sampled at position num_history + q_seqlen."""

    token_ids: np.ndarray
    q_seqlens: np.ndarray
    num_history: np.ndarray
    block_tables: np.ndarray
    temperature: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray
    seeds: np.ndarray
    extras: Optional[SamplerExtras] = None
    prompt_lp: Optional["PromptLogprobsAsk"] = None  # noqa: F821

    @property
    def batch_size(self) -> int:
        return int(self.q_seqlens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def is_decoding(self) -> bool:
        q = self.q_seqlens
        if q.dtype == _I32:  # the scheduler's and the wire's dtype: compare bytes, no numpy reduction
            return q.tobytes() == _ONE_I32 * q.size
        return bool((q == 1).all())

    def validate(self, vocab_size: int, block_size: int, prev_rows: int = 0) -> None:
        """Shapes, lengths, ids and block-table coverage. `prev_rows`: how many rows of the previous step's
        tokens negative ids may refer to (0: none may)."""
        if not self._valid_decode(vocab_size, block_size, prev_rows):
            self._validate(vocab_size, block_size, prev_rows)
        if self.extras is not None:
            self.extras.validate(self.batch_size, vocab_size)
        if self.prompt_lp is not None:
            self.prompt_lp.validate(self.num_tokens, vocab_size)

    def _validate(self, vocab_size: int, block_size: int, prev_rows: int) -> None:
        """`validate`'s checks in full (any batch); raises the BatchError of the first that fails."""
        b = self.batch_size
        if b == 0:
            raise BatchError("empty batch")
        if self.token_ids.ndim != 1:
            raise BatchError(f"token_ids has shape {self.token_ids.shape}, expected (T,)")
        for name in ("num_history", "temperature", "top_k", "top_p", "seeds"):
            if getattr(self, name).shape != (b,):
                raise BatchError(f"{name} has shape {getattr(self, name).shape}, expected ({b},)")
        if self.num_history.min() < 0:
            raise BatchError("num_history must be >= 0")
        tables = self.block_tables
        if tables.ndim != 2 or tables.shape[0] != b:
            raise BatchError(f"block_tables has shape {tables.shape}, expected ({b}, W)")
        q = self.q_seqlens
        if q.min() < 1 or int(q.sum()) != self.num_tokens:
            raise BatchError("q_seqlens must be >= 1 and sum to len(token_ids)")
        ids = self.token_ids
        if self.num_tokens and (ids.min() < -prev_rows or ids.max() >= vocab_size):
            if ids.max() >= vocab_size or not prev_rows:
                where = "" if prev_rows else " (negative ids refer to a previous step, and there is none)"
                raise BatchError(f"token ids must be in [0, {vocab_size}){where}")
            raise BatchError(f"token id {int(ids.min())} refers to row {-int(ids.min()) - 1} of the previous step, "
                             f"which had {prev_rows} rows")
        gap = self._table_gap(self.num_history.astype(np.int64) + q, block_size)  # no int32 wrap-around
        if gap == "short":
            raise BatchError("a block table is too short for its sequence")
        if gap == "unallocated":
            raise BatchError("a used block table entry is 0 (the reserved padding block) or negative")

    def _table_gap(self, tokens: np.ndarray, block_size: int) -> Optional[str]:
        """Whether the block tables hold `tokens` `[B]` tokens per sequence: "short" (fewer columns than blocks
        needed), "unallocated" (a needed entry is 0 or negative) or None (covered)."""
        tables = self.block_tables
        need = (tokens + (block_size - 1)) // block_size
        width = tables.shape[1]
        if need.max() > width:
            return "short"
        used = tables if need.min() == width else tables[np.arange(width)[None, :] < need[:, None]]
        return "unallocated" if used.size and used.min() <= 0 else None

    def _valid_decode(self, vocab_size: int, block_size: int, prev_rows: int, max_blocks_per_seq: Optional[int] = None,
                      num_kv_blocks: Optional[int] = None) -> bool:
        """True when this is a decode batch (one new token per sequence) of integer numpy arrays that passes every
        check of `validate` (and of `check_runnable` when its limits are given), at the cost of a few reductions.
        False decides nothing: the caller runs the full checks, which raise the error or pass."""
        q, ids, hist, tables = self.q_seqlens, self.token_ids, self.num_history, self.block_tables
        if not (type(q) is type(ids) is type(hist) is type(tables) is np.ndarray):
            return False
        if q.ndim != 1 or ids.ndim != 1 or tables.ndim != 2 or q.dtype != _I32:
            return False
        b, width = q.shape[0], tables.shape[1]
        if not b or ids.shape[0] != b or tables.shape[0] != b or not width:
            return False
        if max_blocks_per_seq is not None and width > max_blocks_per_seq:
            return False
        shape = (b,)
        if (hist.shape != shape or self.temperature.shape != shape or self.top_k.shape != shape
                or self.top_p.shape != shape or self.seeds.shape != shape):
            return False
        if not ids.dtype.kind == hist.dtype.kind == tables.dtype.kind == "i":
            return False
        if q.tobytes() != _ONE_I32 * b:  # q_seqlens all 1, and token_ids has one per sequence
            return False
        small = b * (width + 2) <= _LIST_BOUNDS
        (ids_lo, ids_hi), (hist_lo, hist_hi), (tables_lo, tables_hi) = _bounds(small, ids, hist, tables)
        if ids_lo < -prev_rows or ids_hi >= vocab_size or hist_lo < 0:
            return False
        if num_kv_blocks is not None and tables_hi >= num_kv_blocks:
            return False
        return self._decode_gap(1, block_size, hist_lo, hist_hi, tables_lo) is None

    def _decode_gap(self, steps: int, block_size: int, hist_lo: int, hist_hi: int, tables_lo: int) -> Optional[str]:
        """`_table_gap(num_history + steps)` (exact, without overflow) for integer num_history `[B]` whose smallest
        and largest values are `hist_lo`, `hist_hi`, and non-empty block tables whose smallest entry is
        `tables_lo`. Column j of a row is used when j * block_size < num_history + steps."""
        tables = self.block_tables
        width = tables.shape[1]
        if hist_hi + steps > width * block_size:
            return "short"
        if tables_lo > 0:
            return None
        if hist_lo + steps > (width - 1) * block_size:
            return "unallocated"  # every column is used, and the smallest entry is <= 0
        used = tables[_column_starts(width, block_size, steps) < self.num_history[:, None]]
        return "unallocated" if used.size and used.min() <= 0 else None

    def check_runnable(self, vocab_size: int, block_size: int, max_blocks_per_seq: int, num_kv_blocks: int,
                       prev_rows: int = 0) -> None:
        """`validate` plus the limits of a deployment: block-table width and the cache's block count."""
        if self.extras is not None:
            self.extras.validate(self.batch_size, vocab_size)
        if self.prompt_lp is not None:
            self.prompt_lp.validate(self.num_tokens, vocab_size)
        if self._valid_decode(vocab_size, block_size, prev_rows, max_blocks_per_seq, num_kv_blocks):
            return
        self._validate(vocab_size, block_size, prev_rows)
        if self.block_tables.shape[1] > max_blocks_per_seq:
            raise BatchError(f"block tables of width {self.block_tables.shape[1]} exceed max_model_len "
                             f"({max_blocks_per_seq} blocks)")
        if int(self.block_tables.max()) >= num_kv_blocks:
            raise BatchError(f"a block id is >= num_kv_blocks {num_kv_blocks}")

    def check_multi_step(self, num_steps: int, block_size: int) -> None:
        """What `num_steps > 1` (multi-step decode) needs beyond `check_runnable`: a decode batch (greedy or sampled,
        no sampler extras) whose block tables already cover the `num_steps` tokens each sequence will store."""
        if num_steps < 1:
            raise BatchError(f"num_steps must be >= 1, got {num_steps}")
        if num_steps == 1:
            return
        if not self.is_decoding:
            raise BatchError("multi-step decode needs a decode batch (one new token per sequence)")
        if self.extras is not None or self.prompt_lp is not None:
            raise BatchError("multi-step decode takes no sampler extras (penalties, bias, banned ids, logprobs) and "
                             "no prompt logprobs")
        hist, tables = self.num_history, self.block_tables
        if (hist.dtype.kind == tables.dtype.kind == "i" and hist.ndim == 1 and tables.ndim == 2 and tables.size
                and len(hist) == len(tables)):
            (hist_lo, hist_hi), (tables_lo, _) = _bounds(hist.size + tables.size <= _LIST_BOUNDS, hist, tables)
            gap = self._decode_gap(num_steps, block_size, hist_lo, hist_hi, tables_lo)
        else:
            gap = self._table_gap(hist.astype(np.int64) + num_steps, block_size)
        if gap == "short":
            raise BatchError(f"a block table is too short for {num_steps} decode steps")
        if gap == "unallocated":
            raise BatchError(f"a block table lacks blocks for {num_steps} decode steps (entry 0 or negative)")

    @staticmethod
    def from_sequences(tokens: Sequence[Sequence[int]], num_history: Sequence[int],
                       block_tables: Sequence[Sequence[int]],
                       temperature: Sequence[float] | None = None, top_k: Sequence[int] | None = None,
                       top_p: Sequence[float] | None = None, seeds: Sequence[int] | None = None) -> "StepBatch":
        b = len(tokens)
        width = max(len(t) for t in block_tables)
        tables = np.zeros((b, width), dtype=np.int32)
        for i, t in enumerate(block_tables):
            tables[i, : len(t)] = t
        return StepBatch(
            token_ids=np.fromiter((x for t in tokens for x in t), dtype=np.int64),
            q_seqlens=np.array([len(t) for t in tokens], dtype=np.int32),
            num_history=np.asarray(num_history, dtype=np.int32),
            block_tables=tables,
            temperature=np.asarray(temperature if temperature is not None else [0.0] * b, dtype=np.float32),
            top_k=np.asarray(top_k if top_k is not None else [0] * b, dtype=np.int32),
            top_p=np.asarray(top_p if top_p is not None else [1.0] * b, dtype=np.float32),
            seeds=np.asarray(seeds if seeds is not None else [-1] * b, dtype=np.int64),
        )


def _bounds(small: bool, *arrays: np.ndarray) -> list[tuple[int, int]]:
    """(min, max) of each non-empty integer array, as Python ints (no overflow in arithmetic on them). A numpy
    reduction costs about a microsecond whatever the size: `small` arrays (at most `_LIST_BOUNDS` elements in all)
    go through Python lists, larger ones through two reductions over their concatenation."""
    if small:
        out = []
        for a in arrays:
            flat = a.ravel().tolist()
            out.append((min(flat), max(flat)))
        return out
    sizes = [a.size for a in arrays]
    flat = np.concatenate([a.ravel() for a in arrays], dtype=np.int64)
    starts = list(accumulate(sizes[:-1], initial=0))
    return list(zip(np.minimum.reduceat(flat, starts).tolist(), np.maximum.reduceat(flat, starts).tolist()))


@lru_cache(maxsize=256)
def _column_starts(width: int, block_size: int, steps: int) -> np.ndarray:
    """int64 `[W]`: `j * block_size - steps` for column j (column j is used when this is < num_history)."""
    out = np.arange(width, dtype=np.int64) * block_size - steps
    out.flags.writeable = False
    return out
