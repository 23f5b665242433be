"""Host side of the sampler: `HostBatch` validation (every error names the field), derived fields, variants, and
the device parameter block's staging (defaults on padded rows, the record layout the kernels index)."""
import numpy as np
import pytest
import torch

from modeling.sampler import HostBatch, RowSpec, SamplerParamError, SamplerParams, SamplerVariant
from modeling.sampler.host import TOP_P_ONE

V = 1000
CAPS = dict(vocab_size=V, max_bias=4, max_ban=3, max_penalty_tokens=8)


def build(*rows: RowSpec) -> HostBatch:
    return HostBatch.from_rows(list(rows), **CAPS)


@pytest.mark.parametrize("row,field", [
    (RowSpec(temperature=-0.5), "temperature"),
    (RowSpec(temperature=float("nan")), "temperature"),
    (RowSpec(top_k=-2), "top_k"),
    (RowSpec(top_k=1.5), "top_k"),
    (RowSpec(top_p=0.0), "top_p"),
    (RowSpec(top_p=1.2), "top_p"),
    (RowSpec(min_p=1.5), "min_p"),
    (RowSpec(min_p=-0.1), "min_p"),
    (RowSpec(seed=1 << 64), "seed"),
    (RowSpec(position=-1), "position"),
    (RowSpec(presence_penalty=2.5), "presence_penalty"),
    (RowSpec(frequency_penalty=float("inf")), "frequency_penalty"),
    (RowSpec(repetition_penalty=0.0), "repetition_penalty"),
    (RowSpec(logit_bias={5: 101.0}), "logit_bias"),
    (RowSpec(logit_bias={V: 1.0}), "logit_bias"),
    (RowSpec(logit_bias={i: 1.0 for i in range(5)}), "logit_bias"),
    (RowSpec(banned_ids=[1, 2, 3, 4]), "banned_ids"),
    (RowSpec(banned_ids=[-3]), "banned_ids"),
    (RowSpec(repetition_penalty=1.1, prompt_token_ids=[V + 1]), "prompt_token_ids"),
    (RowSpec(frequency_penalty=0.5, output_token_ids=list(range(9))), "prompt_token_ids/output_token_ids"),
])
def test_bad_rows_are_rejected_naming_the_field(row, field):
    with pytest.raises(SamplerParamError, match=f"row 1: {field}"):
        build(RowSpec(), row)


def test_bad_arrays_are_rejected_naming_the_field():
    good = build(RowSpec(temperature=1.0, top_p=0.5), RowSpec())
    fields = {k: getattr(good, k).copy() for k in {**HostBatch.SCALARS, **HostBatch.LISTS}}

    def broken(name, value):
        arrays = dict(fields)
        arrays[name] = value
        return lambda: HostBatch(**arrays, vocab_size=V)

    cases = [("temperature", np.array([1.0, -1.0], np.float32)), ("inv_temperature", np.array([2.0, 1.0], np.float32)),
             ("top_k", np.array([0, V], np.int32)), ("top_p_fixed", np.array([TOP_P_ONE, 0], np.int64)),
             ("log_min_p", np.array([0.5, 0.0], np.float32)), ("seed", np.array([1, 2], np.int32)),
             ("bias_ids", np.array([[1, 1, -1, -1], [-1] * 4], np.int32)),
             ("pen_ids", np.array([[3, -1, -1, -1, -1, -1, -1, 3], [-1] * 8], np.int32)),
             ("ban_ids", np.array([[V, -1, -1], [-1] * 3], np.int32)), ("top_p", np.zeros((3,), np.float32)),
             ("pen_counts", np.full((2, 8), -1, np.int32)), ("bias_vals", np.full((2, 4), np.nan, np.float32))]
    for name, value in cases:
        with pytest.raises(SamplerParamError, match=name):
            broken(name, value)()


def test_derived_fields_and_clamps():
    h = build(RowSpec(temperature=0.5, top_k=V, top_p=1.0, min_p=0.25, seed=-1, repetition_penalty=2.0,
                      presence_penalty=0.5, prompt_token_ids=[7, 7, 9], output_token_ids=[9, 9, 4]),
              RowSpec(temperature=1e-7, top_k=-1, top_p=0.9))
    assert h.inv_temperature[0] == np.float32(2.0) and h.temperature[1] == 0 and h.inv_temperature[1] == 1
    assert h.top_k.tolist() == [0, 0]  # k >= vocab and -1 are off
    assert h.top_p_fixed[0] == 0 and h.top_p_fixed[1] == round(0.9 * TOP_P_ONE)
    assert h.log_min_p[0] == np.float32(np.log(0.25)) and h.log_min_p[1] == -np.inf
    assert h.seed[0] == -1 and h.inv_repetition[0] == np.float32(0.5)
    ids, counts = h.pen_ids[0], h.pen_counts[0]
    got = {int(i): int(c) for i, c in zip(ids, counts) if i >= 0}
    assert got == {4: 1, 9: 2, 7: 0}  # output counts; prompt-only ids count 0
    assert (h.pen_ids[1] == -1).all()  # no penalty: no list


def test_variant_is_the_smallest_that_serves_the_batch():
    assert build(RowSpec(temperature=1.0), RowSpec()).variant() == SamplerVariant()
    assert build(RowSpec(top_k=5)).variant() == SamplerVariant()  # greedy rows ignore top-k
    v = build(RowSpec(temperature=1.0, top_k=5), RowSpec(temperature=1.0, top_p=0.5), RowSpec(banned_ids=[1])).variant()
    assert v == SamplerVariant(True, True, True)
    assert SamplerVariant.full().covers(v) and not SamplerVariant(top_p=True).covers(v)


def test_block_stages_rows_and_resets_padding():
    p = SamplerParams(4, "cpu", max_bias=4, max_ban=3, max_penalty_tokens=8)
    p.load(build(*[RowSpec(temperature=1.0, seed=10 + i, position=i, logit_bias={i: 2.0}) for i in range(3)]))
    assert p.seed.tolist() == [10, 11, 12, 0] and p.position.tolist() == [0, 1, 2, 0]
    assert p.bias_ids[:, 0].tolist() == [0, 1, 2, -1] and p.bias_vals[:3, 0].tolist() == [2.0] * 3
    p.load(build(RowSpec(temperature=0.5, top_k=3)))
    assert p.temperature.tolist() == [0.5, 0, 0, 0] and p.inv_temperature.tolist() == [2.0, 1, 1, 1]
    assert (p.bias_ids == -1).all() and p.top_k.tolist() == [3, 0, 0, 0]
    assert p.log_min_p.tolist() == [float("-inf")] * 4 and p.top_p.tolist() == [1.0] * 4
    # the kernels read fields through typed views of one 64-byte record per row
    assert p.scalars.shape == (4, 64) and p.scalars.view(torch.int32)[0, 9].item() == 3
    with pytest.raises(SamplerParamError, match="max_batch"):
        p.stage(build(*[RowSpec()] * 5))
