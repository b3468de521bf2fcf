#!/usr/bin/env bash
# Installs what tiledmlp's demo and tests need, idempotently, into the current Python.
# CPU boxes: torch is installed first as the CPU build (pip install torch==2.13.0), so that pip never
# resolves the CUDA wheels when a dependency asks for torch. A box that already has torch keeps it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    echo "[setup] no torch found: installing the CPU build torch==2.13.0"
    "$PY" -m pip install --quiet "torch==2.13.0"
fi
if ! "$PY" -c "import tiledmlp, transformers, peft, pytest, pytest_timeout, triton, matplotlib, bitsandbytes, trl" >/dev/null 2>&1; then
    echo "[setup] installing tiledmlp (editable) with its test extras"
    "$PY" -m pip install --quiet -e ".[test]"
fi
"$PY" -c "import torch, tiledmlp; print(f'[setup] torch {torch.__version__}, tiledmlp {tiledmlp.__version__}')"
