#!/usr/bin/env bash
# One development call: Nsight Compute (speed of light, occupancy, scheduler and warp states, pipes, memory,
# instruction mix, and the per-reason stall ratios: warps stalled per issued instruction) on the cute kernels of one
# or two cases; with two cases and two GPUs (nvidia-h200-x2) they run at once, one per GPU, else one after the other.
#   NCU_CASES="3x8192-d512-r4-c2 3x8192-d512-r128-c1" bash benchmarks/gpu_ncu.sh
#   NCU_CASES=3x8192-d512-r128-c1 NCU_PROBE_ARGS="--directions fwd --tile-probe" bash benchmarks/gpu_ncu.sh
# (``--tile-probe``: the cute forward next to a Triton kernel that only reads its bytes in the same tiles.)
# The full reports stay under $OUT (ncu_CASE.txt); a summary of the key lines is printed.
set -uo pipefail
OUTD=${OUT:-/tmp/csa_out}; mkdir -p "$OUTD"
. benchmarks/device_env.sh
STALLS=""
for r in long_scoreboard short_scoreboard barrier wait math_pipe_throttle lg_throttle mio_throttle not_selected \
         selected drain membar no_instruction dispatch_stall branch_resolving imc_miss sleeping tex_throttle; do
    STALLS="$STALLS,smsp__average_warps_issue_stalled_${r}_per_issue_active.ratio"
done
p() {  # gpu, case
    # shellcheck disable=SC2086
    CUDA_VISIBLE_DEVICES=$1 timeout 280 ncu --profile-from-start off --clock-control none \
        --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
        --section SchedulerStats --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
        --section InstructionStats --metrics "${STALLS#,}" \
        python3 benchmarks/ncu_probe.py --case "$2" --backends cute ${NCU_PROBE_ARGS:-} >"$OUTD/ncu_$2.txt" 2>&1
    echo "rc=$?" >>"$OUTD/ncu_$2.txt"
}
read -r -a CASES <<<"${NCU_CASES:-3x8192-d512-r4-c2 3x8192-d512-r128-c1}"
if [ "${#CASES[@]}" -ge 2 ] && [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
    p 0 "${CASES[0]}" & p 1 "${CASES[1]}" & wait
else
    for c in "${CASES[@]}"; do p 0 "$c"; done
fi
for f in "$OUTD"/ncu_*.txt; do
    echo "=== $f"
    grep -E "^  [a-zA-Z_]+.*\(|Duration|DRAM Throughput|Memory Throughput|Issue Slots Busy|Issued Ipc Active|No Eligible|Eligible Warps|Registers Per|Achieved Occupancy|Theoretical Occupancy|Warp Cycles Per Issued|Executed Ipc E|L1/TEX Hit|L2 Hit|Block Limit|Waves Per SM|Grid Size|Mem Busy|Max Bandwidth|Block Size|Executed Instructions  |stalled|rc=" \
        "$f" | grep -v "^==PROF" | head -200
done
