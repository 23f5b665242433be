set -u
out=$OUT
quiet() { grep -v -E '^[EW][0-9]{4} |Warning|warn_once|^$' ; }
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
timeout 200 python3 -m pytest -q -m gpu tests/gpu -p no:cacheprovider -n 6 --timeout 180 2>&1 | quiet | tee $out/gpu_tests.log | tail -25
timeout 120 python3 -m bench.decode_ab --variants "old:GRAPHLINE_GEMV=0" "gemv:GRAPHLINE_GEMV=1" "gemv_pdl:GRAPHLINE_GEMV=1;GRAPHLINE_PDL=early" --batches 1,2,64 --rounds 6 --steps 100 --out $out/decode_ab.json 2>&1 | quiet | tee $out/decode_ab.log | tail -5
timeout 150 python3 -m bench.dist_bench --model qwen3-0.6b --tp 1 --batches 1,64 --paths pipe --steps 300 --decode-steps 8 --armed-wait-ms 20 --out $out/dist_bench.json 2>&1 | quiet | tee $out/dist_bench.log | tail -22
timeout 90 python3 -m bench.profile_step --model qwen3-0.6b --batch 1 --context 128 2>&1 | quiet > $out/profile_step.log; grep -E "timeline|host_pre|_kernel|nvjet" $out/profile_step.log | head -20
