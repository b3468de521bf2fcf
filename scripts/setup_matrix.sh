#!/usr/bin/env bash
# One version set of CI's matrix in its own virtual environment: ${TILEDMLP_VENVS:-.venvs}/NAME, made from the pins
# of scripts/versions/NAME.txt (lowest: pyproject.toml's floors; newest: the newest the package index serves), then
# this checkout (editable) with its test and deepspeed extras. Idempotent: an environment made from the same pins is
# reused. Prints the environment's Python last, for PYTHON= of tests/run.sh.
#
#   PYTHON=$(bash scripts/setup_matrix.sh lowest | tail -n 1) bash tests/run.sh tests/unit
set -euo pipefail
cd "$(dirname "$0")/.."
NAME=${1:?"usage: bash scripts/setup_matrix.sh NAME (a file of scripts/versions/: $(ls scripts/versions))"}
PINS=scripts/versions/$NAME.txt
[[ -f "$PINS" ]] || { echo "[matrix] no $PINS (there are: $(ls scripts/versions))" >&2; exit 2; }
VENV=$(realpath -m "${TILEDMLP_VENVS:-.venvs}/$NAME")
PY=$VENV/bin/python
# The pins are pip's only constraints here: they replace any of the machine's own (a cap below the newest torch).
export PIP_CONSTRAINT=$PWD/$PINS
start=$SECONDS

if ! cmp -s "$PINS" "$VENV/pins.txt" \
        || ! (cd / && "$PY" -c "import torch, transformers, peft, trl, deepspeed, bitsandbytes, tiledmlp") >/dev/null 2>&1
then
    if [[ -e "$VENV" && ! -f "$VENV/pyvenv.cfg" ]]; then
        echo "[matrix] $VENV exists and is not a virtual environment: set TILEDMLP_VENVS to another folder" >&2
        exit 1
    fi
    echo "[matrix] making $VENV from $PINS" >&2
    "${BASE_PYTHON:-python3}" -m venv --clear "$VENV"
    # torch (and the triton pinned with it) first, so that the extras resolve around it
    "$PY" -m pip install -qq $(grep -E '^(torch|triton)==' "$PINS") >&2
    "$PY" -m pip install -qq -e ".[test,deepspeed]" >&2
    cp "$PINS" "$VENV/pins.txt"
fi
(cd / && "$PY" -c "import torch, triton, transformers, peft, trl, deepspeed, bitsandbytes
print(f'[matrix] $NAME: torch {torch.__version__}, triton {triton.__version__}, transformers {transformers.__version__},'
      f' peft {peft.__version__}, trl {trl.__version__}, deepspeed {deepspeed.__version__},'
      f' bitsandbytes {bitsandbytes.__version__} ($((SECONDS - start)) s)')") >&2
echo "$PY"
