#!/usr/bin/env bash
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
python3 benchmarks/profile_mlp.py --tokens 8192 --tile-tokens 8192 --inter-chunks 1
python3 benchmarks/profile_mlp.py --tokens 32768 --tile-tokens 8192 --inter-chunks 1 --rows 16
