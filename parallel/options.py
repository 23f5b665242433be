"""`CommOptions`: how a deployment's ranks communicate (TP all-reduce, its fused add + RMSNorm kernel, the DeepEP
token cap), and the start-up check that every rank holds the same options. Built once on the driver
(`actors.environment.options_from_environ` reads the `GRAPHLINE_*` variables), sent to every rank with the
deployment config, handed to `parallel.groups.RankGroups`. Torch-free but for the gloo check."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

TP_ALLREDUCE_ENV = "GRAPHLINE_TP_ALLREDUCE"
TP_FUSED_KIND_ENV = "GRAPHLINE_TP_FUSED_KIND"
TP_FUSED_NORM_ENV = "GRAPHLINE_TP_FUSED_NORM"
DEEPEP_MAX_TOKENS_ENV = "GRAPHLINE_DEEPEP_MAX_TOKENS_PER_RANK"
TP_ALLREDUCE_MODES = ("auto", "nccl", "symm")
FUSED_KINDS = ("push", "pull")  # the fused all-reduce + add + RMSNorm kernels of `parallel.symm_fused`
DEFAULT_DEEPEP_MAX_TOKENS_PER_RANK = 256  # DeepEP low-latency tokens per rank


class CommOptionsError(ValueError):
    """A communication option (or the variable it came from) has a value outside its choices."""


class OptionsMismatchError(RuntimeError):
    """The ranks of a deployment hold different options (found before any collective)."""


@dataclass(frozen=True)
class CommOptions:
    """tp_allreduce: "auto" (the symmetric-memory one-shot all-reduce where every TP rank can), "nccl" (never) or
    "symm" (required). tp_fused_kind: the fused all-reduce + add + RMSNorm kernel, "push" or "pull".
    tp_fused_norm: False never fuses the add + RMSNorm into the TP all-reduce.
    deepep_max_tokens_per_rank: DeepEP's low-latency token cap per rank (sizes its RDMA buffer)."""

    tp_allreduce: str = "auto"
    tp_fused_kind: str = "push"
    tp_fused_norm: bool = True
    deepep_max_tokens_per_rank: int = DEFAULT_DEEPEP_MAX_TOKENS_PER_RANK

    def __post_init__(self) -> None:
        if self.tp_allreduce not in TP_ALLREDUCE_MODES:
            raise CommOptionsError(f"{TP_ALLREDUCE_ENV}={self.tp_allreduce!r}: expected one of "
                                   f"{', '.join(TP_ALLREDUCE_MODES)}")
        if self.tp_fused_kind not in FUSED_KINDS:
            raise CommOptionsError(f"{TP_FUSED_KIND_ENV}={self.tp_fused_kind!r}: expected one of "
                                   f"{', '.join(FUSED_KINDS)}")
        if not isinstance(self.tp_fused_norm, bool):
            raise CommOptionsError(f"tp_fused_norm ({TP_FUSED_NORM_ENV}) must be a bool, got {self.tp_fused_norm!r}")
        cap = self.deepep_max_tokens_per_rank
        if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
            raise CommOptionsError(f"{DEEPEP_MAX_TOKENS_ENV}={cap!r} must be an integer >= 1")


def options_record(**options: Any) -> dict[str, dict[str, Any]]:
    """`{name: {field: value}}` of frozen option dataclasses, the form `check_same_options` compares."""
    return {name: dataclasses.asdict(o) for name, o in options.items()}


def describe_mismatch(records: list[Mapping[str, Mapping[str, Any]]]) -> list[str]:
    """One line per option field whose value differs between the ranks of `records` (rank r's record at index r):
    `"kernels.pdl: rank 0 '0'; ranks 1, 2 'early'"`. Empty when all agree."""
    lines = []
    names = sorted({name for rec in records for name in rec})
    for name in names:
        fields = sorted({f for rec in records for f in rec.get(name, {})})
        for f in fields:
            by_value: dict[str, list[int]] = {}
            for r, rec in enumerate(records):
                by_value.setdefault(repr(rec.get(name, {}).get(f, "<missing>")), []).append(r)
            if len(by_value) > 1:
                parts = [f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))} {v}" for v, rs in by_value.items()]
                lines.append(f"{name}.{f}: " + "; ".join(parts))
    return lines


def check_same_options(group: Any, record: Mapping[str, Mapping[str, Any]]) -> None:
    """Every rank of `group` (a gloo group: host objects only, no device collective) passes its `options_record`;
    raises `OptionsMismatchError` on every rank, naming each differing field and the ranks (group ranks) holding
    each value, when they do not all agree."""
    import torch.distributed as dist

    records: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(records, dict(record), group=group)
    lines = describe_mismatch(records)
    if lines:
        raise OptionsMismatchError("the ranks hold different options (each must get the driver's): "
                                   + " | ".join(lines))
