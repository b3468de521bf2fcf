#!/usr/bin/env bash
# Every single-GPU benchmark behind docs/benchmarks.md and docs/sharding.md, in one call on a GPU box
# without network (carry the wheels in .whl/, see benchmarks/README.md). Results land in
# benchmarks/results/ and, when $OUT is set (the device tool), are copied there too.
#   benchmarks/run_gpu.sh [all|mlp|styles|tiles|moe|checkpoint|accum|gemms|paired|loss|decode|compile|longctx|longctx-max|
#                          optimizer-plan|optimizer-scaled|optimizer-80g|optimizer-32l]
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:$PWD/benchmarks:${PYTHONPATH:-}
what=${1:-all}
started=$(mktemp)  # results written after this are this run's
run() { [[ $what == all || $what == "$1" ]]; }
run accum && python3 benchmarks/bench_accum.py
run gemms && python3 benchmarks/bench_gemm_shapes.py
run checkpoint && python3 benchmarks/bench_checkpoint.py
run tiles && python3 benchmarks/bench_tiles.py
run mlp && python3 benchmarks/bench_mlp.py --seq-lens 8192,32768,131072,524288,1048576 --reps 9 \
    && python3 benchmarks/bench_mlp.py --act gelu_tanh --seq-lens 8192,32768,131072 --reps 9
# MLP styles (issue 12): GLUs however written against the act_fn module; plain MLPs at GPT-2-XL and Phi-2 shapes
run styles && python3 benchmarks/bench_mlp.py --style act_fn,inline,torchtitan --providers eager,liger_tiled,tiledmlp \
    && python3 benchmarks/bench_mlp.py --style plain,conv1d --hidden 1600 --intermediate 6400 --providers eager,tiledmlp,tiledmlp_fp32acc \
    && python3 benchmarks/bench_mlp.py --style plain --hidden 2560 --intermediate 10240 --providers eager,tiledmlp,tiledmlp_fp32acc
run moe && python3 benchmarks/bench_moe.py --e2e
run paired && python3 benchmarks/bench_paired.py && python3 benchmarks/bench_paired.py --act gelu_tanh
run loss && python3 benchmarks/bench_loss.py
run decode && python3 benchmarks/bench_decode.py
# torch.compile (issue 16): compiled untiled vs compiled tiled vs eager tiled, Llama-3-8B MLP
run compile && python3 benchmarks/bench_mlp.py --providers eager,eager_compiled,tiledmlp,tiledmlp_compiled \
    --seq-lens 8192,32768,131072
# 128K tokens and beyond: one timed step per variant (a 128K step takes seconds, a 512K one minutes)
run longctx && python3 benchmarks/bench_longctx.py --multi-step-max 65536
run longctx-max && python3 benchmarks/bench_longctx.py --variants loss --seq-lens 786432 --tag max
# Training steps (the optimizer in them): the plan's optimizer terms, 2 layers of each shape, every kind and placement
optimizer_rows=(--layers 2 --variants loss+norms+offload+attn --seq-lens 16384,65536,131072 --tag optim_2l
                --optimizer adamw,adamw-foreach,adamw8bit,adamw:backward,adamw:host)
run optimizer-plan && python3 benchmarks/bench_longctx.py --model 8b "${optimizer_rows[@]}" \
    && python3 benchmarks/bench_longctx.py --model 1b "${optimizer_rows[@]}"
# Llama-3.1-8B full fine-tuning with AdamW where the plan places it: 2 of 32 layers within their share of the box's
# budgets (--scale-to 32), two whole steps on one batch; then within an 80 GiB device budget
scaled=(--model 8b --layers 2 --scale-to 32 --variants loss+norms+auto+attn --optimizer adamw:auto --steps 2
        --warmup-steps 0 --multi-step-max 4194304)
run optimizer-scaled && python3 benchmarks/bench_longctx.py "${scaled[@]}" --seq-lens 1200128 --tag scaled_2l_1200k
run optimizer-80g && python3 benchmarks/bench_longctx.py "${scaled[@]}" --seq-lens 819200 --gpu-mib 81920 \
    --tag scaled_2l_80g
# 131,072 tokens at full depth with torch's fused AdamW on the device, tiledmlp against Liger's fused cross-entropy
run optimizer-32l && python3 benchmarks/bench_longctx.py --model 8b --variants loss+norms+auto+attn,liger \
    --optimizer adamw --seq-lens 131072 --tag 32l_128k_adamw
if [[ -n ${OUT:-} ]]; then find benchmarks/results -type f -newer "$started" -exec cp {} "$OUT"/ \;; fi
