"""The driver refuses a DeepEP deployment the library cannot run (`actors.deepep_config`): `DeploymentConfig`
raises `DeepEPConfigError` naming the fix, and `graphline serve --ep-backend deepep` exits 2 with one line before
Ray or any rank starts."""
import os
import time

import pytest

from actors.coordinator import DeploymentConfig
from actors.rank import RuntimeConfig
from graphrunner.config import GraphRunnerConfig
from parallel.deepep_checks import DeepEPConfigError
from parallel.options import CommOptions

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


def _dep(model="qwen3-moe-2048", comm=CommOptions(), ep_backend="deepep", tp=1, dp=2, **rt):
    return DeploymentConfig(runtime=RuntimeConfig(model=model, **rt), tp=tp, dp=dp, ep=tp * dp, ep_backend=ep_backend,
                            comm=comm)


def test_a_deployment_deepep_can_run_passes():
    dep = _dep()  # bf16, hidden 2048, ep 2, default decode buckets (256) within the default cap (256)
    assert max(dep.runtime.graph.decode_buckets()) == 256 == dep.comm.deepep_max_tokens_per_rank
    _dep(tp=2, dp=1, comm=CommOptions(deepep_max_tokens_per_rank=128))  # tp 2: 128 of the 256 rows per rank


@pytest.mark.parametrize("kw,parts", [
    (dict(dtype="float32"), ["the model runs float32", "--dtype bfloat16"]),
    (dict(device="cpu"), ["the model runs float32", "--dtype bfloat16"]),  # presets on CPU ranks run fp32
    (dict(model="qwen3-moe-small"), ["hidden_size is 1024", "2048, 2560, 3072, 4096, 5120, 6144, 7168, 8192"]),
    (dict(comm=CommOptions(deepep_max_tokens_per_rank=128)),
     ["deepep_max_tokens_per_rank=128", "largest decode bucket 256", "GRAPHLINE_DEEPEP_MAX_TOKENS_PER_RANK to at "
      "least 256", "--max-decode-batch to 128"]),
    (dict(tp=2, dp=8), ["ep is 16", "--ep 2, 4 or 8", "internode DeepEP is not supported"]),
])
def test_the_driver_refuses_with_the_fix_named(kw, parts):
    with pytest.raises(DeepEPConfigError) as info:
        _dep(**kw)
    for part in parts:
        assert part in str(info.value), (part, str(info.value))


def test_the_all_gather_backend_is_not_checked():
    _dep(model="qwen3-moe-small", dtype="float32", ep_backend="allgather",
         graph=GraphRunnerConfig(max_decode_batch=512))


def test_serve_fails_in_one_line_before_anything_starts(capsys):
    import ray

    from launch.cli import main

    t0 = time.perf_counter()
    code = main(["serve", "--model", "qwen3-moe-small", "--device", "cuda", "--dp", "2", "--ep", "2",
                 "--ep-backend", "deepep", "--port", "0"])
    took = time.perf_counter() - t0
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert err.count("\n") == 0, err
    assert err.startswith("graphline serve: error: bad deployment options: ep_backend=deepep cannot run"), err
    assert "hidden_size is 1024" in err and "--ep-backend allgather" in err, err
    assert not ray.is_initialized()
    assert took < 10, took  # imports included; the check itself reads one config
