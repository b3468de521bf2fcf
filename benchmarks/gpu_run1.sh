#!/usr/bin/env bash
# First GPU session: environment, accumulation options, GPU tests, MLP benchmark (SiLU).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/env.txt"
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" | tee -a "$OUT/env.txt"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
python3 benchmarks/bench_accum.py 2>&1 | tee "$OUT/accum.txt"
timeout 240 python3 -m pytest tests/unit/test_cuda.py tests/unit/test_kernels.py -q -x -k "cuda or CUDA" 2>&1 | tail -15 | tee "$OUT/gpu_tests.txt"
timeout 300 python3 benchmarks/bench_mlp.py --seq-lens 8192,32768,131072 2>&1 | tail -30 | tee "$OUT/bench_silu.txt"
cp benchmarks/results/* "$OUT"/ 2>/dev/null
