#!/usr/bin/env bash
# One development call on nvidia-h200-x2: Nsight Compute (speed of light, occupancy, scheduler and warp states,
# pipes, memory, instruction mix) on the cute forward and backward of two cases at once, one per GPU:
#   NCU_CASES="3x8192-d512-r4-c2 3x8192-d512-r128-c1" bash benchmarks/gpu_ncu_pair.sh
# The full reports stay under $OUT (ncu_CASE.txt); a summary of the key lines is printed.
set -uo pipefail
OUTD=${OUT:-/tmp/csa_out}; mkdir -p "$OUTD"
. benchmarks/device_env.sh
p() { CUDA_VISIBLE_DEVICES=$1 timeout 280 ncu --profile-from-start off --clock-control none \
  --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats \
  --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section InstructionStats \
  python3 benchmarks/ncu_probe.py --case "$2" --backends cute > "$OUTD/ncu_$2.txt" 2>&1; echo "rc=$?" >> "$OUTD/ncu_$2.txt"; }
read -r -a CASES <<<"${NCU_CASES:-3x8192-d512-r4-c2 3x8192-d512-r128-c1}"
p 0 "${CASES[0]}" & p 1 "${CASES[1]}" & wait
for f in "$OUTD"/ncu_*.txt; do echo "=== $f"; grep -E "^  [a-z_]+.*\(|Duration|DRAM Throughput|Memory Throughput|Issue Slots Busy|Issued Ipc Active|No Eligible|Registers Per|Achieved Occupancy|Theoretical Occupancy|Warp Cycles Per Issued|Executed Ipc E|L1/TEX Hit|L2 Hit|Block Limit Reg|Waves Per SM|Grid Size|Mem Busy|Max Bandwidth|Block Size|Executed Instructions  " "$f" | grep -v "^==PROF" | head -150; done
