"""The safetensors files of an HF checkpoint directory, read lazily: shard by shard, slice by slice.

`iter_checkpoint(directory)` yields `(HF name, CheckpointTensor)` one file at a time, each file closed
before the next opens. A `CheckpointTensor` knows its shape and dtype from the file header and reads
bytes only when indexed (`t[a:b]`, `t[:, a:b]`, `t[e]`, `t[...]`), so a weight loader that slices a full
tensor for its TP/EP rank reads only that slice, and a tensor nobody indexes (an expert of another EP
rank) is never read. Reads happen on the host, whatever `torch.device` context is active; the weight
loaders copy the slice into the (possibly CUDA) parameter.

With `model.safetensors.index.json` exactly the files its `weight_map` names are read; a missing file, a
tensor the index lists that its file lacks, or one a file holds that the index does not list is a
`CheckpointError` naming it.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator, Union

import torch
from safetensors import safe_open

from modeling.errors import CheckpointError

INDEX_FILE = "model.safetensors.index.json"

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}

_Index = Union[int, slice, type(Ellipsis)]


class CheckpointTensor:
    """A tensor in an open safetensors file, or a view of one (`view`), read only when indexed.

    `shape` / `dtype` come from the header. Indexing supports ints, step-1 slices (clamped like Python's)
    and one Ellipsis, and returns a CPU torch tensor (a view of the mapped file: copy it before the file
    closes). Valid while the file that `iter_checkpoint` yielded it from is open.
    """

    def __init__(self, source: Any, name: str, shape: tuple[int, ...], dtype: torch.dtype,
                 base: tuple[int | tuple[int, int], ...] | None = None):
        self._source = source
        self.name = name
        self.dtype = dtype
        # Per dimension of the stored tensor: an int (dimension fixed by a `view`) or a (start, stop) range.
        self._base = base if base is not None else tuple((0, n) for n in shape)
        self.shape = tuple(b[1] - b[0] for b in self._base if isinstance(b, tuple))

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for s in self.shape:
            n *= s
        return n

    def _compose(self, key: _Index | tuple[_Index, ...]) -> tuple[int | tuple[int, int], ...]:
        keys = key if isinstance(key, tuple) else (key,)
        if sum(k is Ellipsis for k in keys) > 1:
            raise IndexError(f"{self.name}: only one Ellipsis is allowed")
        if Ellipsis in keys:
            i = keys.index(Ellipsis)
            keys = keys[:i] + (slice(None),) * (len(self.shape) - len(keys) + 1) + keys[i + 1:]
        if len(keys) > len(self.shape):
            raise IndexError(f"{self.name}: {len(keys)} indices for a tensor of shape {self.shape}")
        out, free = [], 0
        for b in self._base:
            if not isinstance(b, tuple):
                out.append(b)
                continue
            start, stop = b
            k = keys[free] if free < len(keys) else slice(None)
            free += 1
            if isinstance(k, slice):
                if k.step not in (None, 1):
                    raise IndexError(f"{self.name}: slices with a step are not supported")
                lo, hi, _ = k.indices(stop - start)
                out.append((start + lo, start + max(lo, hi)))
            elif isinstance(k, int) and not isinstance(k, bool):
                n = stop - start
                if not -n <= k < n:
                    raise IndexError(f"{self.name}: index {k} out of range for size {n}")
                out.append(start + k % n)
            else:
                raise IndexError(f"{self.name}: unsupported index {k!r}")
        return tuple(out)

    def view(self, key: _Index | tuple[_Index, ...]) -> "CheckpointTensor":
        """The indexed part as another lazy tensor (nothing is read), e.g. one expert of a fused `[E, ...]` tensor."""
        return CheckpointTensor(self._source, self.name, (), self.dtype, self._compose(key))

    def __getitem__(self, key: _Index | tuple[_Index, ...]) -> torch.Tensor:
        parts = self._compose(key)
        index = tuple(slice(p[0], p[1]) if isinstance(p, tuple) else slice(p, p + 1) for p in parts)
        shape = tuple(p[1] - p[0] for p in parts if isinstance(p, tuple))
        if any(s.stop <= s.start for s in index):  # safetensors rejects empty ranges
            return torch.empty(shape, dtype=self.dtype)
        with torch.device("cpu"):  # safetensors builds its tensors with torch factories: never on the caller's device
            return self._source[index].reshape(shape)

    def __repr__(self) -> str:
        return f"CheckpointTensor({self.name!r}, shape={self.shape}, dtype={self.dtype})"


TensorLike = Union[torch.Tensor, CheckpointTensor]


def lazy_view(full: TensorLike, key: _Index | tuple[_Index, ...]) -> TensorLike:
    """`full[key]` without reading: a torch view for a tensor, the lazy tensor's `view` otherwise."""
    return full[key] if isinstance(full, torch.Tensor) else full.view(key)


def _read_index(directory: Path) -> dict[str, str]:
    path = directory / INDEX_FILE
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from e
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{path}: field 'weight_map' must be a non-empty object of tensor name -> file name")
    for name, fname in weight_map.items():
        if not isinstance(fname, str) or not fname or Path(fname).name != fname:
            raise CheckpointError(f"{path}: field 'weight_map' maps {name} to {fname!r}, not a file name in the "
                                  "checkpoint directory")
    return weight_map


def checkpoint_files(directory: str | Path) -> list[tuple[Path, frozenset[str] | None]]:
    """The safetensors files to read, each with the tensor names the index assigns it (None without an index:
    every `*.safetensors` file in the directory, whatever it holds). Raises CheckpointError naming a missing file."""
    d = Path(directory)
    if (d / INDEX_FILE).is_file():
        by_file: dict[str, set[str]] = {}
        for name, fname in _read_index(d).items():
            by_file.setdefault(fname, set()).add(name)
        absent = sorted(f for f in by_file if not (d / f).is_file())
        if absent:
            raise CheckpointError(f"{d / INDEX_FILE} names missing shard file(s): {', '.join(absent)}")
        return [(d / f, frozenset(names)) for f, names in sorted(by_file.items())]
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {d}")
    return [(f, None) for f in files]


def iter_checkpoint(directory: str | Path) -> Iterator[tuple[str, CheckpointTensor]]:
    """(HF name, lazy tensor) for every tensor of the checkpoint, file by file. Each file's mapping is released
    once the consumer drops that file's tensors (`load_tensors` drops each after loading it), before the next file
    is opened. Raises CheckpointError on index/file mismatches and on a tensor name that appears in two files."""
    seen: dict[str, Path] = {}
    for path, listed in checkpoint_files(directory):
        yield from _iter_file(path, listed, seen)  # a generator per file: its frame (and handle) dies with the file


def _iter_file(path: Path, listed: frozenset[str] | None, seen: dict[str, Path]) -> Iterator[tuple[str, CheckpointTensor]]:
    try:
        handle = safe_open(str(path), framework="pt", device="cpu")
    except Exception as e:  # safetensors raises its own error type for corrupt headers
        raise CheckpointError(f"{path.name}: not a readable safetensors file: {e}") from e
    with handle as fh:
        keys = list(fh.keys())
        if listed is not None:
            lacking = sorted(listed - set(keys))
            if lacking:
                raise CheckpointError(f"{INDEX_FILE} lists tensor {lacking[0]} in {path.name}, which does not hold "
                                      f"it ({len(lacking)} such tensor(s))")
            extra = sorted(set(keys) - listed)
            if extra:
                raise CheckpointError(f"{path.name} holds tensor {extra[0]}, which {INDEX_FILE} does not list for "
                                      f"it ({len(extra)} such tensor(s))")
        for key in keys:
            if key in seen:
                raise CheckpointError(f"tensor {key} appears in both {seen[key].name} and {path.name}")
            seen[key] = path
            sl = fh.get_slice(key)
            dtype = _DTYPES.get(sl.get_dtype())
            if dtype is None:
                raise CheckpointError(f"{key} in {path.name}: dtype {sl.get_dtype()} is not supported")
            item = key, CheckpointTensor(sl, key, tuple(sl.get_shape()), dtype)
            del sl
            yield item
            del item
