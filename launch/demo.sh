#!/usr/bin/env bash
# The main job (README): set up what the demo needs (scripts/setup_env.sh demo: torch, tiledmlp, transformers), then
# train a small Llama built in code (vocabulary 32,000, 2 layers) for 2 steps on 2 CPU processes (gloo) under DDP,
# 8,192 tokens per process: untiled, then tiled (the MLPs and the LM head + loss), from the same seed and data. At
# that length the logits (8,192 x 32,000 in float32, 1 GiB, and their gradient) dominate the untiled peak; tiled,
# they never exist whole. Each process checks that tiled equals untiled (losses, gradients, parameters; exit status 1
# if not), and the peak memory and step time of both runs are printed. A few minutes on 2 CPU cores. Extra arguments
# go to launch/train.py (they override the ones below).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh demo
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec "${PYTHON:-python3}" -m torch.distributed.run --standalone --nproc-per-node "${NPROC:-2}" \
    launch/train.py --wrap ddp --tiling auto --compare --vocab 32000 --seq-len 8192 --batch-size 1 --steps 2 \
    --tile-tokens auto "$@"
