"""The device-side sampling parameter block: preallocated tensors of `max_batch` rows at fixed addresses, filled
by one host-to-device copy per step from a pinned staging buffer, so a captured graph reads them by address.

Layout (both sections row-major, one record per row, so the first `n` rows are one contiguous copy):
- scalars: `[max_batch, 64]` bytes; fp32 at 4-byte columns `F_*`, int32 `top_k` at column `I_TOP_K`, int64 at
  8-byte columns `Q_*` (the kernels index the record through fp32 / int32 / int64 views of it).
- lists: `[max_batch, W]` int32 (fp32 views for `bias_vals`), W = 2 * max_bias + max_ban + 2 * max_penalty_tokens:
  bias ids, bias values, banned ids, penalised ids, their output counts; -1 = unused id.

Lifetime and streams: `stage(host)` writes the next of `MIRRORS` pinned mirrors (it waits for the upload that last
read that mirror, a host wait only when that copy is still in flight, so steps staged ahead rarely wait);
`upload(rows, lists)` enqueues the copy on the current stream, so kernels launched after it on that stream (or a
graph replayed on it) see the new values. Rows past the staged batch are reset to harmless defaults (greedy, no
lists). The list section is copied only when `lists=True` (a step whose variant is `processed`); stale lists are
never read by unprocessed variants.
An armed step (`actors.armed`) enqueues its upload before its rows are known (`arm_upload`, behind a closed gate)
and writes them into that upload's mirror at go time (`stage_armed`), before the gate opens.

Allow masks (structured outputs, `HostBatch.allow_bits`): a section of their own, `allow_bits` int32
`[max_batch, W]`, allocated (device and each pinned mirror) at the first step that stages one, copied with the
lists for steps that have one (`masked`); steps without a mask allocate, write and copy nothing for it.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from .host import HostBatch, SamplerParamError

REC_BYTES = 64
# 4-byte columns of the scalar record
F_TEMPERATURE, F_INV_T, F_TOP_P, F_MIN_P, F_LOG_MIN_P, F_PRESENCE, F_FREQUENCY, F_REPETITION, F_INV_REP = range(9)
I_TOP_K = 9
# 8-byte columns of the scalar record
Q_SEED, Q_POSITION, Q_TOP_P_FIXED = 5, 6, 7

_F_COLS = {"temperature": F_TEMPERATURE, "inv_temperature": F_INV_T, "top_p": F_TOP_P, "min_p": F_MIN_P,
           "log_min_p": F_LOG_MIN_P, "presence": F_PRESENCE, "frequency": F_FREQUENCY, "repetition": F_REPETITION,
           "inv_repetition": F_INV_REP}
_Q_COLS = {"seed": Q_SEED, "position": Q_POSITION, "top_p_fixed": Q_TOP_P_FIXED}
_DEFAULTS_F = {"temperature": 0.0, "inv_temperature": 1.0, "top_p": 1.0, "min_p": 0.0, "log_min_p": -np.inf,
               "presence": 0.0, "frequency": 0.0, "repetition": 1.0, "inv_repetition": 1.0}


class ListLayout:
    """Column offsets (int32 units) of the per-row list record."""

    def __init__(self, max_bias: int, max_ban: int, max_penalty_tokens: int) -> None:
        if min(max_bias, max_ban, max_penalty_tokens) < 1:
            raise SamplerParamError("max_bias, max_ban and max_penalty_tokens must be >= 1")
        self.max_bias, self.max_ban, self.max_pen = max_bias, max_ban, max_penalty_tokens
        self.bias_ids = 0
        self.bias_vals = max_bias
        self.ban_ids = 2 * max_bias
        self.pen_ids = 2 * max_bias + max_ban
        self.pen_counts = self.pen_ids + max_penalty_tokens
        self.width = self.pen_counts + max_penalty_tokens


def _default_lists(layout: ListLayout) -> np.ndarray:
    row = np.zeros(layout.width, np.int32)
    row[layout.bias_ids: layout.bias_vals] = -1
    row[layout.ban_ids: layout.pen_counts] = -1
    return row


MIRRORS = 4  # pinned host mirrors per parameter block (CUDA): steps staged ahead of the device


class _Mirror:
    """One pinned host copy of the parameter records and the event of the last upload that read it."""

    def __init__(self, rows: int, width: int, pin: bool) -> None:
        self.scalars = torch.zeros((rows, REC_BYTES), dtype=torch.uint8, pin_memory=pin)
        self.lists = torch.zeros((rows, width), dtype=torch.int32, pin_memory=pin)
        self.scalars_np, self.lists_np = self.scalars.numpy(), self.lists.numpy()
        self.dirty = rows  # rows [0, dirty) may hold non-default values
        # the `stage` caller's key of rows [0, dirty) (equal keys: equal rows but for their positions); None: unknown
        self.rows_key = None
        self.copied = torch.cuda.Event() if pin else None
        self.pending = False
        # the allow mask (`[rows, W]` int32, made at the first staged mask) and how many rows of it the staged step
        # holds (0: the step has no mask)
        self.bits: Optional[torch.Tensor] = None
        self.bits_np: Optional[np.ndarray] = None
        self.bits_rows = 0
        self.pin = pin

    def wait(self) -> None:
        if self.pending:
            self.copied.synchronize()
            self.pending = False


class SamplerParams:
    """Device parameter block. Views (all `[max_batch]` or `[max_batch, W]`, strided into the records):
    temperature, inv_temperature, top_p, min_p, log_min_p, presence, frequency, repetition, inv_repetition
    (fp32), top_k (int32), seed, position, top_p_fixed (int64); bias_ids, ban_ids, pen_ids, pen_counts (int32),
    bias_vals (fp32). `scalars` / `lists` are the raw device records the kernels take. `allow_bits`: int32
    `[max_batch, W]` (None before the first masked step); `masked`: whether the last upload carried one (the
    processed kernels then apply it to rows [0, B))."""

    def __init__(self, max_batch: int, device: torch.device | str, *, max_bias: int = 32, max_ban: int = 8,
                 max_penalty_tokens: int = 2048) -> None:
        if max_batch < 1:
            raise SamplerParamError(f"max_batch must be >= 1, got {max_batch}")
        self.device = torch.device(device)
        self.max_batch = max_batch
        self.layout = ListLayout(max_bias, max_ban, max_penalty_tokens)
        pin = self.device.type == "cuda"
        self.scalars = torch.zeros((max_batch, REC_BYTES), dtype=torch.uint8, device=self.device)
        self.lists = torch.zeros((max_batch, self.layout.width), dtype=torch.int32, device=self.device)
        self._default_lists = _default_lists(self.layout)
        self.allow_bits: Optional[torch.Tensor] = None
        self.masked = False
        # a ring of pinned mirrors: staging the next step never waits for the upload of the one before it
        self._mirrors = [_Mirror(max_batch, self.layout.width, pin) for _ in range(MIRRORS if pin else 1)]
        self._cur = 0
        self._row_views: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}  # (mirror, rows) -> `upload`'s slices
        for m in self._mirrors:
            self._reset_rows(m, 0, max_batch)
        self.upload(max_batch, lists=True)
        self._bind_views()

    # ---- views --------------------------------------------------------------------------------------------
    def _bind_views(self) -> None:
        f = self.scalars.view(torch.float32)
        q = self.scalars.view(torch.int64)
        for name, col in _F_COLS.items():
            setattr(self, name, f[:, col])
        self.top_k = self.scalars.view(torch.int32)[:, I_TOP_K]
        for name, col in _Q_COLS.items():
            setattr(self, name, q[:, col])
        lay, li = self.layout, self.lists
        self.bias_ids = li[:, lay.bias_ids: lay.bias_vals]
        self.bias_vals = li.view(torch.float32)[:, lay.bias_vals: lay.ban_ids]
        self.ban_ids = li[:, lay.ban_ids: lay.pen_ids]
        self.pen_ids = li[:, lay.pen_ids: lay.pen_counts]
        self.pen_counts = li[:, lay.pen_counts: lay.width]

    # ---- host side ----------------------------------------------------------------------------------------
    def _reset_rows(self, m: "_Mirror", lo: int, hi: int) -> None:
        if hi <= lo:
            return
        f = m.scalars_np.view(np.float32)
        m.scalars_np[lo:hi] = 0
        for name, col in _F_COLS.items():
            f[lo:hi, col] = _DEFAULTS_F[name]
        m.lists_np[lo:hi] = self._default_lists

    def stage(self, host: HostBatch, rows_key: object = None) -> None:
        """Write `host` (n <= max_batch rows) into the next pinned mirror of the ring; rows [n, max_batch) become
        defaults. Waits (on the host) only for the upload that last read that mirror, `MIRRORS` uploads ago.
        `rows_key` (not None): the caller's promise that rows staged under an equal key differ from `host` in
        their positions alone; a mirror that holds such rows (n of them) gets only the positions written."""
        self._check(host)
        self._cur = (self._cur + 1) % len(self._mirrors)
        m = self._mirrors[self._cur]
        m.wait()
        self._write_rows(m, host, rows_key)

    def _write_rows(self, m: "_Mirror", host: HostBatch, rows_key: object) -> None:
        if rows_key is not None and m.rows_key == rows_key and m.dirty == host.n:
            m.scalars_np.view(np.int64)[:host.n, Q_POSITION] = host.position
            return
        self._write(m, host)
        m.rows_key = rows_key

    def _check(self, host: HostBatch) -> None:
        n = host.n
        if n > self.max_batch:
            raise SamplerParamError(f"batch of {n} rows exceeds max_batch {self.max_batch}")
        lay = self.layout
        widths = {"bias_ids": lay.max_bias, "ban_ids": lay.max_ban, "pen_ids": lay.max_pen}
        for name, w in widths.items():
            if getattr(host, name).shape[1] > w:
                raise SamplerParamError(f"{name}: {getattr(host, name).shape[1]} columns exceed the block's {w}")

    def _write(self, m: "_Mirror", host: HostBatch) -> None:
        """Rows [0, n) of mirror `m` from `host`, rows [n, dirty) back to defaults (host only, no wait)."""
        n = host.n
        lay = self.layout
        hs = m.scalars_np
        f = hs.view(np.float32)
        q = hs.view(np.int64)
        for name, col in _F_COLS.items():
            f[:n, col] = getattr(host, name)
        hs.view(np.int32)[:n, I_TOP_K] = host.top_k
        for name, col in _Q_COLS.items():
            q[:n, col] = getattr(host, name)
        hl, hlf = m.lists_np, m.lists_np.view(np.float32)
        hl[:n] = self._default_lists
        hl[:n, lay.bias_ids: lay.bias_ids + host.bias_ids.shape[1]] = host.bias_ids
        hlf[:n, lay.bias_vals: lay.bias_vals + host.bias_vals.shape[1]] = host.bias_vals
        hl[:n, lay.ban_ids: lay.ban_ids + host.ban_ids.shape[1]] = host.ban_ids
        hl[:n, lay.pen_ids: lay.pen_ids + host.pen_ids.shape[1]] = host.pen_ids
        hl[:n, lay.pen_counts: lay.pen_counts + host.pen_counts.shape[1]] = host.pen_counts
        self._reset_rows(m, n, m.dirty)
        m.dirty, m.rows_key = n, None
        bits = host.allow_bits
        m.bits_rows = 0 if bits is None else n
        if bits is not None:
            if m.bits is None or m.bits.shape[1] != bits.shape[1]:
                m.bits = torch.empty((self.max_batch, bits.shape[1]), dtype=torch.int32, pin_memory=m.pin)
                m.bits_np = m.bits.numpy()
            m.bits_np[:n] = bits

    def upload(self, rows: Optional[int] = None, *, lists: bool = True) -> None:
        """Copy rows [0, rows) (default: max_batch) of the mirror to the device on the current stream; with the
        lists, the staged step's allow mask when it has one (`masked`)."""
        rows = self.max_batch if rows is None else rows
        if not 0 < rows <= self.max_batch:
            raise SamplerParamError(f"rows must be in [1, {self.max_batch}], got {rows}")
        nb = self.device.type == "cuda"
        m = self._mirrors[self._cur]
        views = self._row_views.get((self._cur, rows))
        if views is None:  # (device, mirror) row slices of both sections: made once per mirror and row count
            views = self._row_views[(self._cur, rows)] = (self.scalars[:rows], m.scalars[:rows], self.lists[:rows],
                                                          m.lists[:rows])
        views[0].copy_(views[1], non_blocking=nb)
        if lists:
            views[2].copy_(views[3], non_blocking=nb)
        self.masked = lists and m.bits_rows > 0
        if self.masked:
            if self.allow_bits is None or self.allow_bits.shape[1] != m.bits.shape[1]:
                self.allow_bits = torch.full((self.max_batch, m.bits.shape[1]), -1, dtype=torch.int32,
                                             device=self.device)
            r = min(rows, m.bits_rows)
            self.allow_bits[:r].copy_(m.bits[:r], non_blocking=nb)
        if nb:
            m.copied.record()
            m.pending = True

    # ---- armed uploads (`actors.armed`): the copy is enqueued behind a closed gate, its rows written later
    def arm_upload(self, rows: int) -> int:
        """Take the next mirror of the ring (waiting, on the host, for the upload that last read it) and enqueue
        its copy of rows [0, rows) to the device (scalars only: the captured heads read no lists) on the current
        stream, behind whatever holds that stream (a closed gate). The mirror keeps the rows it holds (valid rows:
        defaults or an earlier step's, what a cancelled arm's padding replay samples, its outputs dropped). The
        copy reads the pinned mirror when the stream reaches it, so `stage_armed` may still write the live rows
        into it until the gate opens. Returns the mirror's slot. Until the gate opens nothing else may stage
        (nothing does: the rank takes or cancels an arm before any other step)."""
        self._cur = (self._cur + 1) % len(self._mirrors)
        m = self._mirrors[self._cur]
        m.wait()
        self.upload(rows, lists=False)
        return self._cur

    def stage_armed(self, slot: int, host: HostBatch, rows_key: object = None) -> None:
        """Write `host` into mirror `slot` of an `arm_upload` whose copy still waits behind a closed gate (no
        wait: that copy's event is behind the gate too). Host only; open the gate after it. `rows_key`: as in
        `stage` (a mirror holding rows of an equal key gets only the positions written)."""
        self._check(host)
        self._write_rows(self._mirrors[slot], host, rows_key)

    def load(self, host: HostBatch, rows: Optional[int] = None) -> None:
        """`stage(host)` then `upload(rows or max_batch)`, copying the lists only when the batch needs them."""
        self.stage(host)
        self.upload(rows, lists=host.variant().processed or rows is None)
