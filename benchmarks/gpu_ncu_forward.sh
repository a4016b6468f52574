#!/usr/bin/env bash
# One development call: Nsight Compute on the cute forward of one case next to the Triton kernel that only reads
# its bytes in the same tiles (ncu_probe.py --tile-probe): speed of light, occupancy, memory, and the per-reason
# stall ratios (warps stalled per issued instruction), to say where the forward's time over a pure read goes.
#   NCU_CASE=3x8192-d512-r128-c1 bash benchmarks/gpu_ncu_forward.sh
set -uo pipefail
OUTD=${OUT:-/tmp/csa_out}; mkdir -p "$OUTD"
. benchmarks/device_env.sh
CASE=${NCU_CASE:-3x8192-d512-r128-c1}
STALLS=""
for r in long_scoreboard short_scoreboard barrier wait math_pipe_throttle lg_throttle mio_throttle not_selected \
         selected drain membar no_instruction dispatch_stall branch_resolving imc_miss sleeping tex_throttle; do
    STALLS="$STALLS,smsp__average_warps_issue_stalled_${r}_per_issue_active.ratio"
done
timeout 300 ncu --profile-from-start off --clock-control none \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section SchedulerStats --section MemoryWorkloadAnalysis --metrics "${STALLS#,}" \
    python3 benchmarks/ncu_probe.py --case "$CASE" --backends cute --directions fwd --tile-probe \
    >"$OUTD/ncu_forward_$CASE.txt" 2>&1
echo "rc=$?" >>"$OUTD/ncu_forward_$CASE.txt"
grep -E "^  [a-zA-Z_].*\(|Duration|DRAM Throughput|Registers Per|Achieved Occupancy|Theoretical Occupancy|Block Limit|Warp Cycles Per Issued|Issue Slots Busy|Eligible Warps|No Eligible|L1/TEX Hit|L2 Hit|Mem Busy|stalled|Block Size|Grid Size|rc=" \
    "$OUTD/ncu_forward_$CASE.txt" | grep -v "^==PROF"
