"""`bench.model_sweep.engine_runs` (the sweep's decode steps and first tokens through the engine) runs on CPU with
qwen3-tiny over the local executor: every batch gets a step time from decode-only steps, requests decode to their
length, and every prompt length gets a first-token time. A check that the benchmark keeps working, not a timing."""
from bench.model_sweep import engine_runs


def test_engine_runs_report_every_batch_and_prompt_length():
    runs = engine_runs("qwen3-tiny", [1, 4], context=24, steps=12, ttft_tokens=(40, 90), repeats=2, device="cpu")
    assert [r["batch"] for r in runs["decode"]] == [1, 4]
    for r in runs["decode"]:
        assert r["context"] == 24 and r["engine_step_s"] > 0
        # 12 tokens: the first from the prefill step, 11 decode-only steps, the first quarter left out
        assert r["steps"] == 11 - 11 // 4
    assert [(r["tokens"], r["repeats"]) for r in runs["ttft"]] == [(40, 2), (90, 2)]
    assert all(r["ttft_s"] > 0 for r in runs["ttft"])


def test_experts_used_counts_every_moe_layers_routing():
    """`_experts_used` (the MoE rows' bytes roofline) sees each MoE layer's router logits through the block's
    expert entry, whichever way the model computes them, and leaves the block as it found it."""
    import torch

    from actors.rank import RankRuntime, RuntimeConfig
    from bench.graph_bench import _decode_step
    from bench.model_sweep import _experts_used, _moe_blocks
    from modeling.config import get_preset
    from parallel.context import ParallelContext

    rt = RankRuntime(RuntimeConfig(model="qwen3-moe-tiny", device="cpu", num_kv_blocks=64), ParallelContext(),
                     torch.device("cpu"))
    rt.load_model()
    rt.allocate_kv_cache()
    cfg = get_preset("qwen3-moe-tiny")
    before = [b._experts for b in _moe_blocks(rt)]
    with torch.inference_mode():
        one = _experts_used(rt, _decode_step(rt, 1, 8))
        many = _experts_used(rt, _decode_step(rt, 6, 8, tokens=torch.arange(6).numpy() * 11))
    moe_layers = sum(cfg.layer_is_moe(i) for i in range(cfg.num_layers))
    assert len(one) == len(many) == moe_layers > 0
    assert all(u == cfg.num_experts_per_tok for u in one)  # one token: its top-k, all distinct
    assert all(cfg.num_experts_per_tok <= u <= cfg.num_experts for u in many)
    assert [b._experts for b in _moe_blocks(rt)] == before
