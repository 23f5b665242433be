set -u
out=$OUT
quiet() { grep -v -E '^[EW][0-9]{4} |Warning|warn_once|^$' ; }
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 130 python3 -m pytest -q -m gpu tests/gpu -p no:cacheprovider -n 6 --timeout 120 2>&1 | quiet | tee $out/gpu_tests.log | tail -6
timeout 240 python3 -m pytest -q -m multigpu tests/multigpu -p no:cacheprovider --timeout 200 -rs 2>&1 | quiet | tee $out/multigpu_tests.log | tail -12
timeout 190 python3 -m bench.dist_bench --model qwen3-0.6b --tp 1,2 --batches 1,64 --paths pipe --steps 300 --decode-steps 8 --armed-wait-ms 20 --out $out/dist_bench.json 2>&1 | quiet | grep -v "capture x" | tee $out/dist_bench.log | tail -22
