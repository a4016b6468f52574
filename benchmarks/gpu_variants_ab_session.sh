#!/usr/bin/env bash
# One development call on nvidia-h200-x2: an A/B/... of kernel variants with benchmarks/variant_ab.py, every
# variant in its own process, on both GPUs in opposite orders (on a one-GPU machine, or with ONE_GPU=1: two passes
# on GPU 0, the second in the opposite order); then an optional check command on GPU 0 (CHECK_CMD,
# e.g. the cute tests and full-size numerics of the new default). ONE_PASS=1: a single pass on GPU 0 (diagnostic
# probes whose differences are far above run-to-run noise). At most 8 files come back: the comparison tables, the
# check's tail and one archive of the rest.
#
#   VARIANTS="s32 s8" ARGS_s32="--stats-slots 32" ARGS_s8="--stats-slots 8" AB_ARGS="--backends cute \
#       --directions bwd --cases 1x8192-d128-r128-c1" bash benchmarks/gpu_variants_ab_session.sh
#
# The first variant is the baseline B of every comparison. ``--set KEY=VALUE`` in a variant's arguments sets an
# environment variable before the package is imported (e.g. ``--set CSA_COMPRESSOR_STREAM_BACKWARD=stores``).
set -uo pipefail
OUTD=${OUT:-/tmp/csa_out}
mkdir -p "$OUTD"
. benchmarks/device_env.sh
nvidia-smi --query-gpu=index,name,clocks.sm,clocks.mem --format=csv,noheader >"$OUTD/gpu.txt"
read -r -a LABELS <<<"${VARIANTS:?set VARIANTS}"
ab() {  # gpu, label, tag of the pass (the GPU index, or 0b for the second pass on one GPU)
    local name="ARGS_$2"
    # shellcheck disable=SC2086
    CUDA_VISIBLE_DEVICES=$1 TRITON_CACHE_DIR=/tmp/tc_$2_$3 timeout ${AB_TIMEOUT:-150} \
        python3 benchmarks/variant_ab.py ${AB_ARGS:-} ${!name:-} --out "$OUTD/ab_$2_gpu$3.json" \
        >"$OUTD/ab_$2_gpu$3.log" 2>&1
    echo "rc=$?" >>"$OUTD/ab_$2_gpu$3.log"
}
forward_pass() { for l in "${LABELS[@]}"; do ab "$1" "$l" "$2"; done; }
reverse_pass() { for ((i = ${#LABELS[@]} - 1; i >= 0; i--)); do ab "$1" "${LABELS[$i]}" "$2"; done; }
if [ -n "${ONE_PASS:-}" ]; then
    TAGS="0"
    forward_pass 0 0
elif [ "$(nvidia-smi -L | wc -l)" -ge 2 ] && [ -z "${ONE_GPU:-}" ]; then
    TAGS="0 1"
    forward_pass 0 0 &
    reverse_pass 1 1 &
    wait
else  # one GPU (nvidia-h200, or ONE_GPU=1): both passes on GPU 0, one after the other
    TAGS="0 0b"
    forward_pass 0 0
    reverse_pass 0 0b
fi
if [ -n "${CHECK_CMD:-}" ]; then
    CUDA_VISIBLE_DEVICES=0 timeout ${CHECK_TIMEOUT:-200} bash -c "$CHECK_CMD" >"$OUTD/check.txt" 2>&1
    echo "rc=$?" >>"$OUTD/check.txt"
    tail -n 30 "$OUTD/check.txt" >"$OUTD/check_tail.txt"
fi
base=${LABELS[0]}
for g in $TAGS; do
    for l in "${LABELS[@]:1}"; do
        echo "== pass $g: A = $l, B = $base"
        python3 benchmarks/variant_ab.py --compare "$OUTD/ab_${l}_gpu$g.json" "$OUTD/ab_${base}_gpu$g.json"
    done
done | tee "$OUTD/ab_compare.md"
cd "$OUTD" && tar czf ab_all.tgz ./*.json ./*.log ./*.txt && rm -f ./*.json ./*.log gpu.txt check.txt && ls "$OUTD"
