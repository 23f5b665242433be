set -u
out="$OUT"; nvidia-smi --query-gpu=name --format=csv,noheader
quiet() { grep -v -E '^[EW][0-9]{4} |Warning|warn_once|^$' ; }
timeout 200 python3 -m bench.step_trace --tp 1,2 --batches 1,64 --out "$out/step_trace.json" 2>&1 | quiet | tee "$out/step_trace.log" | tail -6
timeout 150 python3 bench/serve_bench.py --model qwen3-0.6b --server-arg=--overlap --out "$out/serve_overlap_cold.json" 2>&1 | grep -v "\[server\]" | tee "$out/serve_overlap_cold.log" | tail -6
python3 - <<'PY' 2>&1 | tee "$out/triton_cache.log"
import collections, glob, os, json
c = collections.Counter()
for f in glob.glob(os.path.expanduser("~/.triton/cache/*/*.json")):
    n = os.path.basename(f)[:-5]
    if not n.startswith("__grp__"):
        c[n] += 1
for n, k in sorted(c.items()): print(f"{k:3d} {n}")
PY
