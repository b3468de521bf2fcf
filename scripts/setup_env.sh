#!/usr/bin/env bash
# Installs what tiledmlp's demo or tests need, idempotently, into the current Python (the active virtual environment,
# or ${PYTHON:-python3}): `bash scripts/setup_env.sh demo` what launch/demo.sh needs (tiledmlp editable with the
# `demo` extra: transformers), `bash scripts/setup_env.sh [test]` what the tests need (the `test` extras: pytest,
# transformers, peft, TRL, bitsandbytes, matplotlib; tests/run.sh adds DeepSpeed). Only what is missing is installed.
# torch: kept if present; else torch==2.13.0 from the index pip is set up with, where the Linux wheel on PyPI is the
# CUDA build (several GB): TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu installs the CPU build instead.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHAT=${1:-test}

case "$WHAT" in
    demo) EXTRA=demo; NEEDS="tiledmlp, transformers" ;;
    test) EXTRA=test
          NEEDS="tiledmlp, transformers, peft, pytest, pytest_timeout, triton, matplotlib, bitsandbytes, trl" ;;
    *) echo "usage: bash scripts/setup_env.sh [demo|test]" >&2; exit 2 ;;
esac
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    echo "[setup] no torch found: installing torch==2.13.0 from ${TORCH_INDEX_URL:-the configured package index}"
    "$PY" -m pip install --quiet "torch==2.13.0" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
fi
if ! "$PY" -c "import $NEEDS" >/dev/null 2>&1; then
    echo "[setup] installing tiledmlp (editable) with its $EXTRA extras"
    "$PY" -m pip install --quiet -e ".[$EXTRA]"
fi
"$PY" -c "import torch, tiledmlp; print(f'[setup] torch {torch.__version__}, tiledmlp {tiledmlp.__version__}')"
