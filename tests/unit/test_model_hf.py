"""Our Qwen3 / Qwen3-MoE logits equal HF transformers' on the same random weights (fp32)."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from modeling.config import get_preset, load_config
from modeling.loader import load_checkpoint
from modeling.qwen3 import Qwen3ForCausalLM
from tests.fixtures.paged import prefill_logits


def _hf_model(preset: str, tmp_path):
    cfg = get_preset(preset)
    hf_cfg_dict = cfg.to_hf_dict()
    if cfg.is_moe:
        hf_cfg = transformers.Qwen3MoeConfig(**{k: v for k, v in hf_cfg_dict.items() if k != "architectures"})
        cls = transformers.Qwen3MoeForCausalLM
    else:
        hf_cfg = transformers.Qwen3Config(**{k: v for k, v in hf_cfg_dict.items() if k != "architectures"})
        cls = transformers.Qwen3ForCausalLM
    torch.manual_seed(1234)
    hf = cls(hf_cfg).float().eval()
    with torch.no_grad():  # HF initialises norms to exactly 1; perturb them so q/k norms are tested
        for n, p in hf.named_parameters():
            if n.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.1)
    hf.save_pretrained(tmp_path)
    return hf


@pytest.mark.parametrize("preset", ["qwen3-tiny", "qwen3-moe-tiny"])
def test_logits_equal_hf(preset, tmp_path):
    hf = _hf_model(preset, tmp_path)
    cfg = load_config(tmp_path).with_dtype(torch.float32)
    ours = Qwen3ForCausalLM(cfg)
    load_checkpoint(ours, tmp_path)
    prompts = [[3, 17, 42, 5, 99, 7, 256, 1, 8], [11, 400, 2], [5]]
    with torch.no_grad():
        for p, got in zip(prompts, prefill_logits(ours, prompts, block_size=4)):
            ref = hf(torch.tensor([p])).logits[0].float()
            torch.testing.assert_close(got, ref, atol=2e-5, rtol=2e-5)
