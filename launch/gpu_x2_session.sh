#!/usr/bin/env bash
# Everything that needs 2 GPUs, in one call (device tool, nvidia-h200-x2): the distributed suite on
# NCCL, DDP/FSDP2/TP/FSDP2xTP training-step benchmarks, and a real-size --compare run of launch/train.py.
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
RUN="python3 -m torch.distributed.run --standalone --nproc-per-node 2"
timeout 330 bash launch/run_distributed_tests.sh 2 > "$OUT/distributed_tests.txt" 2>&1; echo "suite exit $?"; grep -E "^(python|devices)|passed|failed" "$OUT/distributed_tests.txt" | tail -4
for wrap in ddp fsdp2 tp fsdp2_tp; do
    for ckpt in "" --grad-ckpt; do
        timeout 100 $RUN benchmarks/bench_ddp.py --wrap $wrap --seq-len 16384 --layers 4 $ckpt --steps 5 2>&1 \
            | grep -v -i warn | tail -4 | tee -a "$OUT/bench_ddp.txt"
    done
done
timeout 90 $RUN launch/train.py --wrap fsdp2 --tiling auto --compare --hidden 2048 --intermediate 8192 --layers 2 \
    --heads 16 --kv-heads 4 --vocab 32000 --seq-len 16384 --tile-tokens auto --dtype bfloat16 --steps 4 2>&1 \
    | grep -v -i warn | tail -12 | tee "$OUT/train_fsdp2_bf16.txt"
cp benchmarks/results/bench_ddp* "$OUT"/ 2>/dev/null
