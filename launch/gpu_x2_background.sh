#!/usr/bin/env bash
# What needs 2 GPUs for longer than one device call (10 minutes): the whole distributed suite on NCCL, then the
# ZeRO-3 memory rows of bench_ddp. The first call starts it in a session of its own, which outlives the call;
# the next call, on the same warm machine, waits for it and collects the logs.
#
#   bash launch/gpu_x2_background.sh start [SECONDS]    # start, then follow it for SECONDS (default 500)
#   bash launch/gpu_x2_background.sh collect [SECONDS]  # wait up to SECONDS (default 500) for the end
# Both copy what the job has written so far into $OUT when they return, so keep SECONDS well inside the call's limit
# (a call killed at its limit brings nothing back). The whole suite took over 18 minutes on 2 x H100 (2026-11-26).
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
JOB=/tmp/tiledmlp-job
OUT=${OUT:-$JOB/out}

follow() {  # wait up to $1 seconds for the job's end, then report and copy what it wrote so far into $OUT
    local deadline=$(( $(date +%s) + $1 ))
    while [[ ! -e $JOB/done && $(date +%s) -lt $deadline ]]; do sleep 5; done
    grep -cE " (PASSED|FAILED|ERROR|SKIPPED)" "$JOB/nccl_suite.txt" 2>/dev/null | sed 's/^/tests reported: /'
    tail -2 "$JOB/nccl_suite.txt" 2>/dev/null
    cat "$JOB/suite_rc" 2>/dev/null
    [[ -e $JOB/done ]] && echo "job done" || echo "job still running"
    mkdir -p "$OUT"
    cp "$JOB"/nccl_suite.txt "$JOB"/suite_rc "$JOB"/bench_zero3.txt "$JOB"/job.log "$OUT"/ 2>/dev/null
    cp "$JOB"/results/*.csv "$OUT"/ 2>/dev/null
}

case "${1:-}" in
start)
    rm -rf "$JOB"; mkdir -p "$JOB"
    setsid nohup bash "$0" run > "$JOB/job.log" 2>&1 < /dev/null &
    follow "${2:-500}"
    ;;
run)
    begin=$(date +%s)
    bash launch/run_distributed_tests.sh 2 --durations=0 > "$JOB/nccl_suite.txt" 2>&1
    echo "suite exit $? in $(( $(date +%s) - begin )) s" > "$JOB/suite_rc"
    # One variant per process: a DeepSpeed engine leaves its partitions and optimizer state allocated after
    # destroy(), which an in-process second variant would count in its peak.
    run2="python3 -m torch.distributed.run --standalone --nproc-per-node 2"
    for row in "16384 untiled" "16384 tiled" "16384 tiled loss=False" "32768 untiled" "32768 tiled"; do
        read -r seq variant options <<< "$row"
        $run2 benchmarks/bench_ddp.py --wrap zero3 --seq-len "$seq" --layers 4 --grad-ckpt --variants "$variant" \
            --steps 4 --warmup 2 --out "$JOB/results" ${options:+--tiledmlp-options "$options"} 2>&1 \
            | grep -v -i warn | tail -3
    done > "$JOB/bench_zero3.txt" 2>&1
    touch "$JOB/done"
    ;;
collect)
    follow "${2:-500}"
    grep -E "passed|failed|FAILED|ERROR" "$JOB/nccl_suite.txt" | tail -30
    cat "$JOB/bench_zero3.txt" 2>/dev/null
    ;;
*)
    echo "usage: $0 start|collect [SECONDS]" >&2; exit 2 ;;
esac
