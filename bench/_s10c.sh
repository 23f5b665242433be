set -u
out=$OUT
quiet() { grep -v -E '^[EW][0-9]{4} |Warning|warn_once|^$' ; }
timeout 100 python3 -m pytest -q -m gpu tests/gpu/test_pdl.py tests/gpu/test_triton_gemv.py tests/gpu/test_kernel_warm_up.py -p no:cacheprovider -n 4 --timeout 90 2>&1 | quiet | tee $out/gpu_tests_pdl.log | tail -4
for tp in 2 1; do
  TRITON_CACHE_DIR=$(mktemp -d) timeout 100 python3 -m bench.dist_bench --model qwen3-0.6b --tp $tp --batches 1 --paths pipe --steps 30 --decode-steps 1 --quiet 2>&1 | quiet | grep -v "capture x" | tee $out/cold_start_tp$tp.log | tail -4
done
timeout 150 python3 -m bench.decode_ab --variants "old:GRAPHLINE_GEMV=0;GRAPHLINE_PDL=0" "old_pdl:GRAPHLINE_GEMV=0;GRAPHLINE_PDL=early" "gemv:GRAPHLINE_GEMV=1;GRAPHLINE_PDL=0" "gemv_pdl:GRAPHLINE_GEMV=1;GRAPHLINE_PDL=early" --batches 1,2,64 --rounds 6 --steps 100 --out $out/decode_ab.json 2>&1 | quiet | tee $out/decode_ab.log | tail -4
