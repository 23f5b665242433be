"""A checkpoint's `generation_config.json`: stop tokens and default sampling parameters, as a frozen dataclass.

Fields read: `eos_token_id` (int or list), `bos_token_id`, `pad_token_id`, `do_sample`, `temperature`,
`top_p`, `top_k`, `min_p`, `repetition_penalty`, `max_new_tokens`. Every other field transformers'
`GenerationConfig` defines is accepted and ignored (beam search, output flags, assistant decoding, ...);
a field transformers does not define, or a read field of the wrong type or range, is a `ConfigError`
naming it. The engine decides how the defaults combine with a request's own parameters.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from modeling.config import ModelConfig
from modeling.errors import ConfigError

GENERATION_CONFIG_FILE = "generation_config.json"

# Fields of transformers' GenerationConfig (4.x and 5.x) that do not change what we sample, or that we do not
# implement; accepted so that any file transformers writes loads.
IGNORED_FIELDS = frozenset({
    "_from_model_config", "transformers_version", "use_cache", "max_length", "min_length", "min_new_tokens",
    "early_stopping", "max_time", "stop_strings", "num_beams", "num_beam_groups", "penalty_alpha", "dola_layers",
    "cache_implementation", "cache_config", "return_legacy_cache", "prefill_chunk_size", "max_cache_len",
    "typical_p", "epsilon_cutoff", "eta_cutoff", "top_h", "diversity_penalty", "encoder_repetition_penalty",
    "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids", "force_words_ids",
    "renormalize_logits", "constraints", "forced_bos_token_id", "forced_eos_token_id", "forced_decoder_ids",
    "remove_invalid_values", "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens",
    "sequence_bias", "token_healing", "guidance_scale", "low_memory", "watermarking_config",
    "num_return_sequences", "output_attentions", "output_hidden_states", "output_scores", "output_logits",
    "return_dict_in_generate", "decoder_start_token_id", "is_assistant", "num_assistant_tokens",
    "num_assistant_tokens_schedule", "assistant_confidence_threshold", "prompt_lookup_num_tokens",
    "max_matching_ngram_size", "assistant_early_exit", "assistant_lookbehind", "target_lookbehind",
    "assistant_ensemble_weight", "speculation_type", "use_mtp", "disable_compile", "compile_config",
    "continuous_batching_config", "generation_kwargs", "trust_remote_code",
})


@dataclass(frozen=True)
class GenerationDefaults:
    """What a checkpoint suggests for generation; None: the file does not say. `eos_token_ids` empty: not said."""

    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    do_sample: bool | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_new_tokens: int | None = None


def _ids(raw: Mapping[str, Any], key: str, vocab_size: int | None, many: bool) -> Any:
    value = raw.get(key)
    if value is None:
        return () if many else None
    items = value if many and isinstance(value, list) else [value]
    for v in items:
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            kind = "a non-negative int or a list of them" if many else "a non-negative int"
            raise ConfigError(f"{GENERATION_CONFIG_FILE} field '{key}' must be {kind}, got {value!r}")
        if vocab_size is not None and v >= vocab_size:
            raise ConfigError(f"{GENERATION_CONFIG_FILE} field '{key}' = {v} is outside the vocabulary "
                              f"[0, vocab_size={vocab_size})")
    return tuple(dict.fromkeys(items)) if many else items[0]


def _number(raw: Mapping[str, Any], key: str, kind: type, ok, expect: str) -> Any:
    value = raw.get(key)
    if value is None:
        return None
    numeric = (int, float) if kind is float else (int,)
    if isinstance(value, bool) or not isinstance(value, numeric) or not ok(value):
        raise ConfigError(f"{GENERATION_CONFIG_FILE} field '{key}' must be {expect}, got {value!r}")
    return kind(value)


def generation_config_from_dict(raw: Mapping[str, Any], vocab_size: int | None = None) -> GenerationDefaults:
    """Parse the contents of a `generation_config.json`; token ids are checked against `vocab_size` when given."""
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{GENERATION_CONFIG_FILE} must hold a JSON object, got {type(raw).__name__}")
    read = {f for f in GenerationDefaults.__dataclass_fields__ if f != "eos_token_ids"} | {"eos_token_id"}
    unknown = sorted(set(raw) - read - IGNORED_FIELDS)
    if unknown:
        raise ConfigError(f"{GENERATION_CONFIG_FILE} field '{unknown[0]}' is not a generation config field")
    do_sample = raw.get("do_sample")
    if do_sample is not None and not isinstance(do_sample, bool):
        raise ConfigError(f"{GENERATION_CONFIG_FILE} field 'do_sample' must be a bool, got {do_sample!r}")
    return GenerationDefaults(
        eos_token_ids=_ids(raw, "eos_token_id", vocab_size, many=True),
        bos_token_id=_ids(raw, "bos_token_id", vocab_size, many=False),
        pad_token_id=_ids(raw, "pad_token_id", vocab_size, many=False),
        do_sample=do_sample,
        temperature=_number(raw, "temperature", float, lambda v: v >= 0, "a number >= 0"),
        top_p=_number(raw, "top_p", float, lambda v: 0 < v <= 1, "a number in (0, 1]"),
        top_k=_number(raw, "top_k", int, lambda v: v >= 0, "an int >= 0"),
        min_p=_number(raw, "min_p", float, lambda v: 0 <= v <= 1, "a number in [0, 1]"),
        repetition_penalty=_number(raw, "repetition_penalty", float, lambda v: v > 0, "a number > 0"),
        max_new_tokens=_number(raw, "max_new_tokens", int, lambda v: v > 0, "an int > 0"),
    )


def load_generation_config(directory: str | Path, vocab_size: int | None = None) -> GenerationDefaults | None:
    """`generation_config.json` of a checkpoint directory, or None when it has none."""
    p = Path(directory) / GENERATION_CONFIG_FILE
    if not p.is_file():
        return None
    try:
        raw = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{p} is not valid JSON: {e}") from e
    return generation_config_from_dict(raw, vocab_size)


def stop_token_ids(cfg: ModelConfig, gen: GenerationDefaults | None) -> tuple[int, ...]:
    """The ids that end a generation: generation_config.json's `eos_token_id` when it names any, else
    config.json's (as transformers resolves them)."""
    if gen is not None and gen.eos_token_ids:
        return gen.eos_token_ids
    return cfg.eos_token_ids
