#!/usr/bin/env bash
# One development call on nvidia-h200-x2, for a latency-bound case (PROBE_CASE, default the small ratio-128 one):
# GPU 0: Nsight Compute on the forward and backward of Triton and cute (benchmarks/ncu_probe.py);
# GPU 1: the Triton tile sweep of that case with the bench's profiler timer and softmax statistics (as autograd),
# write flush then read flush. At most 8 files come back: the summaries and one archive.
set -uo pipefail
OUTD=${OUT:-/tmp/csa_out}
mkdir -p "$OUTD"
. benchmarks/device_env.sh
CASE=${PROBE_CASE:-1x8192-d128-r128-c1}
SWEEP_CASE=${CASE//-/_}
(
    CUDA_VISIBLE_DEVICES=0 timeout ${NCU_TIMEOUT:-240} ncu --profile-from-start off --clock-control none \
        --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
        --section MemoryWorkloadAnalysis --section SchedulerStats \
        python3 benchmarks/ncu_probe.py --case "$CASE" --backends ${NCU_BACKENDS:-triton,cute} >"$OUTD/ncu.txt" 2>&1
    echo "rc=$?" >>"$OUTD/ncu.txt"
) &
(
    for flush in write read; do
        CUDA_VISIBLE_DEVICES=1 timeout ${SWEEP_TIMEOUT:-150} python3 benchmarks/triton_sweep.py --cases "$SWEEP_CASE" \
            --directions ${SWEEP_DIRECTIONS:-forward} --timer profiler --stats --flush $flush --iters 10 --workers 12 \
            --out "$OUTD/sweep_$flush" >"$OUTD/sweep_$flush.txt" 2>&1
        echo "rc=$?" >>"$OUTD/sweep_$flush.txt"
    done
) &
wait
cd "$OUTD" && grep -E "best|default|\*" sweep_*.txt | tail -n 20
tar czf probe.tgz ./ncu.txt ./sweep_* && rm -rf ./sweep_write ./sweep_read && ls
