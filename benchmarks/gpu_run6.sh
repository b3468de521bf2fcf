#!/usr/bin/env bash
# Full single-GPU benchmark, part 2: GEGLU (tanh) MLP and a Mixtral-shaped MoE block.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD:$PWD/benchmarks
timeout 240 python3 benchmarks/bench_mlp.py --act gelu_tanh --seq-lens 8192,32768,131072 --reps 9 2>&1 | grep -v Warning | tail -22 | tee "$OUT/bench_gelu.txt"
timeout 300 python3 benchmarks/bench_mlp.py --moe --seq-lens 8192,32768 2>&1 | grep -v Warning | tail -12 | tee "$OUT/bench_moe.txt"
cp benchmarks/results/bench_mlp_*gelu* benchmarks/results/bench_moe_* "$OUT"/ 2>/dev/null
