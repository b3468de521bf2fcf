#!/usr/bin/env bash
# Second GPU session: accumulation options again (in-place path now used), the tile sweep.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD:$PWD/benchmarks
timeout 120 python3 -m pytest tests/unit/test_cuda.py -q -x 2>&1 | tail -5 | tee "$OUT/gpu_tests.txt"
timeout 420 python3 benchmarks/bench_tiles.py 2>&1 | tee "$OUT/tiles.txt"
cp benchmarks/results/bench_tiles* "$OUT"/ 2>/dev/null
