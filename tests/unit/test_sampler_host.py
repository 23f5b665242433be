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


def _from_arrays_validated(temperature, top_k, top_p, seed, position, *, vocab_size, min_p=None, penalties=None,
                           bias_ids=None, bias_vals=None, ban_ids=None, pen_ids=None, pen_counts=None):
    """`host_batch_from_arrays` as it was before its fast path: every field derived in full, `validate` always run
    (the reference its shortcut must match field for field, and error for error)."""
    from modeling.sampler.host import TEMPERATURE_EPS
    n = int(temperature.shape[0])
    t = np.asarray(temperature, np.float32)
    t = np.where(t < TEMPERATURE_EPS, np.float32(0), t).astype(np.float32)
    k = np.asarray(top_k).astype(np.int64)
    p = np.asarray(top_p, np.float32)
    fixed = np.maximum(1, np.rint(p.astype(np.float64) * TOP_P_ONE)).astype(np.int64)
    mp = np.zeros(n, np.float32) if min_p is None else np.asarray(min_p, np.float32)
    pen = np.tile(np.array([0.0, 0.0, 1.0], np.float32), (n, 1)) if penalties is None else \
        np.asarray(penalties, np.float32)
    with np.errstate(divide="ignore"):
        log_mp = np.where(mp > 0, np.log(np.maximum(mp, np.float32(1e-38))), -np.inf).astype(np.float32)

    def lists(a, dtype, fill):
        return np.full((n, 1), fill, dtype) if a is None else np.ascontiguousarray(a, dtype)

    return HostBatch(
        temperature=t, inv_temperature=np.where(t > 0, np.float32(1) / np.maximum(t, np.float32(1e-30)),
                                                np.float32(1)).astype(np.float32),
        top_k=np.where((k < 0) | (k >= vocab_size), 0, k).astype(np.int32), top_p=p,
        top_p_fixed=np.where(fixed >= TOP_P_ONE, 0, fixed).astype(np.int64), min_p=mp, log_min_p=log_mp,
        seed=np.asarray(seed).astype(np.int64), position=np.asarray(position).astype(np.int64),
        presence=np.ascontiguousarray(pen[:, 0]), frequency=np.ascontiguousarray(pen[:, 1]),
        repetition=np.ascontiguousarray(pen[:, 2]), inv_repetition=(np.float32(1) / pen[:, 2]).astype(np.float32),
        bias_ids=lists(bias_ids, np.int32, -1), bias_vals=lists(bias_vals, np.float32, 0.0),
        ban_ids=lists(ban_ids, np.int32, -1), pen_ids=lists(pen_ids, np.int32, -1),
        pen_counts=lists(pen_counts, np.int32, 0), vocab_size=vocab_size)


def _random_step_arrays(rng, n: int, sampled: bool, extras: bool, lists: bool, width: int) -> dict:
    """A step's sampling arrays as a rank receives them: greedy or sampled rows, edge values included (temperatures
    below TEMPERATURE_EPS and negative, top_k -1 / 0 / >= vocab, top_p 1 and just below, min_p 0 and 1)."""
    t = rng.choice(np.float32([0.0, 1e-6, -1.0, 0.5, 1.0, 2.0]), n) if sampled else np.zeros(n, np.float32)
    kw = dict(temperature=t, top_k=rng.choice(np.int32([-1, 0, 0, 5, 200, V, V + 3]), n).astype(np.int32),
              top_p=rng.choice(np.float32([1.0, 0.9, 0.99999994, 1e-7]), n), seed=rng.integers(-5, 5, n),
              position=rng.integers(0, 4096, n), vocab_size=V)
    if extras:
        kw["min_p"] = rng.choice(np.float32([0.0, 0.0, 0.05, 1.0]), n)
        kw["penalties"] = np.tile(np.float32([0, 0, 1]), (n, 1))
        kw["penalties"][rng.random(n) < 0.3] = (0.5, -1.5, 1.2)
    if lists:
        ids = np.full((n, width), -1, np.int32)
        for i in range(n):  # distinct ids per row
            m = int(rng.integers(0, width + 1))
            ids[i, :m] = rng.choice(V, m, replace=False)
        kw.update(bias_ids=ids, bias_vals=rng.uniform(-100, 100, (n, width)).astype(np.float32), ban_ids=ids.copy(),
                  pen_ids=ids.copy(), pen_counts=rng.integers(0, 3, (n, width)).astype(np.int32))
    return kw


@pytest.mark.parametrize("sampled,extras,lists,width", [(False, True, False, 1), (True, False, False, 1),
                                                        (True, True, True, 1), (True, True, True, 4),
                                                        (True, True, True, 0)])
def test_from_arrays_matches_the_validated_construction(sampled, extras, lists, width):
    """The rank's `host_batch_from_arrays` (a shortcut past `validate` for plainly valid steps) yields every field
    bit for bit and dtype for dtype as the construction that always validated."""
    from modeling.sampler.host import host_batch_from_arrays
    rng = np.random.default_rng(width + 10 * sampled + 100 * lists)
    for n in (1, 7, 64):
        kw = _random_step_arrays(rng, n, sampled, extras, lists, width)
        got, want = host_batch_from_arrays(**kw), _from_arrays_validated(**kw)
        for name in {**HostBatch.SCALARS, **HostBatch.LISTS}:
            a, b = getattr(got, name), getattr(want, name)
            assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), name
        assert got.vocab_size == want.vocab_size and got.variant() == want.variant()


@pytest.mark.parametrize("field,bad", [
    ("temperature", np.nan), ("temperature", np.inf), ("top_p", 0.0), ("top_p", 1.5), ("top_p", np.nan),
    ("min_p", -0.5), ("min_p", 2.0), ("position", -1), ("presence", 2.5), ("frequency", np.nan),
    ("repetition", 0.0), ("repetition", np.inf), ("repetition", 1e-45), ("bias_vals", 100.5), ("bias_ids", V),
    ("bias_ids", -2), ("ban_ids", V), ("pen_ids", -7), ("pen_counts", -1), ("bias_ids", "dup"), ("pen_ids", "dup")])
def test_from_arrays_rejects_what_validate_rejects(field, bad):
    """A bad value anywhere takes `validate`'s path: the same `SamplerParamError` (row and field) as before."""
    from modeling.sampler.host import host_batch_from_arrays
    kw = _random_step_arrays(np.random.default_rng(3), 8, True, True, True, 4)
    row = 5
    if field in ("presence", "frequency", "repetition"):
        kw["penalties"][row, ("presence", "frequency", "repetition").index(field)] = bad
    elif bad == "dup":
        kw[field][row, :2] = 17
    elif field in ("bias_vals",):
        kw[field][row, 0] = bad
    elif field in ("bias_ids", "ban_ids", "pen_ids", "pen_counts"):
        kw[field][row, 0] = bad
    else:
        kw[field] = kw[field].copy()
        kw[field][row] = bad
    with pytest.raises(SamplerParamError) as want:
        _from_arrays_validated(**kw)
    with pytest.raises(SamplerParamError) as got:
        host_batch_from_arrays(**kw)
    assert str(got.value) == str(want.value) and f"row {row}" in str(got.value)


@pytest.mark.parametrize("seed", range(6))
def test_variant_and_processed_match_their_reductions(seed):
    """`HostBatch.variant` and `SamplerExtras.processed` (max-based shortcuts) decide as the plain reductions do."""
    from actors.batch import SamplerExtras
    from modeling.sampler.host import TOP_K_FAST, host_batch_from_arrays
    rng = np.random.default_rng(seed)
    for n in (1, 5, 64):
        kw = _random_step_arrays(rng, n, seed % 2 == 0, True, seed % 3 != 2, int(rng.integers(0, 3)))
        if seed % 3 == 1 and "bias_ids" in kw:  # lists present but unused
            for name in ("bias_ids", "ban_ids", "pen_ids"):
                kw[name][:] = -1
        h = host_batch_from_arrays(**kw)
        sampled = h.temperature > 0
        want = SamplerVariant(processed=bool((h.bias_ids >= 0).any() or (h.ban_ids >= 0).any()
                                             or (h.pen_ids >= 0).any()),
                              top_k=bool((sampled & (h.top_k > 0)).any()), top_p=bool((sampled & (h.top_p_fixed > 0)).any()),
                              large_top_k=bool((sampled & (h.top_k > TOP_K_FAST)).any()))
        assert h.variant() == want
        if "bias_ids" in kw:
            ex = SamplerExtras(kw["min_p"], kw["penalties"], kw["bias_ids"], kw["bias_vals"], kw["ban_ids"],
                               kw["pen_ids"], kw["pen_counts"], 5)
            p = ex.penalties
            assert ex.processed == bool((ex.bias_ids >= 0).any() or (ex.ban_ids >= 0).any() or (p[:, 0] != 0).any()
                                        or (p[:, 1] != 0).any() or (p[:, 2] != 1).any())
