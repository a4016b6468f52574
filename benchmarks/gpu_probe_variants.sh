#!/usr/bin/env bash
# One pass of benchmarks/variant_ab.py per variant on GPU 0 (no second pass: for diagnostic probes whose
# differences are far above run-to-run noise), then each variant against the first. VARIANTS / ARGS_* / AB_ARGS as
# in gpu_variants_ab_session.sh.
set -uo pipefail
OUTD=${OUT:-/tmp/csa_out}
mkdir -p "$OUTD"
. benchmarks/device_env.sh
read -r -a LABELS <<<"${VARIANTS:?set VARIANTS}"
for l in "${LABELS[@]}"; do
    name="ARGS_$l"
    # shellcheck disable=SC2086
    CUDA_VISIBLE_DEVICES=0 TRITON_CACHE_DIR=/tmp/tc_$l timeout ${AB_TIMEOUT:-120} python3 benchmarks/variant_ab.py \
        ${AB_ARGS:-} ${!name:-} --out "$OUTD/ab_$l.json" >"$OUTD/ab_$l.log" 2>&1
    echo "rc=$?" >>"$OUTD/ab_$l.log"
done
for l in "${LABELS[@]:1}"; do
    echo "== A = $l, B = ${LABELS[0]}"
    python3 benchmarks/variant_ab.py --compare "$OUTD/ab_$l.json" "$OUTD/ab_${LABELS[0]}.json" | tail -n +6
done | tee "$OUTD/ab_compare.md"
cd "$OUTD" && tar czf ab_all.tgz ./*.json ./*.log && rm -f ./*.json ./*.log
