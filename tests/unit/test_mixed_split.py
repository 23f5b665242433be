"""`actors.mixed_split`: which rows of a chunked-prefill step run as its decode half, and the two halves' batches.
(The rank running them as two graph replays is the GPU tests', tests/gpu/test_mixed_split_gpu.py.)"""
import dataclasses

import numpy as np
import pytest

from actors.batch import SamplerExtras, StepBatch
from actors.mixed_split import decode_prefix, split_rows, splittable


def _batch(q: list[int], seed: int = 0) -> StepBatch:
    rng = np.random.default_rng(seed)
    toks = [[int(x) for x in rng.integers(0, 1000, n)] for n in q]
    hist = [int(x) for x in rng.integers(0, 300, len(q))]
    tables = [list(range(1 + 8 * i, 1 + 8 * i + 1 + (h + n) // 64)) for i, (h, n) in enumerate(zip(hist, q))]
    return StepBatch.from_sequences(toks, hist, tables, temperature=[0.0, 1.0] * (len(q) // 2) + [0.5] * (len(q) % 2),
                                    top_k=list(range(len(q))), top_p=[0.9] * len(q), seeds=list(range(len(q))))


@pytest.mark.parametrize("q,want", [([1, 1, 5], 2), ([1] * 7 + [300, 12], 7), ([1, 1, 1], 0), ([5, 1, 1], 0),
                                    ([1, 9, 1], 1), ([3], 0), ([1, 1], 0)])
def test_decode_prefix_counts_the_leading_one_token_rows_of_a_mixed_step(q, want):
    assert decode_prefix(_batch(q)) == want


def test_split_rows_gives_the_rows_and_tokens_of_each_half():
    b = _batch([1, 1, 1, 40, 1, 17], seed=3)
    head, tail = split_rows(b, 3)
    assert head.batch_size == 3 and tail.batch_size == 3
    assert head.num_tokens == 3 and tail.num_tokens == 58
    for name in ("q_seqlens", "num_history", "block_tables", "temperature", "top_k", "top_p", "seeds"):
        whole = getattr(b, name)
        np.testing.assert_array_equal(np.concatenate([getattr(head, name), getattr(tail, name)]), whole)
    np.testing.assert_array_equal(np.concatenate([head.token_ids, tail.token_ids]), b.token_ids)
    assert head.is_decoding and not tail.is_decoding
    head.validate(1000, 64)
    tail.validate(1000, 64)
    with pytest.raises(ValueError):
        split_rows(b, 0)
    with pytest.raises(ValueError):
        split_rows(b, 6)


def test_splittable_leaves_whole_what_must_run_as_one_step():
    b = _batch([1, 1, 30])
    assert splittable(b, has_observer=False, local_phase=True, enabled=True) == 2
    assert splittable(b, has_observer=False, local_phase=True, enabled=False) is None
    assert splittable(b, has_observer=True, local_phase=True, enabled=True) is None
    assert splittable(b, has_observer=False, local_phase=False, enabled=True) is None  # phase fixed across DP
    lp = dataclasses.replace(b, extras=SamplerExtras.off(3, 5))
    assert splittable(lp, has_observer=False, local_phase=True, enabled=True) is None
    with pytest.raises(ValueError):
        split_rows(lp, 2)
    assert splittable(_batch([1, 1, 1]), False, True, True) is None  # a decode step
    assert splittable(_batch([30, 1]), False, True, True) is None  # no decode rows first


def test_mixed_step_bench_runs_the_split_and_the_whole_step_side_by_side(tmp_path):
    """`bench.mixed_step --smoke` (CPU, qwen3-tiny): every chunk row times the three steps and the whole step, and
    its mixed batch is what the chunked scheduler sends (decode rows at the context first, then the chunk)."""
    import json

    from bench import mixed_step

    out = tmp_path / "m.json"
    got = mixed_step.main(["--smoke", "--out", str(out)])
    assert json.loads(out.read_text()) == got
    assert [r["chunk"] for r in got["rows"]] == [16, 48]
    for r in got["rows"]:
        assert all(r[f"{k}_ms"] > 0 for k in ("decode", "prefill", "mixed", "whole"))
        assert r["mixed_over_sum"] == round(r["mixed_ms"] / (r["decode_ms"] + r["prefill_ms"]), 3)
        assert r["mixed_paths"] == r["whole_paths"] == ["eager"]  # no graphs on CPU: the split is CUDA's


def test_mixed_step_bench_batches_are_the_chunked_schedulers_layout():
    from types import SimpleNamespace

    from bench.mixed_step import step_batches

    rt = SimpleNamespace(cfg=SimpleNamespace(block_size=16), kv_cache=SimpleNamespace(spec=SimpleNamespace(num_blocks=400)))
    b = step_batches(rt, 5, 100, 40, vocab=1000)
    m = b["mixed"]
    assert m.q_seqlens.tolist() == [1] * 5 + [40] and m.num_history.tolist() == [100] * 5 + [0]
    assert decode_prefix(m) == 5
    head, tail = split_rows(m, 5)
    np.testing.assert_array_equal(head.token_ids, b["decode"].token_ids)
    np.testing.assert_array_equal(tail.token_ids, b["prefill"].token_ids)
    tables = m.block_tables[m.block_tables > 0]
    assert len(set(tables.tolist())) == tables.size  # distinct blocks for every row
    m.validate(1000, 16)
