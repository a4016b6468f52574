#!/usr/bin/env bash
# One development call on nvidia-h200-x2: the evict-first A/B (benchmarks/evict_first_ab.py) on both GPUs in
# opposite orders (GPU 0: on then off; GPU 1: off then on), then the full-size numerics (GPU 0) beside a
# Triton forward tile sweep of the ratio-128 cases (GPU 1). Logs come back under $OUT.
set -uo pipefail
OUTD=${OUT:-/tmp/csa_out}
mkdir -p "$OUTD"
if [ -d .cutedsl ]; then
    mkdir -p /tmp/cutedsl && for f in .cutedsl/*.tar.xz; do tar xJf "$f" -C /tmp/cutedsl; done
fi
export PYTHONPATH=/tmp/cutedsl/nvidia_cutlass_dsl/dsl_packages:/tmp/cutedsl:$PWD
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=index,name,clocks.sm,clocks.mem --format=csv,noheader >"$OUTD/gpu.txt"
ab() {  # gpu, on/off
    local v=1; [ "$2" = off ] && v=0
    CUDA_VISIBLE_DEVICES=$1 CSA_COMPRESSOR_STREAM_LOADS=$v TRITON_CACHE_DIR=/tmp/tc_$2_$1 \
        timeout ${AB_TIMEOUT:-200} python3 benchmarks/evict_first_ab.py --triton-stats --out "$OUTD/ab_$2_gpu$1.json" \
        >"$OUTD/ab_$2_gpu$1.log" 2>&1
    echo "rc=$?" >>"$OUTD/ab_$2_gpu$1.log"
}
( ab 0 on; ab 0 off
  CUDA_VISIBLE_DEVICES=0 timeout ${NUM_TIMEOUT:-150} python3 benchmarks/full_numerics.py --out "$OUTD" >"$OUTD/full_numerics.txt" 2>&1
  echo "rc=$?" >>"$OUTD/full_numerics.txt" ) &
( ab 1 off; ab 1 on
  CUDA_VISIBLE_DEVICES=1 timeout ${SWEEP_TIMEOUT:-150} python3 benchmarks/triton_sweep.py --cases r128 --directions forward \
      --workers 12 --out "$OUTD/sweep" >"$OUTD/sweep.txt" 2>&1
  echo "rc=$?" >>"$OUTD/sweep.txt" ) &
wait
for g in 0 1; do
    echo "== GPU $g"; python3 benchmarks/evict_first_ab.py --compare "$OUTD/ab_on_gpu$g.json" "$OUTD/ab_off_gpu$g.json"
done | tee "$OUTD/ab_compare.md"
echo "ptx with ld.global.cs: on $(grep -rl 'ld.global.cs' /tmp/tc_on_0 2>/dev/null | wc -l), off $(grep -rl 'ld.global.cs' /tmp/tc_off_0 2>/dev/null | wc -l)"
tail -n 20 "$OUTD/full_numerics.txt"
grep -E "best|default" "$OUTD/sweep.txt" | tail -n 8
