#!/usr/bin/env bash
# Run the distributed test suite (tests/distributed) and print one line per case.
#
#   launch/run_distributed_tests.sh [NPROC] [pytest args...]
#   launch/run_distributed_tests.sh 2 tests/distributed/test_sp.py -k ulysses   # paths given replace the suite's
#   launch/run_distributed_tests.sh 2 -n 4 --dist loadgroup  # pytest-xdist: 4 workers, one launch's tests each
#                                                            # (a matrix launch's or a file's: see its conftest.py),
#                                                            # sharing the GPUs (2 x H100, by file: 6 min 20 s, not 17)
#
# With GPUs: NPROC processes, one per GPU, NCCL (default: all GPUs). Without: NPROC CPU processes,
# gloo (default 2). Every case trains the same model untiled and tiled under the same wrapper and
# compares parameters and collective counts; the table at the end has the numbers per case.
# The reshard_after_forward=int case needs 4 processes: it runs on 4 GPUs when there are, else on 4
# CPU processes.
set -euo pipefail
cd "$(dirname "$0")/.."
# torchrun's workers import tiledmlp from this checkout, installed or not (GPU boxes without network).
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if [[ $# -gt 0 && "$1" =~ ^[0-9]+$ ]]; then
    export TILEDMLP_TEST_NPROC="$1"
    shift
fi

"${PYTHON:-python3}" - <<'PY'
import platform
import torch, transformers, peft
gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
print(f"python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}, "
      f"peft {peft.__version__}")
print(f"devices: {', '.join(gpus) + ' (NCCL)' if gpus else 'CPU only (gloo)'}")
PY

# Paths given (test files, or file::case) replace the whole suite, in the order given: without this they were added
# to it, and a GPU call that meant to run five files ran the suite from its first file until its time was up.
paths=(tests/distributed)
for arg in "$@"; do
    if [[ "$arg" != -* && -e "${arg%%::*}" ]]; then
        paths=()
        break
    fi
done
exec "${PYTHON:-python3}" -m pytest "${paths[@]}" -v -rfE -p no:cacheprovider "$@"
