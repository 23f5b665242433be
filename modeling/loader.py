"""Load HF checkpoints (config.json + one or many safetensors files, HF tensor names) into the model.

Every tensor goes through its parameter's `weight_loader`, which takes this rank's
TP/EP slice, so the same path loads a full checkpoint into any shard. Checkpoint tensors
arrive lazily (`modeling.checkpoint_files`): a loader's slice is all that is read, experts of
other EP ranks are never read, and files are read one at a time, so a rank's memory while
loading is its shard plus the open file's mapping plus at most one slice. A missing,
unexpected, duplicated or mis-shaped tensor is a `CheckpointError` naming it; nothing is
half-loaded silently (the caller discards the model on error).
Random-weight presets use the same path with generated full tensors (`random_tensors`).
"""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Iterable, Iterator

import torch
from safetensors.torch import save_file

from modeling.checkpoint_files import TensorLike, iter_checkpoint, lazy_view
from modeling.config import ModelConfig, load_config
from modeling.errors import CheckpointError
from modeling.moe import SparseMoeBlock
from parallel.layers import WeightShapeError


_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
_FUSED_EXPERTS = re.compile(r"^mlp\.experts\.(gate_up_proj|down_proj)$")


def expected_tensor_names(cfg: ModelConfig) -> list[str]:
    """HF names a complete checkpoint of `cfg` holds (per-expert layout for MoE)."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not cfg.tie_word_embeddings:
        names.append("lm_head.weight")
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        names += [p + f"self_attn.{x}.weight" for x in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")]
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        if cfg.layer_is_moe(i):
            names.append(p + "mlp.gate.weight")
            names += [p + f"mlp.experts.{e}.{w}_proj.weight" for e in range(cfg.num_experts) for w in ("gate", "up", "down")]
        else:
            names += [p + f"mlp.{w}_proj.weight" for w in ("gate", "up", "down")]
    return names


def _copy_plain(name: str, param: torch.nn.Parameter, full: TensorLike) -> None:
    if tuple(full.shape) != tuple(param.shape):
        raise CheckpointError(f"{name}: checkpoint shape {tuple(full.shape)} != expected {tuple(param.shape)}")
    param.data.copy_(full[...])


def _load_layer_tensor(model, i: int, rest: str, full: TensorLike, name: str) -> list[str]:
    """Load one layer tensor; returns the HF names it satisfies."""
    layer = model.layers[i]
    attn = layer.self_attn
    m = re.match(r"^self_attn\.(q|k|v)_proj\.weight$", rest)
    if m:
        attn.qkv_proj.weight_loader(attn.qkv_proj.weight, full, m.group(1))
        return [name]
    simple = {
        "self_attn.o_proj.weight": attn.o_proj.weight,
        "self_attn.q_norm.weight": attn.q_norm.weight,
        "self_attn.k_norm.weight": attn.k_norm.weight,
        "input_layernorm.weight": layer.input_layernorm.weight,
        "post_attention_layernorm.weight": layer.post_attention_layernorm.weight,
    }
    if rest in simple:
        p = simple[rest]
        loader = getattr(p, "weight_loader", None)
        loader(p, full) if loader else _copy_plain(name, p, full)
        return [name]
    mlp = layer.mlp
    if isinstance(mlp, SparseMoeBlock):
        if rest == "mlp.gate.weight":
            _copy_plain(name, mlp.gate.weight, full)
            return [name]
        m = _EXPERT.match(rest)
        if m:
            e = int(m.group(1))
            if e >= mlp.num_experts:
                raise CheckpointError(f"unexpected tensor {name}: expert {e} >= num_experts {mlp.num_experts}")
            mlp.load_expert(e, m.group(2), full)
            return [name]
        m = _FUSED_EXPERTS.match(rest)
        if m:
            prefix = f"model.layers.{i}.mlp.experts."
            if m.group(1) == "gate_up_proj":
                if len(full.shape) != 3 or full.shape[0] != mlp.num_experts or full.shape[1] != 2 * mlp.i_full:
                    raise CheckpointError(f"{name}: shape {tuple(full.shape)} is not [E, 2*I, H]")
                for e in range(mlp.num_experts):
                    mlp.load_expert(e, "gate", lazy_view(full, (e, slice(0, mlp.i_full))))
                    mlp.load_expert(e, "up", lazy_view(full, (e, slice(mlp.i_full, None))))
                return [prefix + f"{e}.{w}_proj.weight" for e in range(mlp.num_experts) for w in ("gate", "up")]
            if len(full.shape) != 3 or full.shape[0] != mlp.num_experts:
                raise CheckpointError(f"{name}: shape {tuple(full.shape)} is not [E, H, I]")
            for e in range(mlp.num_experts):
                mlp.load_expert(e, "down", lazy_view(full, e))
            return [prefix + f"{e}.down_proj.weight" for e in range(mlp.num_experts)]
    else:
        m = re.match(r"^mlp\.(gate|up)_proj\.weight$", rest)
        if m:
            mlp.gate_up_proj.weight_loader(mlp.gate_up_proj.weight, full, 0 if m.group(1) == "gate" else 1)
            return [name]
        if rest == "mlp.down_proj.weight":
            mlp.down_proj.weight_loader(mlp.down_proj.weight, full)
            return [name]
    raise CheckpointError(f"unexpected tensor {name} in checkpoint")


def load_tensors(model, tensors: Iterable[tuple[str, TensorLike]]) -> None:
    """Load (HF name, full tensor) pairs into `model`; raises CheckpointError on any mismatch.

    A full tensor is a torch tensor or a lazy `CheckpointTensor` (`[out, in]` for linears, `[E, ...]` for fused
    experts, any dtype: the copy converts): each parameter's loader indexes out its rank's part, and only that
    part is read. Each item is dropped before the next is taken, so a generator of tensors is never held whole."""
    cfg: ModelConfig = model.config
    expected = set(expected_tensor_names(cfg))
    seen: set[str] = set()
    for name, full in tensors:
        if name in seen:
            raise CheckpointError(f"tensor {name} appears twice in the checkpoint")
        try:
            if name == "model.embed_tokens.weight":
                model.embed_tokens.weight_loader(model.embed_tokens.weight, full)
                got = [name]
            elif name == "model.norm.weight":
                _copy_plain(name, model.norm.weight, full)
                got = [name]
            elif name == "lm_head.weight":
                if cfg.tie_word_embeddings:
                    continue  # tied: the embedding is the head
                model.lm_head.weight_loader(model.lm_head.weight, full)
                got = [name]
            else:
                m = _LAYER.match(name)
                if not m or int(m.group(1)) >= cfg.num_layers:
                    raise CheckpointError(f"unexpected tensor {name} in checkpoint")
                got = _load_layer_tensor(model, int(m.group(1)), m.group(2), full, name)
        except WeightShapeError as e:
            raise CheckpointError(f"{name}: {e}") from e
        del full
        seen.update(got)
    missing = sorted(expected - seen)
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise CheckpointError(f"checkpoint is missing tensor(s) {', '.join(missing[:5])}{more}")


def load_checkpoint(model, directory: str | Path) -> None:
    """Load an HF checkpoint directory (config.json + safetensors files, with or without
    `model.safetensors.index.json`) into `model`, whose config must match; only this rank's slices are read."""
    d = Path(directory)
    cfg = load_config(d)
    if cfg.with_dtype(model.config.dtype) != model.config:
        raise CheckpointError(f"checkpoint config at {d} does not match the model's config")
    with torch.no_grad():
        load_tensors(model, iter_checkpoint(d))


def _tensor_seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") & ((1 << 63) - 1)


def _random_shape(cfg: ModelConfig, name: str) -> tuple[tuple[int, ...], float, float]:
    """(shape, mean, std) of a generated HF tensor: linears std 1/sqrt(fan_in), norms around 1."""
    h, d = cfg.hidden_size, cfg.head_dim
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return (cfg.vocab_size, h), 0.0, 0.5
    if name.endswith("norm.weight"):
        return ((d,) if "q_norm" in name or "k_norm" in name else (h,)), 1.0, 0.1
    rest = _LAYER.match(name).group(2)
    shapes = {
        "self_attn.q_proj.weight": (cfg.num_heads * d, h),
        "self_attn.k_proj.weight": (cfg.num_kv_heads * d, h),
        "self_attn.v_proj.weight": (cfg.num_kv_heads * d, h),
        "self_attn.o_proj.weight": (h, cfg.num_heads * d),
        "mlp.gate_proj.weight": (cfg.intermediate_size, h),
        "mlp.up_proj.weight": (cfg.intermediate_size, h),
        "mlp.down_proj.weight": (h, cfg.intermediate_size),
        "mlp.gate.weight": (cfg.num_experts, h),
    }
    if rest in shapes:
        shape = shapes[rest]
    else:
        which = _EXPERT.match(rest).group(2)
        shape = (h, cfg.moe_intermediate_size) if which == "down" else (cfg.moe_intermediate_size, h)
    return shape, 0.0, shape[1] ** -0.5


def random_tensors(cfg: ModelConfig, seed: int, device: torch.device | str = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """Deterministic full random tensors in HF naming: the same (cfg, seed, device type) gives the same weights
    on every device count and rank, so TP/EP shards of a preset agree with the single-rank model. (CPU and
    CUDA generators draw different streams: a preset's weights differ between the two.)"""
    dev = torch.device(device)
    for name in expected_tensor_names(cfg):
        shape, mean, std = _random_shape(cfg, name)
        g = torch.Generator(device=dev).manual_seed(_tensor_seed(seed, name))
        t = torch.randn(shape, generator=g, device=dev, dtype=torch.float32).mul_(std).add_(mean)
        yield name, t.to(cfg.dtype)


def init_random(model, seed: int = 0) -> None:
    """Fill `model` with the preset's deterministic random weights (through the loading path)."""
    with torch.no_grad():
        load_tensors(model, random_tensors(model.config, seed, model.device))


def save_checkpoint(cfg: ModelConfig, directory: str | Path, seed: int = 0, shards: int = 1) -> Path:
    """Write a random-weight HF checkpoint (config.json + `shards` safetensors files + index) of `cfg`."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=2))
    items = list(random_tensors(cfg, seed))
    weight_map = {}
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors" if shards > 1 else "model.safetensors"
        part = {n: t.contiguous() for n, t in items[s::shards]}
        save_file(part, str(d / fname))
        weight_map.update({n: fname for n in part})
    if shards > 1:
        (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return d
