#!/usr/bin/env bash
# One device call for the TMA forward (forward_tma.py): its GPU tests first (a smoke case under a short timeout,
# since a pipeline bug would hang rather than fail), then, only if they pass, an A/B of forward variants with
# benchmarks/gpu_variants_ab_session.sh (VARIANTS / ARGS_* / AB_ARGS as there).
set -uo pipefail
OUTD=${OUT:-/tmp/csa_out}
mkdir -p "$OUTD"
. benchmarks/device_env.sh
run_tests() {  # timeout, pytest -k expression
    timeout "$1" python3 -m pytest -q -x tests/backends/test_cute.py -k "$2" >>"$OUTD/tests.txt" 2>&1
    local rc=$?
    echo "rc=$rc ($2)" >>"$OUTD/tests.txt"
    return $rc
}
ok=1
run_tests 120 "test_tma_forward and 515 and default and 132 and d512" || ok=0
[ $ok = 1 ] && { run_tests "${TEST_TIMEOUT:-240}" "${TESTS_K:-tma}" || ok=0; }
tail -n 40 "$OUTD/tests.txt" >"$OUTD/tests_tail.txt"
rm -f "$OUTD/tests.txt"
if [ $ok = 1 ] && [ -n "${VARIANTS:-}" ]; then
    bash benchmarks/gpu_variants_ab_session.sh
fi
