#!/usr/bin/env bash
# One device call: the GPU test suites and the benchmarks, logs and JSON into $OUT.
#   bash bench/device_suite.sh tests     # gpu + multigpu tests, graph and launch benchmarks
#   bash bench/device_suite.sh benches   # all-reduce, GEMM sweep, distributed and serving benchmarks
#   bash bench/device_suite.sh owed      # the figures the open issues still owe (docs/benchmarks.md, thirteenth
#                                        # session)
set -u
out="${OUT:-artifacts}"; mkdir -p "$out"
ngpu=$(python3 -c 'import torch; print(torch.cuda.device_count())')
# test workers: 6 fit an H200's 141 GB; an 80 GB H100 ran out of memory with 8 and passed with 4
workers=$(python3 -c 'import torch; print(6 if torch.cuda.get_device_properties(0).total_memory > 100 * 2**30 else 4)')
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
quiet() { grep -v -E '^[EW][0-9]{4} |Warning|warn_once|^$' ; }
case "${1:-tests}" in
tests)
  # 952 tests: one run took over 270 s on an H100 with 4 workers (docs/benchmarks.md, twenty-eighth session)
  timeout 420 python3 -m pytest -q -m gpu tests/gpu -p no:cacheprovider -n "$workers" --timeout 240 -rf 2>&1 | quiet | tee "$out/gpu_tests.log" | tail -8
  if [ "$ngpu" -ge 2 ]; then
    timeout 260 python3 -m pytest -q -m multigpu tests/multigpu -p no:cacheprovider --timeout 240 -rs 2>&1 | quiet | tee "$out/multigpu_tests.log" | tail -15
  fi
  timeout 130 python3 -m bench.graph_bench --out "$out/graph_bench.json" 2>&1 | quiet | tee "$out/graph_bench.log" | tail -16
  timeout 60 python3 -m bench.launch_bench --sections chains,segments --out "$out/launch_bench.json" 2>&1 | quiet | tee "$out/launch_bench.log" | tail -12
  ;;
benches)
  if [ "$ngpu" -ge 2 ]; then
    timeout 150 python3 -m pytest -q -m multigpu tests/multigpu -k "ep or reset" -p no:cacheprovider --timeout 140 2>&1 | quiet | tee "$out/multigpu_ep.log" | tail -4
    timeout 70 python3 -m bench.allreduce_bench --out "$out/allreduce_bench.json" 2>&1 | quiet | tee "$out/allreduce_bench.log" | tail -8
  fi
  timeout 300 python3 -m bench.gemm_tune --out "$out/gemm_tune.json" 2>&1 | quiet | tee "$out/gemm_tune.log" | tail -20
  tps=1; [ "$ngpu" -ge 2 ] && tps=1,2
  timeout 100 python3 -m bench.step_trace --tp 1 --batches 1,64 --armed-wait-ms 20,0 --out "$out/step_trace.json" 2>&1 | quiet | tee "$out/step_trace.log" | grep "^tp="
  timeout 60 python3 -m bench.launch_idle --out "$out/launch_idle.json" 2>&1 | quiet | tee "$out/launch_idle.log" | tail -4
  timeout 200 python3 -m bench.dist_bench --model qwen3-0.6b --tp "$tps" --batches 1,64 --paths pipe,compiled --steps 200 --decode-steps 8 --armed-wait-ms 20,0 --out "$out/dist_bench.json" 2>&1 | quiet | tee "$out/dist_bench.log" | tail -16
  for k in 1 8; do
    timeout 110 python3 bench/serve_bench.py --model qwen3-0.6b --server-arg=--decode-steps=$k --out "$out/serve_bench_steps$k.json" 2>&1 | grep -v "\[server\]" | tee "$out/serve_bench_steps$k.log" | tail -6
  done
  timeout 110 python3 bench/serve_bench.py --model qwen3-0.6b --server-arg=--armed-decode-wait-ms=0 --out "$out/serve_bench_unarmed.json" 2>&1 | grep -v "\[server\]" | tee "$out/serve_bench_unarmed.log" | tail -6
  timeout 400 python3 -m bench.prefill_bench --model qwen3-0.6b --out "$out/prefill_bench.json" 2>&1 | quiet | tee "$out/prefill_bench.log" | tail -16
  timeout 110 python3 bench/serve_bench.py --model qwen3-0.6b --server-arg=--overlap --out "$out/serve_bench_overlap.json" 2>&1 | grep -v "\[server\]" | tee "$out/serve_bench_overlap.log" | tail -6
  ;;
owed)
  # thirty-seventh session: lm-eval loglikelihood requests against plain one-token ones; constrained (json_object)
  # against free serving at Qwen3's vocabulary (random-weight 0.6B shape, synthetic tokenizer); the grammar masks'
  # host cost on this machine's cores
  timeout 120 python3 -m bench.loglikelihood_bench --model qwen3-0.6b --concurrency 1,8 --requests-per-client 6 --prompt-len 512 --max-model-len 2048 --out "$out/loglikelihood_bench.json" 2>&1 | grep -v "\[server\]" | tee "$out/loglikelihood_bench.log" | tail -8
  timeout 60 python3 -m bench.structured_checkpoint --out /tmp/q06 --no-sampling-defaults 2>&1 | tail -1
  timeout 200 python3 -m launch bench --model /tmp/q06 --response-format json_object --temperature 1.0 --concurrency 1,16 --requests-per-client 3 --prompt-len 128 --max-tokens 96 --out "$out/structured_serve.json" 2>&1 | grep -v "\[server\]" | tee "$out/structured_serve.log" | tail -8
  timeout 60 python3 -m bench.grammar_mask_bench 2>&1 | quiet | tee "$out/grammar_mask_bench.log" | tail -6
  # issue 20: sampled vs greedy through the coordinator, with top_k 50 and logprobs, armed and not
  timeout 110 python3 -m bench.dist_bench --model qwen3-0.6b --tp 1 --batches 1,8,64 --paths pipe --sampling greedy,t1_p0.9,t1_k50,greedy_lp5,t1_p0.9_lp5 --steps 150 --armed-wait-ms 20,0 --out "$out/dist_bench_sampling.json" 2>&1 | quiet | tee "$out/dist_bench_sampling.log" | grep -E "^1 |sampled /"
  timeout 60 python3 -m bench.sampler_bench --batches 1,8,64 --out "$out/sampler_bench.json" 2>&1 | quiet | tee "$out/sampler_bench.log" | tail -5
  timeout 120 python3 bench/serve_bench.py --model qwen3-0.6b --temperature 1.0 --top-p 0.9 --compare-greedy --concurrency 1,64 --requests-per-client 4 --out "$out/serve_sampled.json" 2>&1 | grep -v "\[server\]" | tail -8
  # issue 22: TTFT over HTTP at 1 client with and without full prefill graphs; TTFT, chunking, prefix caching
  for pg in 2048 0; do
    timeout 60 python3 bench/serve_bench.py --model qwen3-0.6b --concurrency 1 --requests-per-client 24 --server-arg=--prefill-graph-max-tokens=$pg --out "$out/serve_ttft_pg$pg.json" 2>&1 | grep -v "\[server\]" | tail -4
  done
  timeout 90 python3 -m bench.ttft_trace --model qwen3-0.6b --out "$out/ttft_trace.json" 2>&1 | quiet | tail -9
  timeout 120 python3 -m bench.prefill_bench --model qwen3-0.6b --out "$out/prefill_bench.json" 2>&1 | quiet | tee "$out/prefill_bench.log" | tail -16
  timeout 90 python3 -m bench.mixed_step --model qwen3-0.6b --out "$out/mixed_step.json" 2>&1 | quiet | tee "$out/mixed_step.log" | tail -7
  # issue 24: every layer of every shape
  timeout 400 python3 -m bench.model_sweep --out "$out/model_sweep.json" 2>&1 | quiet | tee "$out/model_sweep.log" | tail -8
  # issue 24, MoE prefill: the experts captured inside the piecewise pieces (the default since the thirtieth
  # session) against an eager boundary (GRAPHLINE_MOE_IN_PIECES=0)
  timeout 200 python3 -m bench.prefill_ab --model qwen3-30b-a3b --layers 8 --cases 512,2048,4096,8x256,16x128 \
    --out "$out/prefill_ab_moe.json" 2>&1 | quiet | tee "$out/prefill_ab_moe.log" | tail -6
  # issue 24, MoE decode: pair-by-pair experts up to 4 tokens against the default (2) and the grouped kernels, and
  # the batch-3 step that measured slower than batch 4 (twenty-eighth session)
  timeout 120 python3 -m bench.decode_ab --model qwen3-30b-a3b --layers 8 --batches 1,2,3,4,8 --rounds 6 --steps 50 \
    --random-tokens --variants "grouped:GRAPHLINE_MOE_PAIRS_MAX=0" "pairs:" "pairs32:GRAPHLINE_MOE_PAIRS_MAX=32" \
    --out "$out/ab_moe_pairs.json" 2>&1 | quiet | tee "$out/ab_moe_pairs.log" | tail -6
  ;;
esac
