"""`bench.gemm_tune --safe-table` (CPU, no device): the table it writes gives exactly the presets' untabled
projection shapes the safe generic config at the asked row classes, and once installed (`install_table`, as
`bench.decode_ab`'s `gemm_table=` variant does) `config_for` picks that config, as the path untabled shapes take
with the warm-up measurement off."""
import json

import pytest

pytest.importorskip("triton", reason="triton_gemm imports triton")

from bench import gemm_tune  # noqa: E402
from bench.common import preset_projections  # noqa: E402
from modeling.ops import triton_gemm  # noqa: E402


def test_the_safe_table_covers_the_untabled_shapes_and_config_for_follows_it(tmp_path, monkeypatch):
    out = tmp_path / "safe.json"
    gemm_tune.main(["--safe-table", "qwen3-1.7b,qwen3-0.6b", "--ms", "1,3,16", "--out", str(out)])
    entries = json.loads(out.read_text())["table"]
    shapes = set(preset_projections("qwen3-1.7b").values()) | set(preset_projections("qwen3-0.6b").values())
    want = {(n, k, mc) for n, k in shapes for mc in (1, 4, 16) if (n, k, mc) not in triton_gemm._CONFIGS}
    assert {(e["n"], e["k"], e["m_class"]) for e in entries} == want and len(entries) == len(want)
    assert not any(n == 1024 for n, _, _ in want)  # Qwen3-0.6B's projections are all in the table
    monkeypatch.setattr(triton_gemm, "_CONFIGS", dict(triton_gemm._CONFIGS))
    monkeypatch.setattr(triton_gemm, "_GATED_CONFIGS", dict(triton_gemm._GATED_CONFIGS))
    assert gemm_tune.install_table(str(out)) == len(want)
    for n, k, mc in want:
        assert triton_gemm.config_for(n, k, mc) == triton_gemm.default_config(n, k, mc, 132)


def test_the_safe_table_needs_an_output_path(capsys):
    with pytest.raises(SystemExit):
        gemm_tune.main(["--safe-table", "qwen3-1.7b"])
    assert "--safe-table needs --out" in capsys.readouterr().err
