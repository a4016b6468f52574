#!/usr/bin/env bash
# Two calls on a two-GPU machine (nvidia-h200-x2), each inside the 10-minute limit of a device call:
#   PHASE=1: GPU 0 runs the benchmark (alone on its GPU, timing-sensitive) while GPU 1 runs the full test suite;
#   PHASE=2: the non-current-device tests on both GPUs, then compute-sanitizer memcheck/racecheck (GPU 1)
#            beside the self-check (GPU 0);
#   PHASE=3: after a change, in one call: the test suite and the sanitizers (GPU 1) beside the benchmark and
#            the launch-overhead breakdown (GPU 0), then the two-GPU tests;
#   PHASE=tests: validation only: the suite split over both GPUs, the sanitizers and the two-GPU tests;
#   PHASE=tests1: validation on one GPU (nvidia-h200): the cute files, the cute sanitizers, the other files;
#   PHASE=bench: one GPU (a plain nvidia-h200 call): the benchmark, launch overhead and full-size numerics;
#   PHASE=dev: development: the test suite (GPU 1) beside benchmarks/cute_dev.py timing + schedule variants
#            and an optional $DEV_EXTRA command (GPU 0).
# Logs come back as one tarball (the device tool returns at most 8 files). The device copy's .git can be
# stale: pass RUN_COMMIT=$(git rev-parse --short HEAD) so that the bench records the right commit.
set -uo pipefail
RESULT_DIR=${OUT:-/tmp/csa_out}
LOGS=/tmp/csa_logs
mkdir -p "$LOGS" "$RESULT_DIR"
. benchmarks/device_env.sh
nvidia-smi --query-gpu=index,name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$LOGS/gpu.txt"
python3 -c "import torch, triton, cutlass; print('torch', torch.__version__, 'triton', triton.__version__, 'cutlass-dsl', cutlass.__version__)" | tee -a "$LOGS/gpu.txt"

# The cute test files run apart from the others (their own GPU or their own time budget).
CUTE_FILES="tests/backends/test_cute.py tests/backends/test_cute_compile.py tests/backends/test_cute_launch_abi.py"
IGNORE=""; for f in $CUTE_FILES; do IGNORE="$IGNORE --ignore=$f"; done
sanitize() {  # backend tool timeout: compute-sanitizer on tests/sanitize_cases.py, log in $LOGS/sanitize_<backend>_<tool>.log
    timeout "$3" compute-sanitizer --tool "$2" --report-api-errors no --error-exitcode 9 \
        python3 tests/sanitize_cases.py --backend "$1" --cases ${SAN_CASES:-6} >"$LOGS/sanitize_$1_$2.log" 2>&1
    echo "rc=$?" >>"$LOGS/sanitize_$1_$2.log"
}

if [ "${PHASE:-1}" = dev ]; then
    (
        export CUDA_VISIBLE_DEVICES=1
        timeout ${TEST_TIMEOUT:-420} python3 -m pytest tests -q -ra -p no:cacheprovider --durations=10 ${PYTEST_ARGS:-} >"$LOGS/pytest.log" 2>&1
        echo "pytest rc=$?" >>"$LOGS/pytest.log"
        if [ -n "${DEV_EXTRA1:-}" ]; then bash -c "$DEV_EXTRA1" >"$LOGS/dev_extra1.txt" 2>&1; echo "rc=$?" >>"$LOGS/dev_extra1.txt"; fi
    ) &
    (
        export CUDA_VISIBLE_DEVICES=0
        timeout ${DEV_TIMEOUT:-300} python3 benchmarks/cute_dev.py --only-time --variants --reps 10 --out "$LOGS" >"$LOGS/cute_dev.txt" 2>&1
        echo "cute_dev rc=$?" >>"$LOGS/cute_dev.txt"
        if [ -n "${DEV_EXTRA:-}" ]; then bash -c "$DEV_EXTRA" >"$LOGS/dev_extra.txt" 2>&1; echo "rc=$?" >>"$LOGS/dev_extra.txt"; fi
    ) &
    wait
elif [ "${PHASE:-1}" = tests ]; then
    # Validation only, the suite split over both GPUs (one GPU took more than 300 s for 166 tests at 9259c20):
    # GPU 0 the cute files, GPU 1 the rest; then the sanitizers (cute on GPU 0, Triton on GPU 1) and the
    # two-GPU tests. ~8 minutes. The benchmark runs apart (PHASE=bench).
    (
        export CUDA_VISIBLE_DEVICES=0
        timeout ${TEST_TIMEOUT:-330} python3 -m pytest $CUTE_FILES -q -ra -p no:cacheprovider --durations=15 >"$LOGS/pytest_gpu0.log" 2>&1
        echo "pytest rc=$?" >>"$LOGS/pytest_gpu0.log"
        sanitize cute memcheck ${SAN_TIMEOUT:-60}
        sanitize cute racecheck ${SAN_TIMEOUT:-60}
    ) &
    (
        export CUDA_VISIBLE_DEVICES=1
        timeout ${TEST_TIMEOUT:-330} python3 -m pytest tests $IGNORE -q -ra -p no:cacheprovider --durations=15 >"$LOGS/pytest_gpu1.log" 2>&1
        echo "pytest rc=$?" >>"$LOGS/pytest_gpu1.log"
        sanitize triton memcheck ${SAN_TIMEOUT:-60}
    ) &
    wait
    timeout 90 python3 -m pytest tests -q -ra -p no:cacheprovider -k "non_current" >"$LOGS/pytest_two_gpus.log" 2>&1
    echo "rc=$?" >>"$LOGS/pytest_two_gpus.log"
elif [ "${PHASE:-1}" = tests1 ]; then
    # Validation on one GPU (a plain nvidia-h200 call, when no two-GPU machine is lent), within one call's 10
    # minutes: the cute files, the cute sanitizers, then every other file (the two-GPU cases skip).
    timeout ${TEST_TIMEOUT:-130} python3 -m pytest $CUTE_FILES -q -ra -p no:cacheprovider --durations=10 >"$LOGS/pytest_cute.log" 2>&1
    echo "pytest rc=$?" >>"$LOGS/pytest_cute.log"
    sanitize cute memcheck ${SAN_TIMEOUT:-50}
    sanitize cute racecheck ${SAN_TIMEOUT:-50}
    timeout ${REST_TIMEOUT:-300} python3 -m pytest tests $IGNORE -q -ra -p no:cacheprovider --durations=10 >"$LOGS/pytest_rest.log" 2>&1
    echo "pytest rc=$?" >>"$LOGS/pytest_rest.log"
elif [ "${PHASE:-1}" = bench ]; then
    # One GPU (nvidia-h200 will do): the benchmark alone, then the launch-overhead breakdown and the full-size
    # numerics. ~7 minutes with --clean-cold.
    timeout ${BENCH_TIMEOUT:-360} python3 -m csa_compressor bench --out "$LOGS/bench" ${RUN_COMMIT:+--commit "$RUN_COMMIT"} ${BENCH_ARGS:-} >"$LOGS/bench.txt" 2>"$LOGS/bench.err"
    echo "bench rc=$?" >>"$LOGS/bench.txt"
    timeout 60 python3 benchmarks/launch_overhead.py --out "$LOGS/launch_overhead.json" >"$LOGS/launch_overhead.txt" 2>&1
    timeout ${NUM_TIMEOUT:-120} python3 benchmarks/full_numerics.py --out "$LOGS" >"$LOGS/full_numerics.txt" 2>&1
    echo "rc=$?" >>"$LOGS/full_numerics.txt"
elif [ "${PHASE:-1}" = 1 ]; then
    # GPU 1: the full test suite. GPU 0: the benchmark, alone on its GPU.
    (
        export CUDA_VISIBLE_DEVICES=1
        timeout ${TEST_TIMEOUT:-420} python3 -m pytest tests -q -ra -p no:cacheprovider --durations=15 >"$LOGS/pytest.log" 2>&1
        echo "pytest rc=$?" >>"$LOGS/pytest.log"
    ) &
    (
        export CUDA_VISIBLE_DEVICES=0
        timeout ${BENCH_TIMEOUT:-420} python3 -m csa_compressor bench --out "$LOGS/bench" ${RUN_COMMIT:+--commit "$RUN_COMMIT"} ${BENCH_ARGS:-} >"$LOGS/bench.txt" 2>"$LOGS/bench.err"
        echo "bench rc=$?" >>"$LOGS/bench.txt"
    ) &
    wait
elif [ "${PHASE:-1}" = 3 ]; then
    # One call for everything after a change: on GPU 1 the test suite, then compute-sanitizer memcheck of both
    # GPU backends and racecheck of cute; on GPU 0 the benchmark, alone on its GPU, and the launch-overhead
    # breakdown.
    (
        export CUDA_VISIBLE_DEVICES=1
        timeout ${TEST_TIMEOUT:-420} python3 -m pytest tests -q -ra -p no:cacheprovider --durations=10 >"$LOGS/pytest.log" 2>&1
        echo "pytest rc=$?" >>"$LOGS/pytest.log"
        for spec in "cute memcheck" "triton memcheck" "cute racecheck"; do
            sanitize $spec ${SAN_TIMEOUT:-60}
        done
    ) &
    (
        export CUDA_VISIBLE_DEVICES=0
        timeout ${BENCH_TIMEOUT:-300} python3 -m csa_compressor bench --out "$LOGS/bench" ${RUN_COMMIT:+--commit "$RUN_COMMIT"} ${BENCH_ARGS:-} >"$LOGS/bench.txt" 2>"$LOGS/bench.err"
        echo "bench rc=$?" >>"$LOGS/bench.txt"
        timeout 60 python3 benchmarks/launch_overhead.py --out "$LOGS/launch_overhead.json" >"$LOGS/launch_overhead.txt" 2>&1
        timeout ${NUM_TIMEOUT:-120} python3 benchmarks/full_numerics.py --out "$LOGS" >"$LOGS/full_numerics.txt" 2>&1
        echo "rc=$?" >>"$LOGS/full_numerics.txt"
    ) &
    wait
    # Both GPUs: the non-current-device tests.
    timeout 120 python3 -m pytest tests -q -ra -p no:cacheprovider -k "non_current" >"$LOGS/pytest_two_gpus.log" 2>&1
    echo "rc=$?" >>"$LOGS/pytest_two_gpus.log"
else
    # Both GPUs: the non-current-device tests; then sanitizers on GPU 1 and the self-check on GPU 0.
    timeout 120 python3 -m pytest tests -q -ra -p no:cacheprovider -k "non_current" >"$LOGS/pytest_two_gpus.log" 2>&1
    echo "rc=$?" >>"$LOGS/pytest_two_gpus.log"
    (
        export CUDA_VISIBLE_DEVICES=1
        for spec in "cute memcheck" "triton memcheck" "cute racecheck" "triton racecheck"; do
            sanitize $spec ${SAN_TIMEOUT:-90}
        done
    ) &
    (
        export CUDA_VISIBLE_DEVICES=0
        timeout 150 python3 -m csa_compressor >"$LOGS/selfcheck.txt" 2>&1
        echo "selfcheck rc=$?" >>"$LOGS/selfcheck.txt"
    ) &
    wait
fi

tar czf "$RESULT_DIR/logs_phase${PHASE:-1}.tar.gz" -C "$LOGS" .
if [ "${PHASE:-1}" = dev ]; then
    echo "==== pytest (GPU 1)"; grep -E "^(FAILED|ERROR)" "$LOGS/pytest.log" | head -n 30; tail -n 2 "$LOGS/pytest.log"
    echo "==== cute_dev"; grep -E '^\| |^\{"case.*"dir"|rc=' "$LOGS/cute_dev.txt" | sed -E 's/"(numerics)": \{[^}]*"ok": (true|false)[^}]*\}/"ok": \2/' | cut -c1-230
    [ -f "$LOGS/dev_extra.txt" ] && tail -n ${EXTRA_TAIL:-40} "$LOGS/dev_extra.txt"
    [ -f "$LOGS/dev_extra1.txt" ] && tail -n ${EXTRA_TAIL:-40} "$LOGS/dev_extra1.txt"
elif [ "${PHASE:-1}" = 3 ]; then
    echo "==== pytest (GPU 1)"; grep -E "^(FAILED|ERROR)" "$LOGS/pytest.log" | head -n 30; tail -n 2 "$LOGS/pytest.log"
    echo "==== sanitizers"; for f in "$LOGS"/sanitize_*.log; do echo "$(basename "$f"): $(grep -hE 'ERROR SUMMARY|RACECHECK SUMMARY' "$f" | tail -n 1) $(tail -n 1 "$f")"; done
    echo "==== two GPUs"; tail -n 2 "$LOGS/pytest_two_gpus.log"
    echo "==== launch overhead"; grep -E "^\[|wrapper|target|bare|x.add_" "$LOGS/launch_overhead.txt"
    echo "==== full-size numerics"; tail -n 16 "$LOGS/full_numerics.txt" | cut -c1-200
    echo "==== bench"; grep -E "cute|triton|^\| case|^###" "$LOGS/bench.txt" | head -n 60
elif [ "${PHASE:-1}" = tests ]; then
    for g in 0 1; do echo "==== pytest (GPU $g)"; grep -E "^(FAILED|ERROR)" "$LOGS/pytest_gpu$g.log" | head -n 30; tail -n 2 "$LOGS/pytest_gpu$g.log"; done
    echo "==== sanitizers"; for f in "$LOGS"/sanitize_*.log; do echo "$(basename "$f"): $(grep -hE 'ERROR SUMMARY|RACECHECK SUMMARY' "$f" | tail -n 1) $(tail -n 1 "$f")"; done
    echo "==== two GPUs"; tail -n 2 "$LOGS/pytest_two_gpus.log"
elif [ "${PHASE:-1}" = tests1 ]; then
    for f in cute rest; do echo "==== pytest ($f)"; grep -E "^(FAILED|ERROR)" "$LOGS/pytest_$f.log" | head -n 30; tail -n 2 "$LOGS/pytest_$f.log"; done
    echo "==== sanitizers"; for f in "$LOGS"/sanitize_*.log; do echo "$(basename "$f"): $(grep -hE 'ERROR SUMMARY|RACECHECK SUMMARY' "$f" | tail -n 1) $(tail -n 1 "$f")"; done
elif [ "${PHASE:-1}" = bench ]; then
    echo "==== launch overhead"; grep -E "^\[|wrapper|target|bare|piece|execute|x.add_" "$LOGS/launch_overhead.txt"
    echo "==== full-size numerics"; tail -n 16 "$LOGS/full_numerics.txt" | cut -c1-200
    echo "==== bench"; grep -E "cute|triton|^\| case|^###" "$LOGS/bench.txt" | head -n 60
elif [ "${PHASE:-1}" = 1 ]; then
    echo "==== pytest (GPU 1)"; grep -E "^(FAILED|ERROR)" "$LOGS/pytest.log" | head -n 30; tail -n 3 "$LOGS/pytest.log"
    echo "==== bench"; tail -n 70 "$LOGS/bench.txt"
else
    echo "==== two GPUs"; tail -n 3 "$LOGS/pytest_two_gpus.log"
    echo "==== sanitizers"; for f in "$LOGS"/sanitize_*.log; do echo "$(basename "$f"): $(grep -hE 'ERROR SUMMARY|RACECHECK SUMMARY' "$f" | tail -n 1) $(tail -n 1 "$f")"; done
    echo "==== self-check"; tail -n 16 "$LOGS/selfcheck.txt"
fi
