"""Host staging of the decode graphs' per-step fields: one device staging tensor, its host mirror, one transfer.

A model declares the per-step fields its decode graphs read (`StagingSpec`: `StagingField`s in order, and the
function that writes a decode step given as host arrays into them: `stage_decode`). `FullGraphRunner` makes one
`HostStaging` of that declaration per runner lifetime, sized at the largest decode bucket (`staging_for`), and
hands it to the model's `make_buffers`, whose graph buffers are its device views. This module is model-blind: it
knows dtypes, shapes and pad values, never what a field means.

Layout. Fields are packed in declared order, each row-major `[rows]` or `[rows, W]` (a block-table row, W =
`GraphMeta.max_blocks_per_seq`), into ONE int64 device tensor of `ceil(bytes / 8)` words; a field's dtype is at
most as wide as the one before it, so every field is naturally aligned and no byte lies between two fields. The
host mirror is an int64 tensor of the same words (pinned on CUDA). Bucket `p` reads rows [0, p) of every field;
its transfer (`copy_prefix(p)`) is the byte prefix that ends after row p - 1 of the LAST field: every earlier
field whole (their rows past p are not read by bucket p), then the last field's first p rows.

Streams and lifetimes. `copy_prefix` enqueues the one host-to-device transfer on the current stream (the rank's
forward stream) and records `copied` after it; the transfer reads the mirror when the stream reaches it, not when
it is enqueued. So the mirror is rewritten (`stage_decode`, `pad_rows`) only after `wait()`, or while the only
pending transfer is held behind a gate the host has not opened yet (`FullGraphRunner.arm`). Everything here lives
until the runner's `reset()` drops it (after a device synchronize). Host work only, except `copy_prefix` and
the padding fill of the device fields at construction (current stream).
"""
from __future__ import annotations

import collections
import math
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Optional

import torch

_DTYPES = (torch.int64, torch.int32)

# stage_decode(staging, token ids int64 `[n]` or None (leave them), cached tokens int32 `[n]`, block tables
# int32 `[n, W']` (W' <= W), block size): writes rows [0, n) of the host mirror's fields (`staging.host_fields`).
StageDecode = Callable[["HostStaging", Optional[Any], Any, Any, int], None]


@dataclass(frozen=True)
class StagingField:
    """One per-step field of the staging: `dtype` (torch.int64 or torch.int32) rows, each one value or, with
    `blocks=True`, one block-table row `[W]`. `pad`: the value of every element of a padding row (a row that
    must be harmless when a graph reads it)."""

    name: str
    dtype: torch.dtype
    pad: int = 0
    blocks: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.isidentifier() or self.name.startswith("_"):
            raise ValueError(f"staging field name {self.name!r} must be an identifier not starting with '_'")
        if self.dtype not in _DTYPES:
            raise ValueError(f"staging field {self.name!r}: dtype {self.dtype} is not torch.int64 or torch.int32")
        if isinstance(self.pad, bool) or not isinstance(self.pad, int):
            raise ValueError(f"staging field {self.name!r}: pad {self.pad!r} is not an int")
        info = torch.iinfo(self.dtype)
        if not info.min <= self.pad <= info.max:
            raise ValueError(f"staging field {self.name!r}: pad {self.pad} does not fit {self.dtype}")


@dataclass(frozen=True)
class StagingSpec:
    """A model's declaration of its decode staging: `fields` in layout order (non-increasing dtype width, unique
    names) and `stage_decode` (see `StageDecode`; None: the staging can only be padded and copied)."""

    fields: tuple[StagingField, ...]
    stage_decode: Optional[StageDecode] = None

    def __post_init__(self) -> None:
        fields = tuple(self.fields)
        object.__setattr__(self, "fields", fields)
        if not fields or not all(isinstance(f, StagingField) for f in fields):
            raise ValueError("a staging spec needs at least one field, every one a StagingField")
        names = [f.name for f in fields]
        if len(set(names)) != len(names):
            raise ValueError(f"staging field names repeat: {names}")
        for a, b in zip(fields, fields[1:]):
            if b.dtype.itemsize > a.dtype.itemsize:
                raise ValueError(f"staging field {b.name!r} ({b.dtype}) follows the narrower {a.name!r} ({a.dtype}): "
                                 "wider fields come first, so that no field needs alignment padding")
        if self.stage_decode is not None and not callable(self.stage_decode):
            raise ValueError("stage_decode must be callable or None")


class FieldLayout(NamedTuple):
    """Where one field lies in the staging tensor: byte offset, shape `[rows]` or `[rows, W]`, bytes."""

    name: str
    offset: int
    shape: tuple[int, ...]
    nbytes: int


class HostStaging:
    """The staging of one runner's decode graphs (see the module docstring): `rows` rows (the largest decode
    bucket), block-table rows `width` wide, on `device`.

    tensor: the int64 device staging tensor; mirror: the int64 host mirror of its words (pinned on CUDA);
    device_fields / host_fields: per field (attributes named as the spec's fields), a typed device view of
    `tensor` / numpy view of `mirror`, `[rows]` or `[rows, width]`; row_index: numpy int64 `[rows]` 0..rows-1
    (fancy indexing by row); copied: CUDA event recorded after each transfer (None on CPU).
    At construction the device fields hold padding rows and the mirror holds zeros."""

    def __init__(self, spec: StagingSpec, rows: int, width: int, device: torch.device | str):
        if rows < 1 or width < 1:
            raise ValueError(f"staging needs at least one row and one block per row, got {rows} x {width}")
        device = torch.device(device)
        self.spec, self.rows, self.width = spec, rows, width
        layout, offset = [], 0
        for f in spec.fields:
            shape = (rows, width) if f.blocks else (rows,)
            nbytes = math.prod(shape) * f.dtype.itemsize
            layout.append(FieldLayout(f.name, offset, shape, nbytes))
            offset += nbytes
        self.layout: tuple[FieldLayout, ...] = tuple(layout)
        words = -(-offset // 8)
        self.tensor = torch.zeros(words, dtype=torch.int64, device=device)
        self.mirror = torch.zeros(words, dtype=torch.int64, pin_memory=device.type == "cuda")
        dev, host = {}, {}
        for f, at in zip(spec.fields, layout):
            start = at.offset // f.dtype.itemsize
            count = at.nbytes // f.dtype.itemsize
            dev[f.name] = self.tensor.view(f.dtype)[start:start + count].view(at.shape)
            host[f.name] = self.mirror.view(f.dtype).numpy()[start:start + count].reshape(at.shape)
            if f.pad:
                dev[f.name].fill_(f.pad)
        names = [f.name for f in spec.fields]
        self.device_fields = collections.namedtuple("DeviceFields", names)(**dev)
        self.host_fields = collections.namedtuple("HostFields", names)(**host)
        self.row_index = torch.arange(rows, dtype=torch.int64).numpy()
        self.copied = torch.cuda.Event() if device.type == "cuda" else None
        self._pads = tuple((host[f.name], f.pad) for f in spec.fields)
        self._copy_views: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # bucket -> (device, mirror) bytes

    @property
    def nbytes(self) -> int:
        """Bytes of the device staging tensor (the fields, rounded up to whole int64 words)."""
        return self.tensor.numel() * 8

    def prefix_bytes(self, p: int) -> int:
        """Bytes of the transfer bucket `p` reads: every field but the last whole, the last one's first p rows."""
        last = self.layout[-1]
        return last.offset + p * (last.nbytes // self.rows)

    def wait(self) -> None:
        """Block the host until the latest transfer out of the mirror has run (no-op before the first, and on
        CPU), so the mirror may be rewritten."""
        if self.copied is not None:
            self.copied.synchronize()

    def pad_rows(self, lo: int, hi: int) -> None:
        """Rows [lo, hi) of every field of the mirror become padding rows (each field's `pad`). Host only; the
        precondition of a mirror rewrite (module docstring)."""
        if hi > lo:
            for view, pad in self._pads:
                view[lo:hi] = pad

    def stage_decode(self, ids: Optional[Any], num_history: Any, block_tables: Any, block_size: int, p: int) -> None:
        """Write a decode step given as host arrays into the mirror only (the spec's `stage_decode` writes rows
        [0, n), n = len(num_history)), then padding rows [n, p). Nothing is enqueued; the precondition of a
        mirror rewrite (module docstring)."""
        stage = self.spec.stage_decode
        if stage is None:
            raise ValueError("this staging spec declares no stage_decode")
        stage(self, ids, num_history, block_tables, block_size)
        self.pad_rows(int(num_history.shape[0]), p)

    def copy_prefix(self, p: int) -> None:
        """Enqueue the one host-to-device transfer of the mirror prefix bucket `p` reads (`prefix_bytes(p)`) on
        the current stream, then record `copied` (what `wait` waits for). Asynchronous on CUDA (pinned mirror);
        the views of each bucket are made once."""
        views = self._copy_views.get(p)
        if views is None:
            if not 1 <= p <= self.rows:
                raise ValueError(f"bucket {p} is outside the staging's rows [1, {self.rows}]")
            n = self.prefix_bytes(p)
            views = self._copy_views[p] = (self.tensor.view(torch.uint8)[:n], self.mirror.view(torch.uint8)[:n])
        views[0].copy_(views[1], non_blocking=True)
        copied = self.copied
        if copied is not None:
            copied.record()


def staging_for(model: Any, graph_meta: Any) -> Optional[HostStaging]:
    """The `HostStaging` of `model`'s declared `decode_staging` spec at `graph_meta`'s largest decode bucket and
    block-table width, on its device; None when the model declares none (it fills its own device buffers)."""
    spec = getattr(model, "decode_staging", None)
    if spec is None:
        return None
    return HostStaging(spec, graph_meta.max_batch_size, graph_meta.max_blocks_per_seq, graph_meta.device)
