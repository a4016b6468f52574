#!/usr/bin/env bash
# One development call on nvidia-h200-x2: the backward evict-first A/B (CSA_COMPRESSOR_STREAM_BACKWARD = none,
# stores, all; benchmarks/evict_first_ab.py --directions bwd) on both GPUs in opposite orders, then Nsight Compute
# on the small ratio-128 case (NCU_CASE) for Triton and cute (GPU 0). Logs come back under $OUT.
set -uo pipefail
OUTD=${OUT:-/tmp/csa_out}
mkdir -p "$OUTD"
if [ -d .cutedsl ]; then
    mkdir -p /tmp/cutedsl && for f in .cutedsl/*.tar.xz; do tar xJf "$f" -C /tmp/cutedsl; done
fi
export PYTHONPATH=/tmp/cutedsl/nvidia_cutlass_dsl/dsl_packages:/tmp/cutedsl:$PWD
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=index,name,clocks.sm,clocks.mem --format=csv,noheader >"$OUTD/gpu.txt"
ab() {  # gpu, policy
    CUDA_VISIBLE_DEVICES=$1 CSA_COMPRESSOR_STREAM_BACKWARD=$2 TRITON_CACHE_DIR=/tmp/tc_$2_$1 \
        timeout ${AB_TIMEOUT:-150} python3 benchmarks/evict_first_ab.py --directions bwd ${AB_ARGS:-} \
        --out "$OUTD/ab_$2_gpu$1.json" >"$OUTD/ab_$2_gpu$1.log" 2>&1
    echo "rc=$?" >>"$OUTD/ab_$2_gpu$1.log"
}
( for p in ${POLICIES_0:-none stores all}; do ab 0 $p; done ) &
( for p in ${POLICIES_1:-all stores none}; do ab 1 $p; done ) &
wait
if [ -n "${NCU_CASE:-}" ]; then
    CUDA_VISIBLE_DEVICES=0 timeout ${NCU_TIMEOUT:-150} ncu --profile-from-start off --clock-control none \
        --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
        --section MemoryWorkloadAnalysis \
        python3 benchmarks/ncu_case.py --case "$NCU_CASE" --backends ${NCU_BACKENDS:-triton,cute} >"$OUTD/ncu.txt" 2>&1
    echo "rc=$?" >>"$OUTD/ncu.txt"
fi
for g in 0 1; do
    for p in stores all; do
        echo "== GPU $g: A = $p, B = none"
        python3 benchmarks/evict_first_ab.py --compare "$OUTD/ab_${p}_gpu$g.json" "$OUTD/ab_none_gpu$g.json"
    done
done | tee "$OUTD/ab_compare.md"
# At most 8 files come back from the device: keep the comparison and one archive of the rest.
cd "$OUTD" && tar czf ab_all.tgz ./*.json ./*.log ./*.txt && rm -f ./*.json ./*.log ./*.txt && ls "$OUTD"
