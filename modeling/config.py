"""Frozen model configuration read from an HF `config.json`, plus named random-weight presets.

Covers the Qwen3 dense (`Qwen3ForCausalLM`) and Qwen3-MoE (`Qwen3MoeForCausalLM`)
families. Every inconsistency is a `ConfigError` naming the field.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch

from modeling.errors import ConfigError
from modeling.rope import RopeScaling, parse_rope


_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and numerics of one model. `num_experts == 0` means dense; `rope_scaling` None means plain RoPE;
    `eos_token_ids` is config.json's `eos_token_id` (a checkpoint's generation_config.json may override it:
    `modeling.generation_config.stop_token_ids`)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    dtype: torch.dtype
    max_position_embeddings: int = 40960
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    rope_scaling: RopeScaling | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_attention_heads={self.num_heads} is not a multiple of num_key_value_heads={self.num_kv_heads}"
            )
        if self.rms_norm_eps <= 0 or self.rope_theta <= 0:
            raise ConfigError("rms_norm_eps and rope_theta must be positive")
        if self.num_experts:
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                raise ConfigError(
                    f"num_experts_per_tok={self.num_experts_per_tok} must be in [1, num_experts={self.num_experts}]"
                )
            if self.moe_intermediate_size <= 0:
                raise ConfigError("moe_intermediate_size must be positive for a MoE model")
            if self.decoder_sparse_step <= 0:
                raise ConfigError("decoder_sparse_step must be positive")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ConfigError(f"rope_scaling must be a RopeScaling or None, got {self.rope_scaling!r}")
        if not isinstance(self.eos_token_ids, tuple) or not isinstance(self.mlp_only_layers, tuple):
            raise ConfigError("eos_token_ids and mlp_only_layers must be tuples (ModelConfig is hashable)")
        bad = [t for t in self.eos_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ConfigError(f"eos_token_id {bad[0]} is outside the vocabulary [0, vocab_size={self.vocab_size})")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def layer_is_moe(self, layer_idx: int) -> bool:
        return (
            self.is_moe
            and layer_idx not in self.mlp_only_layers
            and (layer_idx + 1) % self.decoder_sparse_step == 0
        )

    def with_dtype(self, dtype: torch.dtype) -> "ModelConfig":
        return dataclasses.replace(self, dtype=dtype)

    def to_hf_dict(self) -> dict[str, Any]:
        """The HF `config.json` contents for this config (used to save checkpoints)."""
        d: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": "qwen3_moe" if self.is_moe else "qwen3",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": str(self.dtype).removeprefix("torch."),
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "attention_bias": False,
        }
        if self.rope_scaling is not None:
            d["rope_scaling"] = self.rope_scaling.to_hf_dict()
        if self.eos_token_ids:
            d["eos_token_id"] = self.eos_token_ids[0] if len(self.eos_token_ids) == 1 else list(self.eos_token_ids)
        if self.is_moe:
            d.update(
                num_experts=self.num_experts,
                num_experts_per_tok=self.num_experts_per_tok,
                moe_intermediate_size=self.moe_intermediate_size,
                norm_topk_prob=self.norm_topk_prob,
                decoder_sparse_step=self.decoder_sparse_step,
                mlp_only_layers=list(self.mlp_only_layers),
            )
        return d


_ARCHS = {"Qwen3ForCausalLM": False, "Qwen3MoeForCausalLM": True}
_MODEL_TYPES = {"Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe"}


def _field(raw: Mapping[str, Any], key: str, kind: type, default: Any = dataclasses.MISSING) -> Any:
    if key not in raw:
        if default is dataclasses.MISSING:
            raise ConfigError(f"config.json is missing required field '{key}'")
        return default
    value = raw[key]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if kind is int and isinstance(value, bool) or not isinstance(value, kind):
        raise ConfigError(f"config.json field '{key}' must be {kind.__name__}, got {value!r}")
    return value


def _rope(raw: Mapping[str, Any], max_position_embeddings: int) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from `rope_scaling` (transformers 4; it wins when set, as in HF) or `rope_parameters`
    (transformers 5), the flat `rope_theta` being the default theta."""
    theta = _field(raw, "rope_theta", float, 1_000_000.0)
    if raw.get("rope_scaling"):
        return parse_rope(raw["rope_scaling"], "rope_scaling", max_position_embeddings, theta)
    return parse_rope(raw.get("rope_parameters"), "rope_parameters", max_position_embeddings, theta)


def _token_ids(raw: Mapping[str, Any], key: str, source: str = "config.json") -> tuple[int, ...]:
    """An HF token-id field that may be null, an int or a list of ints -> a tuple (null -> empty)."""
    value = raw.get(key)
    if value is None:
        return ()
    items = value if isinstance(value, list) else [value]
    for v in items:
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ConfigError(f"{source} field '{key}' must be a non-negative int or a list of them, got {value!r}")
    return tuple(dict.fromkeys(items))


def config_from_dict(raw: Mapping[str, Any]) -> ModelConfig:
    """Build a `ModelConfig` from the parsed contents of an HF `config.json`."""
    archs = raw.get("architectures") or []
    if not isinstance(archs, list):
        raise ConfigError(f"config.json field 'architectures' must be a list, got {archs!r}")
    arch = next((a for a in archs if a in _ARCHS), None)
    if arch is None:
        raise ConfigError(f"config.json field 'architectures': unsupported architectures {archs!r}; "
                          f"supported: {', '.join(sorted(_ARCHS))}")
    is_moe = _ARCHS[arch]
    model_type = raw.get("model_type")
    if model_type is not None and model_type != _MODEL_TYPES[arch]:
        raise ConfigError(f"config.json field 'model_type' = {model_type!r} does not match architecture {arch} "
                          f"(expected {_MODEL_TYPES[arch]!r})")
    dtype_name = raw.get("torch_dtype") or raw.get("dtype") or "bfloat16"
    if dtype_name not in _DTYPES:
        raise ConfigError(f"config.json torch_dtype {dtype_name!r} is not one of {sorted(_DTYPES)}")
    hidden = _field(raw, "hidden_size", int)
    heads = _field(raw, "num_attention_heads", int)
    max_pos = _field(raw, "max_position_embeddings", int, 40960)
    rope_theta, rope_scaling = _rope(raw, max_pos)
    kwargs: dict[str, Any] = dict(
        architecture=arch,
        vocab_size=_field(raw, "vocab_size", int),
        hidden_size=hidden,
        intermediate_size=_field(raw, "intermediate_size", int),
        num_layers=_field(raw, "num_hidden_layers", int),
        num_heads=heads,
        num_kv_heads=_field(raw, "num_key_value_heads", int, heads),
        head_dim=_field(raw, "head_dim", int, hidden // heads if heads else 0),
        rope_theta=rope_theta,
        rms_norm_eps=_field(raw, "rms_norm_eps", float, 1e-6),
        tie_word_embeddings=_field(raw, "tie_word_embeddings", bool, False),
        dtype=_DTYPES[dtype_name],
        max_position_embeddings=max_pos,
        rope_scaling=rope_scaling,
        eos_token_ids=_token_ids(raw, "eos_token_id"),
    )
    if is_moe:
        kwargs.update(
            num_experts=_field(raw, "num_experts" if "num_experts" in raw else "num_local_experts", int),
            num_experts_per_tok=_field(raw, "num_experts_per_tok", int),
            moe_intermediate_size=_field(raw, "moe_intermediate_size", int),
            norm_topk_prob=_field(raw, "norm_topk_prob", bool, True),
            decoder_sparse_step=_field(raw, "decoder_sparse_step", int, 1),
            mlp_only_layers=tuple(_field(raw, "mlp_only_layers", list, [])),
        )
    return ModelConfig(**kwargs)


def load_config(path: str | Path) -> ModelConfig:
    """Read `config.json` from a checkpoint directory (or the file itself)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise ConfigError(f"no config.json at {p}")
    try:
        raw = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{p} is not valid JSON: {e}") from e
    if not isinstance(raw, dict):
        raise ConfigError(f"{p} must hold a JSON object")
    return config_from_dict(raw)


PRESETS: dict[str, ModelConfig] = {
    "qwen3-tiny": ModelConfig(
        architecture="Qwen3ForCausalLM", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=False, dtype=torch.float32, max_position_embeddings=4096,
    ),
    "qwen3-moe-tiny": ModelConfig(
        architecture="Qwen3MoeForCausalLM", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=False, dtype=torch.float32, max_position_embeddings=4096,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
    ),
    # The shape of Qwen3-0.6B (random weights): GPU benchmarks.
    "qwen3-0.6b": ModelConfig(
        architecture="Qwen3ForCausalLM", vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_layers=28,
        num_heads=16, num_kv_heads=8, head_dim=128, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=True, dtype=torch.bfloat16, max_position_embeddings=40960,
    ),
    # The shapes of the published Qwen3 checkpoints (their config.json values, random weights): the model sweep.
    "qwen3-1.7b": ModelConfig(
        architecture="Qwen3ForCausalLM", vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_layers=28,
        num_heads=16, num_kv_heads=8, head_dim=128, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=True, dtype=torch.bfloat16, max_position_embeddings=40960,
    ),
    "qwen3-8b": ModelConfig(
        architecture="Qwen3ForCausalLM", vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36,
        num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=False, dtype=torch.bfloat16, max_position_embeddings=40960,
    ),
    "qwen3-14b": ModelConfig(
        architecture="Qwen3ForCausalLM", vocab_size=151936, hidden_size=5120, intermediate_size=17408, num_layers=40,
        num_heads=40, num_kv_heads=8, head_dim=128, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=False, dtype=torch.bfloat16, max_position_embeddings=40960,
    ),
    "qwen3-30b-a3b": ModelConfig(
        architecture="Qwen3MoeForCausalLM", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
        num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=False, dtype=torch.bfloat16, max_position_embeddings=40960,
        num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
    ),
    # Qwen3-30B-A3B's hidden size (2048, one DeepEP's low-latency kernels are compiled for) in bf16, 4 layers of
    # 16 experts, top-4: the DeepEP multi-GPU test (parallel/deepep_checks.py).
    "qwen3-moe-2048": ModelConfig(
        architecture="Qwen3MoeForCausalLM", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
        num_layers=4, num_heads=16, num_kv_heads=4, head_dim=128, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=False, dtype=torch.bfloat16, max_position_embeddings=40960,
        num_experts=16, num_experts_per_tok=4, moe_intermediate_size=256, norm_topk_prob=True,
    ),
    # A scaled-down Qwen3-30B-A3B shape (128 experts, top-8, head_dim 128) fitting 1-2 GPUs: EP.
    "qwen3-moe-small": ModelConfig(
        architecture="Qwen3MoeForCausalLM", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
        num_layers=8, num_heads=16, num_kv_heads=4, head_dim=128, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=False, dtype=torch.bfloat16, max_position_embeddings=40960,
        num_experts=64, num_experts_per_tok=8, moe_intermediate_size=384, norm_topk_prob=True,
    ),
}


class UnknownPresetError(KeyError):
    """The preset name is not one of `PRESETS`."""

    def __str__(self) -> str:
        return str(self.args[0])


def get_preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise UnknownPresetError(f"unknown preset {name!r}; known presets: {', '.join(sorted(PRESETS))}")
    return PRESETS[name]
