set -u
out="$OUT"; q() { grep -v -E '^[EW][0-9]{4} |Warning|warn_once|^$' ; }
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 70 python3 -m bench.allreduce_bench --out "$out/allreduce_bench.json" 2>&1 | q | tee "$out/allreduce_bench.log" | tail -14
timeout 280 python3 -m pytest -q -m multigpu tests/multigpu -p no:cacheprovider --timeout 260 -rs -x 2>&1 | q | tee "$out/multigpu_tests.log" | tail -25
timeout 200 python3 -m bench.dist_bench --model qwen3-0.6b --tp 1,2 --batches 1,64 --paths pipe --steps 200 --out "$out/dist_bench.json" 2>&1 | q | tee "$out/dist_bench.log" | tail -12
