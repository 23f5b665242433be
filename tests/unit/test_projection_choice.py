"""The decode projection kernel choice (`modeling/ops/projection_choice.py`): the tuning table first, else the
fallback chosen on the device (the faster of cuBLAS and the safe generic config, from the disk cache or measured),
else the safe config; the cache (keyed by GPU, versions, dtype, PDL mode and shape; atomic writes; corrupt files
ignored and rewritten); the GPU glue (`triton_gemm_measure`) with the device stubbed; and the model hands every
(N, K) it has to the measurement at warm-up. CPU only (the GPU measurement itself:
tests/gpu/test_projection_measure.py)."""
import contextlib
import dataclasses
import json

import pytest
import torch

from modeling.config import get_preset
from modeling.ops import get_kernel_ops
from modeling.ops import projection_choice as pc
from modeling.qwen3 import Qwen3ForCausalLM

TABLE = {(4096, 1024, 1): None, (1024, 2048, 4): (32, 128, 8, 4, 3)}
SAFE = (16, 256, 2, 4, 3)
CTX = pc.MeasureContext(gpu="NVIDIA H200", torch="2.13.0", cuda="12.8", triton="3.9.0", dtype="bfloat16", pdl=2)


@pytest.fixture(autouse=True)
def _own_fallbacks(monkeypatch):
    monkeypatch.setattr(pc, "_FALLBACKS", {})


def _never(*args):
    raise AssertionError("evaluated although the table or the cache decides")


class Timer:
    """A fake `measure`: cuBLAS wins on N >= 4096, the safe config elsewhere; counts its calls."""

    def __init__(self):
        self.calls = []

    def __call__(self, n, k, mc, cfg):
        self.calls.append((n, k, mc, cfg))
        return (4e-6, 5e-6) if n >= 4096 else (6e-6, 5e-6)


def _safe(n, k, mc):
    return SAFE


def test_table_entries_win_without_touching_the_device_or_the_fallback():
    assert pc.choose(4096, 1024, 1, TABLE, _never, _never) == pc.Choice("cublas", None, "table")
    for m in (2, 3, 4):  # row class 4
        assert pc.choose(1024, 2048, m, TABLE, _never, _never) == pc.Choice("skinny", (32, 128, 8, 4, 3), "table")
    pc.record(0, 4096, 1024, 1, pc.decide(9.0, 1.0, SAFE))  # a tabled shape: the table still decides
    assert pc.choose(4096, 1024, 1, TABLE, _never, lambda: 0).kernel == "cublas"


def test_untabled_shapes_take_the_chosen_fallback_else_the_safe_config():
    assert pc.choose(3072, 1024, 5, TABLE, lambda: SAFE, lambda: 0) == pc.Choice("skinny", SAFE, "safe")
    pc.record(0, 3072, 1024, 16, pc.decide(cublas_s=4e-6, safe_s=5e-6, safe_config=SAFE))
    assert pc.choose(3072, 1024, 5, TABLE, _never, lambda: 0) == pc.Choice("cublas", None, "measured")
    assert pc.choose(3072, 1024, 16, TABLE, _never, lambda: 0).kernel == "cublas"
    assert pc.choose(3072, 1024, 3, TABLE, lambda: SAFE, lambda: 0).source == "safe"  # another row class
    assert pc.choose(3072, 1024, 5, TABLE, lambda: SAFE, lambda: 1).source == "safe"  # another device
    pc.record(1, 3072, 1024, 16, pc.decide(cublas_s=6e-6, safe_s=5e-6, safe_config=SAFE))
    assert pc.choose(3072, 1024, 9, TABLE, _never, lambda: 1) == pc.Choice("skinny", SAFE, "measured")
    assert set(pc.fallbacks()) == {(0, 3072, 1024, 16), (1, 3072, 1024, 16)}
    pc.clear_fallbacks()
    assert pc.fallbacks() == {}


def test_row_classes_32_and_64_take_the_table_else_cublas_never_the_safe_config_or_a_measurement():
    table = {**TABLE, (3072, 1024, 64): (32, 128, 4, 4, 4)}
    for m in (17, 24, 32, 33, 48):  # classes 32 and 64, untabled for class 32
        want = pc.Choice("skinny", (32, 128, 4, 4, 4), "table") if m > 32 else pc.Choice("cublas", None, "untabled")
        assert pc.choose(3072, 1024, m, table, _never, _never) == want
    assert not pc.needs_choice(0, 3072, 1024, 32, table) and pc.needs_choice(0, 3072, 1024, 16, table)
    with pytest.raises(ValueError, match="row class 32"):
        pc.record(0, 3072, 1024, 32, pc.decide(1.0, 2.0, SAFE))
    timer = Timer()
    assert pc.resolve([(3072, 1024, 32), (3072, 1024, 64)], 0, CTX, table, _safe, timer, None) == {}


def test_decide_prefers_cublas_unless_the_safe_config_is_strictly_faster():
    assert pc.decide(5e-6, 5e-6, SAFE).kernel == "cublas"
    assert pc.decide(5e-6, 4.9e-6, SAFE) == pc.Choice("skinny", SAFE, "measured")


def test_only_chosen_fallbacks_of_known_row_classes_are_recorded():
    with pytest.raises(ValueError, match="row class 8"):
        pc.record(0, 1, 1, 8, pc.decide(1.0, 2.0, SAFE))
    with pytest.raises(ValueError, match="not a measured"):
        pc.record(0, 1, 1, 4, pc.Choice("cublas", None, "table"))
    assert pc.needs_choice(0, 3072, 1024, 4, TABLE) and not pc.needs_choice(0, 4096, 1024, 1, TABLE)
    assert [pc.m_class(m) for m in (1, 2, 4, 5, 16, 17, 32, 33, 64)] == [1, 4, 4, 16, 16, 32, 32, 64, 64]


def test_missing_shapes_are_measured_once_recorded_and_cached(tmp_path):
    path = tmp_path / "sub" / "choice.json"  # the directory does not exist yet
    timer = Timer()
    wanted = [(4096, 1024, 1), (3072, 1024, 4), (8192, 1024, 16), (3072, 1024, 4)]  # tabled, 2 new, a repeat
    done = pc.resolve(wanted, 0, CTX, TABLE, _safe, timer, path)
    assert done == {(3072, 1024, 4): pc.Choice("skinny", SAFE, "measured"),
                    (8192, 1024, 16): pc.Choice("cublas", None, "measured")}
    assert timer.calls == [(3072, 1024, 4, SAFE), (8192, 1024, 16, SAFE)]
    assert pc.choose(3072, 1024, 3, TABLE, _never, lambda: 0) == pc.Choice("skinny", SAFE, "measured")
    assert pc.choose(8192, 1024, 9, TABLE, _never, lambda: 0).kernel == "cublas"
    assert pc.resolve(wanted, 0, CTX, TABLE, _never, _never, path) == {}  # chosen already: nothing read or timed
    data = json.loads(path.read_text())
    assert data["version"] == pc.CACHE_VERSION
    assert data["entries"][CTX.key(8192, 1024, 16)] == {"kernel": "cublas", "safe_config": list(SAFE),
                                                        "cublas_us": 4.0, "safe_us": 5.0, "form": "plain"}
    assert CTX.key(8192, 1024, 16) == "NVIDIA H200|torch 2.13.0|cuda 12.8|triton 3.9.0|bfloat16|pdl 2|8192x1024|m16"
    assert [p.name for p in path.parent.iterdir()] == ["choice.json"]  # no temp file left behind


def test_a_cache_hit_skips_the_measurement_and_other_contexts_miss(tmp_path):
    path = tmp_path / "choice.json"
    wanted = [(3072, 1024, 4), (8192, 1024, 16)]
    first = pc.resolve(wanted, 0, CTX, TABLE, _safe, Timer(), path)
    pc.clear_fallbacks()  # a warm start: a new process, the same file
    again = pc.resolve(wanted, 0, CTX, TABLE, _safe, _never, path)
    assert {k: (c.kernel, c.config) for k, c in again.items()} == {k: (c.kernel, c.config) for k, c in first.items()}
    assert {c.source for c in again.values()} == {"cached"}
    assert pc.choose(8192, 1024, 16, TABLE, _never, lambda: 0) == pc.Choice("cublas", None, "cached")
    for other in (dataclasses.replace(CTX, gpu="NVIDIA H100 80GB HBM3"), dataclasses.replace(CTX, triton="3.10.0"),
                  dataclasses.replace(CTX, torch="2.14.0"), dataclasses.replace(CTX, dtype="float16"),
                  dataclasses.replace(CTX, pdl=0)):
        pc.clear_fallbacks()
        timer = Timer()
        pc.resolve(wanted, 0, other, TABLE, _safe, timer, path)
        assert len(timer.calls) == 2, other
    assert len(json.loads(path.read_text())["entries"]) == 2 * 6  # merged, none lost


def test_each_form_has_its_own_cache_entry_and_an_unknown_form_is_refused(tmp_path):
    """A shape measured as a bare GEMM does not answer for the same shape with its fused epilogue, and back."""
    path = tmp_path / "choice.json"
    wanted = [(3072, 1024, 4), (3072, 1024, 16)]
    pc.resolve(wanted, 0, CTX, TABLE, _safe, Timer(), path)  # plain
    pc.clear_fallbacks()
    timer = Timer()
    forms = {4: "add_norm", 16: "plain"}
    again = pc.resolve(wanted, 0, CTX, TABLE, _safe, timer, path, lambda n, k, mc: forms[mc])
    assert timer.calls == [(3072, 1024, 4, SAFE)]  # the plain class-16 entry answers; class 4 is a new form
    assert again[(3072, 1024, 16)].source == "cached" and again[(3072, 1024, 4)].source == "measured"
    entries = json.loads(path.read_text())["entries"]
    assert entries[CTX.key(3072, 1024, 4, "add_norm")]["form"] == "add_norm"
    assert CTX.key(3072, 1024, 4, "add_norm") == CTX.key(3072, 1024, 4) + "|add_norm"
    assert len(entries) == 3
    pc.clear_fallbacks()
    with pytest.raises(ValueError, match="form 'fused'"):
        pc.resolve(wanted, 0, CTX, TABLE, _safe, Timer(), path, lambda n, k, mc: "fused")


def test_merge_forms_keeps_one_form_per_shape_and_measures_a_shape_of_two_forms_plain():
    uses = [((8, 4), "add_norm"), ((8, 4), "add_norm"), ((4, 8), "gated_add_norm"), ((6, 4), "plain"),
            ((16, 4), "add_norm"), ((16, 4), "gated"), ((16, 4), "add_norm")]
    assert pc.merge_forms(uses) == {(8, 4): "add_norm", (4, 8): "gated_add_norm", (6, 4): "plain", (16, 4): "plain"}
    with pytest.raises(ValueError, match="form 'norm'"):
        pc.merge_forms([((8, 4), "norm")])


def test_an_entry_measured_against_another_safe_config_is_measured_again(tmp_path):
    path = tmp_path / "choice.json"
    pc.resolve([(3072, 1024, 4)], 0, CTX, TABLE, _safe, Timer(), path)
    pc.clear_fallbacks()
    timer = Timer()
    done = pc.resolve([(3072, 1024, 4)], 0, CTX, TABLE, lambda n, k, mc: (32, 128, 4, 4, 3), timer, path)
    assert len(timer.calls) == 1 and done[(3072, 1024, 4)] == pc.Choice("skinny", (32, 128, 4, 4, 3), "measured")
    assert json.loads(path.read_text())["entries"][CTX.key(3072, 1024, 4)]["safe_config"] == [32, 128, 4, 4, 3]


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", '{"version": 99, "entries": {}}', '{"version": 1}',
                                  "\udcff", ""])
def test_a_corrupt_cache_is_ignored_and_rewritten(tmp_path, text):
    path = tmp_path / "choice.json"
    path.write_bytes(b"\xff\xfe" if text == "\udcff" else text.encode())
    assert pc.load_cache(path) == {}
    timer = Timer()
    done = pc.resolve([(3072, 1024, 4)], 0, CTX, TABLE, _safe, timer, path)
    assert len(timer.calls) == 1 and done[(3072, 1024, 4)].source == "measured"
    assert set(pc.load_cache(path)) == {CTX.key(3072, 1024, 4)}


def test_malformed_entries_count_as_misses(tmp_path):
    path = tmp_path / "choice.json"
    entries = {CTX.key(3072, 1024, 4): {"kernel": "magic", "safe_config": list(SAFE)},
               CTX.key(3072, 1024, 16): {"kernel": "cublas"},
               CTX.key(8192, 1024, 16): "cublas"}
    path.write_text(json.dumps({"version": pc.CACHE_VERSION, "entries": entries}))
    timer = Timer()
    pc.resolve([(3072, 1024, 4), (3072, 1024, 16), (8192, 1024, 16)], 0, CTX, TABLE, _safe, timer, path)
    assert len(timer.calls) == 3
    assert all(e["kernel"] in pc.KERNELS for e in pc.load_cache(path).values())


def test_an_unwritable_cache_only_logs(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    path = blocker / "choice.json"  # its parent is a file: mkdir fails
    done = pc.resolve([(3072, 1024, 4)], 0, CTX, TABLE, _safe, Timer(), path)
    assert done[(3072, 1024, 4)].kernel == "skinny" and "not written" in caplog.text
    assert pc.resolve([(3072, 1024, 16)], 0, CTX, TABLE, _safe, Timer(), None)[(3072, 1024, 16)].source == "measured"


def test_the_default_cache_lives_under_the_home_cache():
    assert pc.default_cache_path().parts[-3:] == (".cache", "graphline", "projection_choice.json")


def test_the_gpu_glue_with_the_device_stubbed(tmp_path, monkeypatch):
    """`measure_projection_fallbacks` on a stand-in CUDA device: which (N, K, class) it asks for (class 1 only where
    the GEMV does not serve), the safe config it measures against, the context it keys the cache by."""
    pytest.importorskip("triton", reason="triton_gemm_measure imports triton")
    import triton

    from modeling.ops import triton_gemm, triton_gemm_measure as tgm

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: "Stand-in GPU")
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(triton_gemm, "_sm_count", lambda index: 132)
    timed = []

    def fake_time(n, k, mc, cfg, device, dtype, pdl, replays, form="plain"):
        timed.append((n, k, mc, cfg, device, dtype, pdl))
        forms_timed[(n, k, mc)] = form
        return 1e-6, 2e-6

    forms_timed = {}

    monkeypatch.setattr(tgm, "time_candidates", fake_time)
    dev = torch.device("cuda", 0)
    path = tmp_path / "choice.json"
    shapes = [(3072, 1024), (4096, 1024), (200000, 1024)]  # untabled, tabled, wider than the GEMV
    done = tgm.measure_projection_fallbacks(shapes, dev, torch.bfloat16, gemv=2, pdl=2, cache_path=path)
    want = {(3072, 1024, mc) for mc in (4, 16)} | {(200000, 1024, mc) for mc in (1, 4, 16)}
    assert set(done) == want and {c.kernel for c in done.values()} == {"cublas"}
    for n, k, mc, cfg, device, dtype, pdl in timed:
        c = triton_gemm.default_config(n, k, mc, 132)
        assert cfg == (c.block_n, c.block_k, c.split_k, c.num_warps, c.num_stages)
        assert (device, dtype, pdl) == (dev, torch.bfloat16, 2)
    assert triton_gemm.config_for(3072, 1024, 3, dev) is None  # `linear` follows the choice
    ctx = pc.MeasureContext("Stand-in GPU", torch.__version__, str(torch.version.cuda), triton.__version__,
                            "bfloat16", 2)
    assert set(pc.load_cache(path)) == {ctx.key(*key) for key in want}
    pc.clear_fallbacks()
    timed.clear()
    done = tgm.measure_projection_fallbacks(shapes, dev, torch.bfloat16, gemv=0, pdl=2, cache_path=path)
    assert timed == [(3072, 1024, 1, timed[0][3], dev, torch.bfloat16, 2)]  # only the new class; the rest cached
    assert set(done) == want | {(3072, 1024, 1)}
    # the form the model runs a shape in: fused with its norm up to FUSED_NORM_MAX_M rows, the bare GEMM past it
    pc.clear_fallbacks()
    forms_timed.clear()
    tgm.measure_projection_fallbacks([(3072, 1024), (1536, 2560)], dev, torch.bfloat16, gemv=0, pdl=2,
                                     cache_path=path, forms={(3072, 1024): "add_norm", (1536, 2560): "gated_add_norm"})
    # (3072, 1024, 16) is measured plain there, as above: the cache answers for it
    assert forms_timed == {(3072, 1024, 1): "add_norm", (3072, 1024, 4): "add_norm",
                           (1536, 2560, 1): "gated_add_norm", (1536, 2560, 4): "gated_add_norm",
                           (1536, 2560, 16): "gated"}
    assert tgm.measured_form("add_norm", triton_gemm.FUSED_NORM_MAX_N + 1, 4) == "plain"
    # a GEMV serving up to 4 rows (KernelOptions.gemv_rows=4) leaves only the larger classes to measure
    pc.clear_fallbacks()
    timed.clear()
    tgm.measure_projection_fallbacks([(3072, 1024)], dev, torch.bfloat16, gemv=4, pdl=2, cache_path=tmp_path / "4.json")
    assert [t[2] for t in timed] == [16]
    assert tgm.measure_projection_fallbacks(shapes, torch.device("cpu"), cache_path=path) == {}
    assert tgm.measure_projection_fallbacks(shapes, dev, torch.float32, cache_path=path) == {}
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(tgm.ProjectionMeasureError):
        tgm.measure_projection_fallbacks(shapes, dev, cache_path=path)


def test_the_skinny_gemm_config_follows_the_choice():
    pytest.importorskip("triton", reason="triton_gemm imports triton")
    from modeling.ops import triton_gemm as gemm

    dev = torch.device("cuda", 0)  # config_for reads no device property when the table or a choice decides
    assert gemm.config_for(4096, 1024, 1, dev) is None  # the table: cuBLAS
    assert gemm.config_for(1024, 2048, 3, dev) == gemm.GemmConfig(32, 128, 8, 4, 3)
    pc.record(0, 3072, 1024, 16, pc.decide(4e-6, 5e-6, SAFE))
    assert gemm.config_for(3072, 1024, 9, dev) is None
    pc.record(0, 3072, 1024, 4, pc.decide(6e-6, 5e-6, SAFE))
    assert gemm.config_for(3072, 1024, 3, dev) == gemm.GemmConfig(*SAFE)
    pc.record(0, 4096, 1024, 1, pc.decide(9.0, 1.0, SAFE))  # a table shape: the table still decides
    assert gemm.config_for(4096, 1024, 1, dev) is None


@pytest.mark.parametrize("preset", ["qwen3-tiny", "qwen3-moe-tiny"])
def test_warm_up_hands_every_projection_shape_of_the_model_to_the_measurement(preset):
    cfg = get_preset(preset)
    seen = []
    ops = dataclasses.replace(get_kernel_ops("cpu"), measure_projections=lambda shapes, device, dtype, forms:
                              seen.append((shapes, device, dtype, forms)))
    model = Qwen3ForCausalLM(cfg, device="cpu", ops=ops)
    model.warm_up_kernels([(torch.zeros(1), torch.zeros(1))])
    qkv = ((cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim, cfg.hidden_size)
    o_proj = (cfg.hidden_size, cfg.num_heads * cfg.head_dim)
    mlp = [] if cfg.is_moe else [(2 * cfg.intermediate_size, cfg.hidden_size), (cfg.hidden_size, cfg.intermediate_size)]
    want = {qkv, o_proj, (cfg.vocab_size, cfg.hidden_size), *mlp}
    assert len(seen) == 1 and set(seen[0][0]) == want and len(seen[0][0]) == len(want)
    assert seen[0][1] == torch.device("cpu") and seen[0][2] == cfg.dtype
    # without TP the output and down projections run with the residual add + norm after them, down gated
    mlp_forms = {} if cfg.is_moe else {mlp[0]: "plain", mlp[1]: "gated_add_norm"}
    assert seen[0][3] == {qkv: "plain", o_proj: "add_norm", **mlp_forms}
    assert get_kernel_ops("cpu").measure_projections([(8, 8)], torch.device("cpu"), cfg.dtype) == {}
