"""The start-up sampler warm-up (`modeling.sampler.warm_up`): each class's row needs exactly the variant the class
names (so its launch compiles that variant), and the side-by-side launches (each with its own block) leave the
caller's parameter block alone. On CPU the launches take the torch path; the
compile counts themselves are pinned on the GPU (`tests/gpu/test_sampler_compiles.py`)."""
import torch

from modeling.sampler import HostBatch, SamplerParams
from modeling.sampler.warm_up import warm_up_classes, warm_up_row, warm_up_sampler

V = 512
CAPS = dict(max_bias=4, max_ban=2, max_penalty_tokens=8)


def test_classes_cover_every_variant_and_logprob_class_once():
    classes = warm_up_classes()
    assert len(classes) == len(set(classes)) == 36
    assert {n for _, n in classes} == {0, 5, 20}
    for variant, _ in classes:
        row = warm_up_row(variant, V)
        assert HostBatch.from_rows([row], vocab_size=V, **CAPS).variant() == variant, (variant, row)


def test_warm_up_launches_every_class_and_leaves_the_callers_block_alone_on_threads_or_not():
    torch.manual_seed(0)
    logits = torch.randn(1, V) * 3
    params = SamplerParams(4, "cpu", **CAPS)
    before = (params.scalars.clone(), params.lists.clone())
    assert warm_up_sampler(logits, params, V, threads=4) == 36
    assert torch.equal(params.scalars, before[0]) and torch.equal(params.lists, before[1])
    assert warm_up_sampler(logits, params, V, threads=1) == 36
