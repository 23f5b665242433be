"""The driver's DeepEP check: `DeploymentConfig(ep_backend="deepep")` refuses, in milliseconds and before any rank
starts, what DeepEP cannot run (`parallel.deepep_checks`); every rank checks again when it builds its dispatcher."""
from __future__ import annotations

from typing import Any

import torch

from parallel.deepep_checks import check_deepep_config


def ranks_device_type(runtime: Any, use_gpu: Any) -> str:
    """Where the ranks will run as far as the driver knows: "cpu" when told so, else "cuda" (DeepEP needs GPUs)."""
    return "cpu" if runtime.device == "cpu" or use_gpu is False else "cuda"


def check_deepep_deployment(runtime: Any, *, tp: int, ep: int, use_gpu: Any, max_tokens_per_rank: int) -> None:
    """Raises `DeepEPConfigError` naming each fix. A model config that does not load is left to the ranks (they
    report it where they build the model)."""
    try:
        model = runtime.model_config(torch.device(ranks_device_type(runtime, use_gpu)))
    except Exception:  # noqa: BLE001 - an unknown preset or a bad checkpoint is reported by the ranks
        return
    check_deepep_config(dtype=model.dtype, hidden=model.hidden_size, num_experts=model.num_experts,
                        top_k=model.num_experts_per_tok, ep_size=ep, tp_size=tp,
                        largest_decode_bucket=max(runtime.graph.decode_buckets(), default=0),
                        max_tokens_per_rank=max_tokens_per_rank)
