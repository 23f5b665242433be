"""The serving benchmark from a checkout: `python -m bench.serve_bench ...` is `graphline bench ...`
(`launch/bench.py` owns the client, the options and the report)."""
from __future__ import annotations

from launch.bench import main

if __name__ == "__main__":
    raise SystemExit(main())
