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
# The Axolotl plugin end to end, in Axolotl's own environment (scripts/test_axolotl.sh): with the whole suite, when
# asked for. Making that environment is a ~2 GB install (about 3-4 min here, 5 min in all on a 2-core CPU box;
# 2 min once made), more than the suite's 20-minute CI budget has left.
if [[ ${#paths[@]} -gt 0 ]]; then
    if [[ "${TILEDMLP_TEST_AXOLOTL:-0}" == 1 ]]; then
        bash scripts/test_axolotl.sh
    else
        echo "[tests] scripts/test_axolotl.sh skipped: it installs Axolotl 0.19.0 with its pinned transformers, peft" \
             "and trl in a virtual environment (~2 GB, about 5 min on a 2-core CPU box), more than CI's 20 minutes" \
             "leave; TILEDMLP_TEST_AXOLOTL=1 runs it"
    fi
fi
# The whole suite: the single-process unit tests in TILEDMLP_TEST_WORKERS processes (pytest-xdist; default 2, CI's
# cores: 5 min instead of 8.5 on a 2-core box), then the distributed suite alone, whose every case launches 2-4
# processes of its own (run beside other tests they would contend for the cores).
if [[ "${paths[*]}" == tests ]]; then
    status=0
    # worksteal: a worker left idle takes tests queued for the other (a few tests take over a minute)
    "${PYTHON:-python3}" -m pytest tests/unit -q -p no:cacheprovider -n "${TILEDMLP_TEST_WORKERS:-2}" --dist worksteal \
        "$@" || status=$?
    "${PYTHON:-python3}" -m pytest tests/distributed -q -p no:cacheprovider "$@" || status=$?
    exit "$status"
fi
exec "${PYTHON:-python3}" -m pytest "${paths[@]}" -q -p no:cacheprovider "$@"
