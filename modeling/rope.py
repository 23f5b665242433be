"""Rotary position embedding: the scaling variants a checkpoint may ask for, and the cos/sin tables.

`RopeScaling` is the frozen, hashable form of an HF `rope_scaling` / `rope_parameters` object
(`linear` or `yarn`; plain RoPE is `None` in `ModelConfig`). `rope_tables` builds the fp32
`[max_pos, head_dim]` neox (rotate-half) tables the attention operators read. The numerics follow
transformers' `modeling_rope_utils` (`_compute_linear_scaling_rope_parameters`,
`_compute_yarn_parameters`) and `Qwen3RotaryEmbedding.forward`, so logits match HF's.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from modeling.errors import ConfigError

SUPPORTED_ROPE_TYPES = ("default", "linear", "yarn")

# Keys each rope_type may carry (besides `rope_type` / its old name `type`, and `rope_theta`).
_KEYS = {
    "default": frozenset(),
    "linear": frozenset({"factor"}),
    "yarn": frozenset({"factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow",
                       "mscale", "mscale_all_dim", "truncate"}),
}


@dataclass(frozen=True)
class RopeScaling:
    """A RoPE scaling variant. `linear`: frequencies divided by `factor` (positions / factor).
    `yarn`: per-dimension blend of interpolated and original frequencies over a linear ramp between the
    correction dims of `beta_fast` / `beta_slow` rotations within `original_max_position_embeddings`,
    and cos/sin multiplied by `attention_scaling`."""

    rope_type: str
    factor: float
    original_max_position_embeddings: int | None = None
    attention_factor: float | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.rope_type not in ("linear", "yarn"):
            raise ConfigError(f"rope_scaling.rope_type {self.rope_type!r} is not supported; "
                              f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
        if not self.factor > 0:
            raise ConfigError(f"rope_scaling.factor must be positive, got {self.factor!r}")
        if self.rope_type == "yarn":
            if self.original_max_position_embeddings is None or self.original_max_position_embeddings <= 0:
                raise ConfigError("rope_scaling.original_max_position_embeddings must be a positive int for yarn, "
                                  f"got {self.original_max_position_embeddings!r}")
            if self.attention_factor is not None and self.attention_factor <= 0:
                raise ConfigError(f"rope_scaling.attention_factor must be positive, got {self.attention_factor!r}")
            if not (self.beta_fast > 0 and self.beta_slow > 0):
                raise ConfigError(f"rope_scaling.beta_fast / beta_slow must be positive, got "
                                  f"{self.beta_fast!r} / {self.beta_slow!r}")

    @property
    def attention_scaling(self) -> float:
        """The factor on cos and sin: 1 for linear; for yarn the explicit `attention_factor`, else
        mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are set, else 0.1 ln(factor) + 1."""
        if self.rope_type != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return _yarn_mscale(self.factor, self.mscale) / _yarn_mscale(self.factor, self.mscale_all_dim)
        return _yarn_mscale(self.factor, 1.0)

    def to_hf_dict(self) -> dict[str, Any]:
        """The HF `rope_scaling` object (only the fields that differ from HF's defaults)."""
        d: dict[str, Any] = {"rope_type": self.rope_type, "factor": self.factor}
        if self.rope_type == "yarn":
            d["original_max_position_embeddings"] = self.original_max_position_embeddings
            optional = {"attention_factor": None, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": None,
                        "mscale_all_dim": None, "truncate": True}
            d.update({k: getattr(self, k) for k, default in optional.items() if getattr(self, k) != default})
        return d


def _yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _number(params: Mapping[str, Any], key: str, field: str, kind: type = float) -> Any:
    v = params[key]
    if (isinstance(v, bool) and kind is not bool) or not isinstance(v, (int, float) if kind is float else kind):
        raise ConfigError(f"config.json field '{field}.{key}' must be {kind.__name__}, got {v!r}")
    return float(v) if kind is float else v


def parse_rope(params: Mapping[str, Any] | None, field: str, max_position_embeddings: int,
               default_theta: float) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from an HF `rope_scaling` / `rope_parameters` object named `field` (None: plain RoPE
    at `default_theta`). Unknown keys, unknown rope types and bad values are a `ConfigError` naming the field."""
    if params is None:
        return default_theta, None
    if not isinstance(params, Mapping):
        raise ConfigError(f"config.json field '{field}' must be an object, got {params!r}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in _KEYS:
        raise ConfigError(f"config.json field '{field}.rope_type' is {rope_type!r}, which is not supported; "
                          f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if "type" in params and "rope_type" in params and params["type"] != params["rope_type"]:
        raise ConfigError(f"config.json field '{field}': 'type' {params['type']!r} != 'rope_type' {rope_type!r}")
    allowed = _KEYS[rope_type] | {"rope_type", "type", "rope_theta", "partial_rotary_factor"}
    unknown = sorted(set(params) - allowed)
    if unknown:
        raise ConfigError(f"config.json field '{field}.{unknown[0]}' is not supported for rope_type {rope_type!r}; "
                          f"supported keys: {', '.join(sorted(allowed))}")
    if "partial_rotary_factor" in params and _number(params, "partial_rotary_factor", field) != 1.0:
        raise ConfigError(f"config.json field '{field}.partial_rotary_factor' = {params['partial_rotary_factor']!r}"
                          " is not supported (only 1.0)")
    theta = _number(params, "rope_theta", field) if "rope_theta" in params else default_theta
    if rope_type == "default":
        return theta, None
    kw: dict[str, Any] = {}
    if rope_type == "yarn":
        orig = params.get("original_max_position_embeddings", max_position_embeddings)
        if isinstance(orig, bool) or not isinstance(orig, int):
            raise ConfigError(f"config.json field '{field}.original_max_position_embeddings' must be int, got {orig!r}")
        kw["original_max_position_embeddings"] = orig
        for key in ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim"):
            if params.get(key) is not None:
                kw[key] = _number(params, key, field)
        if "truncate" in params:
            kw["truncate"] = _number(params, "truncate", field, bool)
    if params.get("factor") is None:
        if rope_type != "yarn":
            raise ConfigError(f"config.json field '{field}.factor' is required for rope_type {rope_type!r}")
        factor = max_position_embeddings / kw["original_max_position_embeddings"]  # what HF infers
    else:
        factor = _number(params, "factor", field)
    return theta, RopeScaling(rope_type, factor, **kw)


def _yarn_correction_dim(rotations: float, dim: int, base: float, max_pos: int) -> float:
    """The rotary dim index whose wavelength fits `rotations` full turns in `max_pos` positions."""
    return dim * math.log(max_pos / (rotations * 2 * math.pi)) / (2 * math.log(base))


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None,
                        device: torch.device | str | None = None) -> torch.Tensor:
    """fp32 `[head_dim / 2]` rotary inverse frequencies, scaled as `scaling` says."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    base_freqs = theta ** exponents  # wavelengths / 2 pi
    if scaling is None:
        return 1.0 / base_freqs
    if scaling.rope_type == "linear":
        return (1.0 / base_freqs) / scaling.factor
    lo = _yarn_correction_dim(scaling.beta_fast, head_dim, theta, scaling.original_max_position_embeddings)
    hi = _yarn_correction_dim(scaling.beta_slow, head_dim, theta, scaling.original_max_position_embeddings)
    if scaling.truncate:
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, head_dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32, device=device) - lo) / (hi - lo)).clamp(0, 1)
    keep = 1 - ramp  # 1: the dimension keeps its original frequency (extrapolates); 0: it is interpolated
    interpolated = 1.0 / (scaling.factor * base_freqs)
    return interpolated * (1 - keep) + (1.0 / base_freqs) * keep


def rope_tables(head_dim: int, max_position: int, theta: float, scaling: RopeScaling | None = None,
                device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) fp32 `[max_position, head_dim]`, both halves of the last dim equal (rotate-half layout), each
    multiplied by the scaling's attention factor."""
    inv_freq = inverse_frequencies(head_dim, theta, scaling, device)
    t = torch.arange(max_position, dtype=torch.float32, device=device)
    freqs = torch.outer(t, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    mscale = scaling.attention_scaling if scaling is not None else 1.0
    if mscale != 1.0:
        cos, sin = cos * mscale, sin * mscale
    return cos, sin
