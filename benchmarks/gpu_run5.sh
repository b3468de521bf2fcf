#!/usr/bin/env bash
# Full single-GPU benchmark, part 1: checkpointed layer, SiLU MLP 8K..1M tokens.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD:$PWD/benchmarks
timeout 150 python3 benchmarks/bench_checkpoint.py 2>&1 | tee "$OUT/checkpoint.txt"
timeout 400 python3 benchmarks/bench_mlp.py --seq-lens 8192,32768,131072,524288,1048576 --reps 9 2>&1 | grep -v Warning | tail -45 | tee "$OUT/bench_silu.txt"
cp benchmarks/results/bench_checkpoint* benchmarks/results/bench_mlp_* "$OUT"/ 2>/dev/null
