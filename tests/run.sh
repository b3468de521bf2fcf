#!/usr/bin/env bash
# The test command (README, CI): set up the environment (and the DeepSpeed extra), then the whole suite —
# single-process unit tests (Triton kernels through TRITON_INTERPRET=1 on CPU) and the torchrun
# distributed suite (gloo on CPU, NCCL on GPUs), DeepSpeed ZeRO included.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
# The DeepSpeed ZeRO suite's extra (not the demo's: setup_env.sh leaves it out).
if ! "${PYTHON:-python3}" -c "import deepspeed" >/dev/null 2>&1; then
    echo "[tests] installing the deepspeed test extra"
    "${PYTHON:-python3}" -m pip install --quiet -e ".[deepspeed]"
fi
# Paths given replace the default one (tests): `bash tests/run.sh tests/unit -k lora` runs the unit suite only.
paths=(tests)
for arg in "$@"; do
    if [[ "$arg" != -* && -e "${arg%%::*}" ]]; then
        paths=()
        break
    fi
done
exec "${PYTHON:-python3}" -m pytest "${paths[@]}" -q -p no:cacheprovider "$@"
