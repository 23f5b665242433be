"""`RuntimeConfig` rejects bad values with an error that names the field, and the shared command-line options
build it (`launch.options.runtime_config`), armed decode included."""
import argparse

import pytest

from actors.rank import RuntimeConfig
from launch.options import LaunchError, add_model_args, build_executor, runtime_config


@pytest.mark.parametrize("field,value", [
    ("armed_decode_wait_ms", -1.0), ("armed_decode_wait_ms", 10_001.0), ("head_graph_max_batch", -1),
    ("kv_cache_memory_fraction", 0.0), ("kv_cache_memory_fraction", 0.99), ("block_size", 0), ("dtype", "int8"),
])
def test_bad_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        RuntimeConfig(**{field: value})


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_model_args(p)
    return p.parse_args(["--device", "cpu", *argv])


def test_command_line_sets_armed_decode_wait():
    assert runtime_config(_args()).armed_decode_wait_ms == RuntimeConfig().armed_decode_wait_ms == 20.0
    assert runtime_config(_args("--armed-decode-wait-ms", "0")).armed_decode_wait_ms == 0.0
    assert runtime_config(_args("--armed-decode-wait-ms", "3.5")).armed_decode_wait_ms == 3.5


def test_bad_armed_decode_wait_is_a_launch_error():
    with pytest.raises(LaunchError, match="armed_decode_wait_ms must be in"):
        build_executor(_args("--armed-decode-wait-ms", "-5"))


def test_max_model_len_defaults_to_the_models_positions_and_refuses_more(tmp_path):
    import argparse

    from launch.options import LaunchError, resolve_max_model_len
    from tests.fixtures.hf_checkpoints import build_checkpoint

    ckpt = build_checkpoint(tmp_path / "ckpt")  # max_position_embeddings 256
    args = argparse.Namespace(model=str(ckpt), max_model_len=None)
    resolve_max_model_len(args)
    assert args.max_model_len == 256
    preset = argparse.Namespace(model="qwen3-0.6b", max_model_len=None)
    resolve_max_model_len(preset)
    assert preset.max_model_len == 4096  # 40960 positions: the 4096 default
    with pytest.raises(LaunchError, match="max_position_embeddings"):
        resolve_max_model_len(argparse.Namespace(model=str(ckpt), max_model_len=1000))


def _graph_args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_model_args(p)
    return p.parse_args(["--model", "qwen3-tiny", *argv])


def test_prefill_graph_defaults_on_gpus_off_on_cpu_and_bounded_by_max_model_len():
    on_gpu = runtime_config(_graph_args("--device", "cuda", "--max-model-len", "1024"))
    assert on_gpu.graph.prefill_graph_max_tokens == 1024 and on_gpu.graph.prefill_graph_max_seqs == 4
    assert runtime_config(_graph_args("--device", "cuda")).graph.prefill_graph_max_tokens == 2048
    assert runtime_config(_graph_args("--device", "cuda", "--eager")).graph.prefill_graph_max_tokens == 0
    assert runtime_config(_graph_args("--device", "cpu")).graph.prefill_graph_max_tokens == 0
    explicit = runtime_config(_graph_args("--device", "cpu", "--prefill-graph-max-tokens", "64",
                                          "--prefill-graph-max-seqs", "2"))
    assert (explicit.graph.prefill_graph_max_tokens, explicit.graph.prefill_graph_max_seqs) == (64, 2)
    for argv, field in ((("--prefill-graph-max-tokens", "5000", "--max-model-len", "4096"), "--prefill-graph-max-tokens"),
                        (("--prefill-graph-max-tokens", "-1"), "--prefill-graph-max-tokens"),
                        (("--prefill-graph-max-seqs", "0"), "--prefill-graph-max-seqs")):
        with pytest.raises(LaunchError, match=field):
            runtime_config(_graph_args("--device", "cpu", *argv))
