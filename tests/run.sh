#!/usr/bin/env bash
# The test command (README, CI): set up the environment, then the whole suite — single-process unit
# tests (Triton kernels through TRITON_INTERPRET=1 on CPU) and the torchrun distributed suite (gloo
# on CPU, NCCL on GPUs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec "${PYTHON:-python3}" -m pytest tests -q -p no:cacheprovider "$@"
