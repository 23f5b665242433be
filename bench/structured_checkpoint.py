"""A random-weight HF checkpoint directory with Qwen3-0.6B's shapes and a tokenizer of Qwen3's vocabulary size.

    python -m bench.structured_checkpoint --out DIR [--layers N] [--dtype bfloat16|float32] [--seed S]
    graphline bench --model DIR --response-format json_object --temperature 1.0 --concurrency 1,16

Why: structured outputs (`response_format`) need a tokenizer (the grammar's token trie, the allowed-token bitmask
over the whole vocabulary), and a GPU machine has no real checkpoint and no network. The presets
(`--model qwen3-0.6b`) have no tokenizer, and the test fixture's (`tests.fixtures.hf_checkpoints`) has 600 ids; this
one has Qwen3's: 151,643 byte-level ids (`bench.grammar_mask_bench.synthetic_tokenizer`) then `<|endoftext|>`,
`<|im_start|>`, `<|im_end|>` at Qwen3's ids 151643-151645, in a model vocabulary of 151,936, so constrained and
free serving compare at a real mask width.

What it writes (HF layout, what `modeling.loader.load_checkpoint` reads):
  config.json             the `qwen3-0.6b` preset (`modeling.config.PRESETS`) through `ModelConfig.to_hf_dict`,
                          with --layers / --hidden / --intermediate / --dtype applied; eos <|im_end|>, bos <|endoftext|>
  generation_config.json  Qwen3's (`tests.fixtures.hf_checkpoints.generation_config`): eos [<|im_end|>,
                          <|endoftext|>] and its sampling defaults temperature 0.6, top_p 0.95, top_k 20, which a
                          request that omits them gets (`graphline bench --top-k -1` turns top-k off;
                          `--no-sampling-defaults` writes the stop ids only)
  model.safetensors       every tensor `modeling.loader.expected_tensor_names` lists (tied embeddings: no lm_head),
                          drawn tensor by tensor in the target dtype: normal * --init-std (0.02, HF's
                          initializer_range for Qwen3), norms 1 + normal * 0.1
  tokenizer.json, tokenizer_config.json (+ chat_template.jinja)   the synthetic tokenizer with Qwen's ChatML
                          template (`tests.fixtures.hf_checkpoints.CHAT_TEMPLATE`), eos <|im_end|>, pad <|endoftext|>
The full model in bf16 is about 1.2 GB and takes seconds to write. `--hidden` / `--intermediate` (and a few layers)
make a CPU-sized variant for smoke tests and unit tests; the vocabulary stays Qwen3's.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path
from typing import Optional

import torch

from modeling.config import ModelConfig, get_preset

PRESET = "qwen3-0.6b"
TOKENIZER_IDS = 151643  # Qwen3's regular (byte-level BPE) ids; its special tokens come right after
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def model_config(layers: Optional[int] = None, dtype: str = "bfloat16", hidden: Optional[int] = None,
                 intermediate: Optional[int] = None, eos_token_id: Optional[int] = None) -> ModelConfig:
    """The `qwen3-0.6b` preset with the given overrides (None: the preset's value)."""
    cfg = get_preset(PRESET)
    over = {"num_layers": layers, "hidden_size": hidden, "intermediate_size": intermediate}
    cfg = dataclasses.replace(cfg, dtype=DTYPES[dtype], **{k: v for k, v in over.items() if v is not None})
    return dataclasses.replace(cfg, eos_token_ids=(eos_token_id,)) if eos_token_id is not None else cfg


def build_tokenizer(max_length: int):
    """The synthetic Qwen3-size tokenizer, its three special tokens registered as such (single ids in text) and the
    ChatML chat template set."""
    from bench.grammar_mask_bench import synthetic_tokenizer
    from tests.fixtures.hf_checkpoints import CHAT_TEMPLATE

    tok = synthetic_tokenizer(TOKENIZER_IDS)
    tok.add_special_tokens({"pad_token": "<|endoftext|>", "additional_special_tokens": ["<|im_start|>"]})
    tok.chat_template = CHAT_TEMPLATE
    tok.model_max_length = max_length
    ids = [tok.convert_tokens_to_ids(t) for t in SPECIALS]
    if ids != list(range(TOKENIZER_IDS, TOKENIZER_IDS + 3)) or len(tok) != TOKENIZER_IDS + 3:
        raise RuntimeError(f"special token ids {ids} / {len(tok)} tokens are not Qwen3's layout")
    return tok


def random_weights(cfg: ModelConfig, seed: int, init_std: float) -> dict[str, torch.Tensor]:
    """Every tensor the loader expects, in its HF name and shape, drawn in `cfg.dtype` one tensor at a time."""
    from modeling.loader import _random_shape, expected_tensor_names

    g = torch.Generator().manual_seed(seed)
    out = {}
    for name in expected_tensor_names(cfg):
        shape, _, _ = _random_shape(cfg, name)
        t = torch.randn(shape, generator=g, dtype=cfg.dtype)
        out[name] = t.mul_(0.1).add_(1.0) if name.endswith("norm.weight") else t.mul_(init_std)
    return out


def write_checkpoint(out: str | Path, *, layers: Optional[int] = None, dtype: str = "bfloat16", seed: int = 0,
                     hidden: Optional[int] = None, intermediate: Optional[int] = None, init_std: float = 0.02,
                     sampling_defaults: bool = True) -> Path:
    """Write the checkpoint directory `out` (created if needed) and return it."""
    from safetensors.torch import save_file

    from tests.fixtures.hf_checkpoints import generation_config

    d = Path(out)
    d.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(get_preset(PRESET).max_position_embeddings)
    endoftext, _, im_end = (tok.convert_tokens_to_ids(t) for t in SPECIALS)
    cfg = model_config(layers, dtype, hidden, intermediate, eos_token_id=im_end)
    if cfg.vocab_size < len(tok):
        raise ValueError(f"vocab_size {cfg.vocab_size} < the tokenizer's {len(tok)} tokens")
    hf = {**cfg.to_hf_dict(), "bos_token_id": endoftext, "initializer_range": init_std}
    (d / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    generation_config(endoftext, im_end, sampling=sampling_defaults).save_pretrained(d)
    tok.save_pretrained(d)
    save_file(random_weights(cfg, seed, init_std), str(d / "model.safetensors"), metadata={"format": "pt"})
    return d


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="checkpoint directory to write")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: the preset's 28)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="bfloat16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hidden", type=int, default=None, help="hidden size (default 1024; smoke tests only)")
    p.add_argument("--intermediate", type=int, default=None, help="MLP size (default 3072; smoke tests only)")
    p.add_argument("--init-std", type=float, default=0.02, help="std of the linear and embedding weights")
    p.add_argument("--no-sampling-defaults", action="store_true",
                   help="generation_config.json without Qwen3's temperature / top_p / top_k (stop ids only)")
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    d = write_checkpoint(a.out, layers=a.layers, dtype=a.dtype, seed=a.seed, hidden=a.hidden,
                         intermediate=a.intermediate, init_std=a.init_std,
                         sampling_defaults=not a.no_sampling_defaults)
    size = sum(f.stat().st_size for f in d.iterdir() if f.is_file())
    print(f"wrote {d} ({size / 2**20:.0f} MiB) in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
