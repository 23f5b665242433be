"""The skinny decode GEMM's tuning tables (`triton_gemm` reads them as `_CONFIGS` and `_GATED_CONFIGS`): plain data,
CPU-importable. Benchmarks install measured entries into these dicts in place (`bench.gemm_tune.install_table`);
nothing else writes them."""
from __future__ import annotations

# (N, K, M class) -> (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages), or None: cuBLAS (`F.linear`) was
# faster. Qwen3-0.6B projections at TP=1, from `python -m bench.gemm_tune` on one H200 (2026-11-30, per call
# inside a CUDA graph over 28 weight copies; 2026-12-03 for the taller tiles and Qwen3-8B); the per-shape
# figures are in docs/benchmarks.md ("Skinny decode GEMM", "Figures moved out of docstrings", "twentieth
# session") and docs/results/gemm_tune*.log.
CONFIGS: dict[tuple[int, int, int], tuple[int, int, int, int, int] | None] = {
    (4096, 1024, 1): None,  # qkv M=1: cuBLAS won
    (4096, 1024, 4): None,  # qkv M<=4: cuBLAS won
    (4096, 1024, 16): None,  # qkv M<=16: cuBLAS won
    (1024, 2048, 1): (32, 128, 8, 4, 3),  # o_proj M=1: split-K beat cuBLAS
    (1024, 2048, 4): (32, 128, 8, 4, 3),  # o_proj M<=4: split-K beat cuBLAS
    (1024, 2048, 16): (32, 128, 8, 4, 3),  # o_proj M<=16: split-K beat cuBLAS
    (6144, 1024, 1): None,  # gate_up M=1: cuBLAS won
    (6144, 1024, 4): None,  # gate_up M<=4: cuBLAS won
    (6144, 1024, 16): None,  # gate_up M<=16: cuBLAS won
    (1024, 3072, 1): (32, 128, 8, 4, 3),  # down M=1: split-K beat cuBLAS
    (1024, 3072, 4): (32, 128, 8, 4, 3),  # down M<=4: split-K beat cuBLAS
    (1024, 3072, 16): (32, 128, 8, 4, 3),  # down M<=16: split-K beat cuBLAS
    (151936, 1024, 1): (64, 256, 1, 4, 3),  # lm_head M=1: beat cuBLAS, at about its weight-read roofline
    (151936, 1024, 4): (64, 256, 1, 4, 3),  # lm_head M<=4: beat cuBLAS
    (151936, 1024, 16): (64, 128, 1, 4, 3),  # lm_head M<=16: beat cuBLAS
    # the 32- and 64-row tiles on the same shapes, and Qwen3-8B's projections at M classes 4-64 (twentieth session,
    # `--presets qwen3-8b`, docs/results/gemm_tune_*_s20_call1.log). Qwen3-8B keeps cuBLAS where its Triton winners
    # alone made the model's decode step slower side by side (`bench.decode_ab`, 8 layers: batches 4-32 took
    # 1.03-1.09x); its one Triton entry (down, class 64) took the batch-64 step to 0.953x.
    (4096, 1024, 32): None,  # qkv M<=32: cuBLAS 4.95 us, best Triton 5.75
    (4096, 1024, 64): None,  # qkv M<=64: cuBLAS 5.34 us, best Triton 5.69
    (1024, 2048, 32): (32, 128, 4, 4, 4),  # o_proj M<=32: 5.33 us, cuBLAS 5.86, roofline 0.98
    (1024, 2048, 64): (32, 128, 4, 4, 4),  # o_proj M<=64: 5.76 us, cuBLAS 5.82, roofline 0.98
    (6144, 1024, 32): None,  # gate_up M<=32: cuBLAS 6.26 us, best Triton 6.87
    (6144, 1024, 64): None,  # gate_up M<=64: cuBLAS 6.44 us, best Triton 6.74
    (1024, 3072, 32): (32, 128, 4, 4, 4),  # down M<=32: 6.05 us, cuBLAS 6.96, roofline 1.48
    (1024, 3072, 64): (32, 128, 4, 4, 4),  # down M<=64: 6.39 us, cuBLAS 7.23, roofline 1.48
    (151936, 1024, 32): (128, 128, 1, 8, 2),  # lm_head M<=32: 79.71 us, cuBLAS 83.34, roofline 72.97
    (151936, 1024, 64): (64, 64, 1, 4, 4),  # lm_head M<=64: 83.79 us, cuBLAS 86.96, roofline 72.97
    (6144, 4096, 4): None,  # qwen3-8b/qkv M<=4: cuBLAS 15.36 us, best Triton 16.04
    (6144, 4096, 16): None,  # qwen3-8b/qkv M<=16: cuBLAS 15.95 us, best Triton 16.34
    (6144, 4096, 32): None,  # qwen3-8b/qkv M<=32: cuBLAS 16.34 us, best Triton 17.11
    (6144, 4096, 64): None,  # qwen3-8b/qkv M<=64: cuBLAS 16.33 us, best Triton 17.64
    (4096, 4096, 4): None,  # qwen3-8b/o_proj M<=4: alone 11.54 us against cuBLAS 12.52, slower in the model
    (4096, 4096, 16): None,  # qwen3-8b/o_proj M<=16: alone 12.05 us against cuBLAS 12.87, slower in the model
    (4096, 4096, 32): None,  # qwen3-8b/o_proj M<=32: alone 12.76 us against cuBLAS 13.29, slower in the model
    (4096, 4096, 64): None,  # qwen3-8b/o_proj M<=64: cuBLAS 12.19 us, best Triton 13.01
    (24576, 4096, 4): None,  # qwen3-8b/gate_up M<=4: alone 48.63 us against cuBLAS 49.77, slower in the model
    (24576, 4096, 16): None,  # qwen3-8b/gate_up M<=16: alone 48.98 us against cuBLAS 50.18, slower in the model
    (24576, 4096, 32): None,  # qwen3-8b/gate_up M<=32: alone 50.69 us against cuBLAS 50.95, slower in the model
    (24576, 4096, 64): None,  # qwen3-8b/gate_up M<=64: cuBLAS 51.77 us, best Triton 52.80
    (4096, 12288, 4): None,  # qwen3-8b/down M<=4: alone 27.28 us against cuBLAS 29.82, slower in the model
    (4096, 12288, 16): None,  # qwen3-8b/down M<=16: alone 27.63 us against cuBLAS 28.29, slower in the model
    (4096, 12288, 32): None,  # qwen3-8b/down M<=32: cuBLAS 29.16 us, best Triton 29.24
    (4096, 12288, 64): (64, 128, 2, 4, 4),  # qwen3-8b/down M<=64: 30.43 us, cuBLAS 30.82, roofline 23.61
}


# The same keys for the SiLU-gated GEMM (x `[M, 2K]`, silu(gate) * up in the prologue); None: the unfused pair
# (`silu_and_mul` kernel + `linear`) was faster. Shapes not in the table use `_CONFIGS` / `default_config`.
GATED_CONFIGS: dict[tuple[int, int, int], tuple[int, int, int, int, int] | None] = {
    (1024, 3072, 1): None,  # down M=1: the unfused pair beat every gated config (docs/results/gemm_tune_gated.log)
    (1024, 3072, 4): None,  # down M<=4: the unfused pair beat every gated config
    (1024, 3072, 16): None,  # not swept; the prologue lost at every swept M
    (1024, 3072, 32): None,  # down_gated M<=32: unfused 7.19 us, best Triton 10.64
    (1024, 3072, 64): None,  # down_gated M<=64: unfused 8.48 us, best Triton 14.14
    (4096, 12288, 4): None,  # qwen3-8b/down_gated M<=4: unfused 33.34 us, best Triton 48.33
    (4096, 12288, 16): None,  # qwen3-8b/down_gated M<=16: unfused 31.64 us, best Triton 48.83
    (4096, 12288, 32): None,  # qwen3-8b/down_gated M<=32: unfused 31.14 us, best Triton 60.04
    (4096, 12288, 64): None,  # qwen3-8b/down_gated M<=64: unfused 42.70 us, best Triton 52.19
}
