#!/usr/bin/env bash
# tiledmlp's Axolotl plugin, end to end in Axolotl's own environment (it pins its transformers, peft and trl):
# a virtual environment with the CPU build of torch and Axolotl (${AXOLOTL_VENV:-.venv-axolotl}, made once, reused
# while it has that Axolotl), then `axolotl train` of a tiny Llama built from its config (random weights, a word-level
# tokenizer, a local jsonl dataset: nothing downloaded) twice, with the plugin and without, same seed, 4 steps of 2x2
# sequences: the logged losses agree within 1e-5 (relative). A config with `tiled_mlp: true` beside the plugin is
# refused with the fix named, and the plugin's unit tests run with Axolotl installed.
#
#   bash scripts/test_axolotl.sh            # AXOLOTL_VERSION=0.19.0, TORCH_VERSION=2.13.0 (CPU build)
#
# CI (tests/run.sh) runs it only with TILEDMLP_TEST_AXOLOTL=1: the environment is a ~2 GB download.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=$(realpath -m "${AXOLOTL_VENV:-.venv-axolotl}")
AXOLOTL_VERSION=${AXOLOTL_VERSION:-0.19.0}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
BASE=${PYTHON:-python3}
PY="$VENV/bin/python"
start=$SECONDS

# (from /, so that the checkout's own tiledmlp/ folder is not what imports)
if ! (cd / && "$PY" -c "import axolotl, sys; sys.exit(axolotl.__version__ != '$AXOLOTL_VERSION')") >/dev/null 2>&1; then
    if [[ -e "$VENV" && ! -f "$VENV/pyvenv.cfg" ]]; then
        echo "[axolotl] $VENV exists and is not a virtual environment: set AXOLOTL_VENV to another path"
        exit 1
    fi
    if (cd / && "$BASE" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')") 2>/dev/null
    then
        # this Python's torch (CI: the CPU build scripts/setup_env.sh installed) serves the venv as well
        echo "[axolotl] making $VENV over $BASE's torch $TORCH_VERSION: axolotl $AXOLOTL_VERSION"
        "$BASE" -m venv --clear --system-site-packages "$VENV"
    else
        echo "[axolotl] making $VENV: torch $TORCH_VERSION (CPU build), axolotl $AXOLOTL_VERSION"
        "$BASE" -m venv --clear "$VENV"
        "$PY" -m pip install --quiet "torch==$TORCH_VERSION" \
            --index-url "${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}"
    fi
    # the torch there stays: pip would otherwise take the CUDA build for a dependency asking for torch
    echo "torch==$TORCH_VERSION" > "$VENV/constraints.txt"
    "$PY" -m pip install --quiet -c "$VENV/constraints.txt" "axolotl==$AXOLOTL_VERSION" pytest pytest-timeout
fi
if ! (cd / && "$PY" -c "import tiledmlp, sys; sys.exit(not tiledmlp.__file__.startswith('$ROOT/'))") >/dev/null 2>&1
then
    "$PY" -m pip install --quiet --no-deps -e .      # this checkout, without its test extras (Axolotl's pins stay)
fi
(cd / && "$PY" -c "import axolotl, torch, transformers, peft, trl, accelerate, tiledmlp
print(f'[axolotl] axolotl {axolotl.__version__}, torch {torch.__version__}, transformers {transformers.__version__}, '
      f'peft {peft.__version__}, trl {trl.__version__}, accelerate {accelerate.__version__}, tiledmlp {tiledmlp.__version__}')" \
      2>/dev/null)
ready=$SECONDS
echo "[axolotl] environment ready in $((ready - start)) s"

WORK=$(mktemp -d "${TMPDIR:-/tmp}/tiledmlp-axolotl.XXXXXX")
export PATH="$VENV/bin:$PATH" CUDA_VISIBLE_DEVICES="" OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} \
    HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 AXOLOTL_DO_NOT_TRACK=1 DO_NOT_TRACK=1 WANDB_MODE=disabled
"$PY" scripts/axolotl_e2e.py make "$WORK" > "$WORK/make.log" 2>&1 || { cat "$WORK/make.log"; exit 1; }
for run in untiled tiled; do
    if ! (cd "$WORK" && axolotl train "$run.yml" > "$run.log" 2>&1); then
        tail -n 60 "$WORK/$run.log"
        echo "[axolotl] FAILED: axolotl train $run.yml (in $WORK)"
        exit 1
    fi
done
# Axolotl trains without a plugin it cannot import (it logs "Failed to load plugin"): the tiled run must say it tiled
if ! grep -o "TiledMLPPlugin: tiled .*" "$WORK/tiled.log"; then
    grep -A3 "Failed to load plugin" "$WORK/tiled.log" || true
    echo "[axolotl] FAILED: the tiled run says nothing tiled (in $WORK)"
    exit 1
fi
if grep -q "TiledMLPPlugin" "$WORK/untiled.log"; then echo "[axolotl] FAILED: the untiled run tiled"; exit 1; fi
"$PY" scripts/axolotl_e2e.py compare "$WORK"

# refused with the fix named: tiled_mlp (DeepSpeed's TiledMLP) beside the plugin
printf 'tiled_mlp: true\n' >> "$WORK/tiled.yml"
if (cd "$WORK" && axolotl train tiled.yml > refused.log 2>&1) || ! grep -q "set tiled_mlp: false" "$WORK/refused.log"; then
    tail -n 30 "$WORK/refused.log"
    echo "[axolotl] FAILED: tiled_mlp: true beside the plugin was not refused"
    exit 1
fi
echo "[axolotl] tiled_mlp: true beside the plugin: refused ($(grep -o "tiledmlp and Axolotl's tiled_mlp[^:]*" "$WORK/refused.log" | head -n 1))"

"$PY" -m pytest -q -p no:cacheprovider tests/unit/test_axolotl_plugin.py
rm -rf "$WORK"
echo "[axolotl] passed: runs $((SECONDS - ready)) s, environment $((ready - start)) s, in all $((SECONDS - start)) s"
