#!/usr/bin/env bash
# The main job (README): set up the environment, then train the built-in tiny Llama for a few steps
# on 2 CPU processes (gloo) under DDP, untiled and tiled (MLPs and the LM head + loss; a small loss
# scratch budget, so its tiny vocabulary is cut into several shards too) from the same seed and data,
# and report the parameter difference (exit status 1 if it exceeds the tolerance). Extra arguments go
# to train.py.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec "${PYTHON:-python3}" -m torch.distributed.run --standalone --nproc-per-node "${NPROC:-2}" \
    launch/train.py --wrap ddp --tiling auto --compare --loss-scratch-mib 0.05 "$@"
