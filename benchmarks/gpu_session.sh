#!/usr/bin/env bash
# One call on the GPU machine: unpack CuTe-DSL, then the stages named in $STAGES
# (tests selfcheck sanitize bench), logs under $OUT, a short summary last.
#   STAGES="tests bench" bash benchmarks/gpu_session.sh
set -uo pipefail
# Logs go to $LOGS and come back as one tarball: the device tool returns at most 8 files.
RESULT_DIR=${OUT:-/tmp/csa_out}
OUT=/tmp/csa_logs
mkdir -p "$OUT" "$RESULT_DIR"
STAGES=${STAGES:-"tests selfcheck sanitize bench"}
. benchmarks/device_env.sh
summary=()
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
python3 -c "import cutlass; print('cutlass-dsl', cutlass.__version__)" 2>&1 | tail -1

for stage in $STAGES; do
    case $stage in
    tests)
        python3 -m pytest tests -q -ra -p no:cacheprovider ${PYTEST_ARGS:-} >"$OUT/pytest.log" 2>&1
        summary+=("pytest: $(tail -n 1 "$OUT/pytest.log")")
        grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" | head -n 20
        ;;
    selfcheck)
        python3 -m csa_compressor >"$OUT/selfcheck.txt" 2>&1
        summary+=("selfcheck: $(tail -n 1 "$OUT/selfcheck.txt")")
        cat "$OUT/selfcheck.txt"
        ;;
    sanitize)
        for backend in ${SANITIZE_BACKENDS:-cute triton}; do
            for tool in memcheck racecheck; do
                log="$OUT/sanitize_${backend}_${tool}.log"
                timeout 240 compute-sanitizer --tool $tool --report-api-errors no --error-exitcode 9 python3 tests/sanitize_cases.py --backend "$backend" >"$log" 2>&1
                rc=$?
                summary+=("sanitizer $tool $backend: rc=$rc $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$log" | tail -n 1)")
            done
        done
        ;;
    bench)
        python3 -m csa_compressor bench --out "$OUT/bench" ${BENCH_ARGS:-} 2>"$OUT/bench.err" | tee "$OUT/bench.txt"
        summary+=("bench: rc=$?")
        ;;
    esac
done
printf '%s\n' "${summary[@]}" >"$OUT/summary.txt"
tar czf "$RESULT_DIR/logs.tar.gz" -C "$OUT" .
echo "==== summary"
cat "$OUT/summary.txt"
