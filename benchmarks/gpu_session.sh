#!/usr/bin/env bash
# One device call on one H200 (kind nvidia-h200), inside the 10 minutes of a call:
#   1. install check: the imports, the versions and the backends this GPU can run;
#   2. in parallel (correctness only, nothing timed): the test suite, compute-sanitizer memcheck, racecheck and
#      synccheck (the fused tail's cases) of tests/sanitize_cases.py for cute and triton, and the bench's compile
#      pass (it fills the torch.compile and kernel caches on disk, so that the timed bench loads instead of
#      compiling);
#   3. the bench, alone on the GPU, with what is left of the budget (it starts no new measurement after that and
#      lists the ones left as skipped);
#   4. a short table.
# Run from the repository root: bash benchmarks/gpu_session.sh. Variables (defaults in brackets):
#   STAGES       stages to run ["install tests sanitize bench"]
#   BUDGET_S     the whole session's budget in seconds [560]: every stage's limit is cut to what is left of it
#   TESTS_TIMEOUT  the test suite's limit [300]; TEST_PATHS what pytest collects ["tests"]; MARK a marker
#                expression that selects the tests, e.g. "gpu" [""]; PYTEST_ARGS extra pytest arguments of the
#                parallel phase ["-n 8" where pytest-xdist is installed: one process does not finish the suite
#                inside the limit]
#   SANITIZE_TIMEOUT  each sanitizer run's limit (three per backend) [70]; SANITIZE_BACKENDS ["cute triton"]
#   BENCH_ARGS   extra arguments of the bench, e.g. "--tail off", "--timing-probe", "--cases 0 3" [""]
#   RUN_COMMIT   the commit the bench records (the device copy's .git may be stale or missing) [git rev-parse]
# Comes back under $OUT (at most 8 files): summary.md, session.log, pytest.log, sanitize.log, bench.log and the
# bench record bench_latest.{json,md,png}.
set -uo pipefail
START=$(date +%s)
RESULT_DIR=${OUT:-/tmp/csa_out}
mkdir -p "$RESULT_DIR"
STAGES=${STAGES:-"install tests sanitize bench"}
BUDGET_S=${BUDGET_S:-560}
LOG="$RESULT_DIR/session.log"
. benchmarks/device_env.sh
elapsed() { echo $(($(date +%s) - START)); }
# A stage's limit: its own, cut to what is left of BUDGET_S (less a margin for the table), so that the session ends
# inside the device call's limit whatever the stages' limits add up to.
limit() {
    local left=$((BUDGET_S - $(elapsed) - 15))
    local t=$(($1 < left ? $1 : left))
    echo $((t > 1 ? t : 1))  # timeout 0 would mean none
}
has() { [[ " $STAGES " == *" $1 "* ]]; }
rows=()
row() { rows+=("| $1 | $2 | $(elapsed) |"); }

if has install; then
    {
        nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv,noheader
        python3 -c "import csa_compressor, torch, triton; print('csa_compressor', csa_compressor.__version__,
'torch', torch.__version__, 'triton', triton.__version__); print('backends', csa_compressor.available_backends('cuda'))"
        python3 -c "import cutlass, tvm_ffi; print('cutlass-dsl', cutlass.__version__, 'tvm_ffi', tvm_ffi.__version__)"
    } >"$LOG" 2>&1
    row install "$(grep -m1 '^backends' "$LOG" || echo 'FAILED, see session.log')"
fi

sanitize() {  # every backend x tool in turn, one log
    for backend in ${SANITIZE_BACKENDS:-cute triton}; do
        # The cases once without a tool first: their compiles land in the disk caches, so that each tool's limit
        # covers its checks (on a fresh machine, compiling under memcheck and racecheck ran past it).
        echo "==== warm-up $backend"
        timeout "$(limit "${SANITIZE_TIMEOUT:-70}")" python3 tests/sanitize_cases.py --backend "$backend" 2>&1 | tail -n 3
        # memcheck also on the malformed-offset cases: no access outside the operands whatever the offsets hold;
        # synccheck on the fused tail's cases, whose rows wait on named barriers of their own warps.
        for run in "memcheck" "memcheck --malformed" "racecheck" "synccheck --tail-only"; do
            set -- $run
            echo "==== $1${2:+${2#-}} $backend"
            run_limit=$(limit "${SANITIZE_TIMEOUT:-70}")
            if [ "$run_limit" -lt 10 ]; then
                echo "==== $1${2:+${2#-}} $backend rc=skipped:budget-spent"
                continue
            fi
            timeout "$run_limit" compute-sanitizer --tool "$1" --report-api-errors no \
                --error-exitcode 9 python3 tests/sanitize_cases.py --backend "$backend" ${2:-} 2>&1
            echo "==== $1${2:+${2#-}} $backend rc=$?"
        done
    done
}

pids=()
# Tests marked `alone` read timing (the SM clock under a spin kernel, idle gaps between kernels): with sanitizers,
# compiles or other tests sharing the GPU they see the time slices, so they run after the parallel phase.
parallel_mark="${MARK:+($MARK) and }not alone"
alone_mark="${MARK:+($MARK) and }alone"
if has tests; then
    if [ -z "${PYTEST_ARGS+set}" ] && python3 -c "import xdist" 2>/dev/null; then PYTEST_ARGS="-n 8"; fi
    # SIGINT first, so that pytest prints its counts when the limit is reached.
    timeout -s INT -k 15 "$(limit "${TESTS_TIMEOUT:-300}")" python3 -m pytest ${TEST_PATHS:-tests} -q -ra -p no:cacheprovider \
        --durations=10 -m "$parallel_mark" ${PYTEST_ARGS:-} >"$RESULT_DIR/pytest.log" 2>&1 &
    pids+=($!)
fi
if has sanitize; then
    sanitize >"$RESULT_DIR/sanitize.log" 2>&1 &
    pids+=($!)
fi
if has bench; then
    # One compile process per case: the matrix's compile time is torch.compile's, one graph at a time per process.
    groups=("--cases 0" "--cases 1" "--cases 2" "--cases 3" "--cases 4" "--cases 5" "--cases 6")
    [[ " ${BENCH_ARGS:-} " == *" --cases "* ]] && groups=("")
    for group in "${groups[@]}"; do
        timeout "${TESTS_TIMEOUT:-300}" python3 -m csa_compressor bench --compile-only -q ${BENCH_ARGS:-} $group \
            >>"$LOG" 2>&1 &
        pids+=($!)
    done
fi
for pid in "${pids[@]}"; do wait "$pid"; done
if has tests; then
    # An interrupted run prints counts of the tests it reached: say so in the row.
    cut_short=$(grep -q KeyboardInterrupt "$RESULT_DIR/pytest.log" && echo "INTERRUPTED at the limit: ")
    # pytest's faulthandler_timeout (pyproject.toml) dumps the stacks of a test that runs past it: a hang, likely.
    grep -q "^Timeout (" "$RESULT_DIR/pytest.log" && cut_short="A TEST RAN PAST faulthandler_timeout (stacks in pytest.log): $cut_short"
    row "test suite" "$cut_short$(grep -E '(passed|failed|error)' "$RESULT_DIR/pytest.log" | tail -n 1)"
    timeout -s INT "$(limit 180)" python3 -m pytest ${TEST_PATHS:-tests} -q -ra -p no:cacheprovider -m "$alone_mark" \
        >"$RESULT_DIR/pytest_alone.log" 2>&1
    row "tests marked alone, after" "$(grep -E '(passed|failed|error|deselected)' "$RESULT_DIR/pytest_alone.log" | tail -n 1)"
    cat "$RESULT_DIR/pytest_alone.log" >>"$RESULT_DIR/pytest.log" && rm "$RESULT_DIR/pytest_alone.log"
fi
if has sanitize; then
    # One row per run: its exit status (9: the tool found errors; 124: the time limit) and the tool's summary.
    while IFS='|' read -r run result; do row "sanitizer $run" "$result"; done < <(awk '
        /ERROR SUMMARY|RACECHECK SUMMARY/ { sub(/^=+ */, ""); summary = $0 }
        /^==== .* rc=/ { sub(/^==== /, ""); n = split($0, f, " "); print f[1] " " f[2] "|" f[n] ", " summary; summary = "" }
    ' "$RESULT_DIR/sanitize.log")
fi

if has bench; then
    left=$((BUDGET_S - $(elapsed) - 20))
    if [ "$left" -lt 30 ]; then
        row bench "not run: $(elapsed) s of the $BUDGET_S s budget spent"
    else
        python3 -m csa_compressor bench --out "$RESULT_DIR" --name bench_latest --budget-s "$left" \
            --commit "${RUN_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}" ${BENCH_ARGS:-} \
            >/dev/null 2>"$RESULT_DIR/bench.log"
        rc=$?
        count() { grep -c "$1" "$RESULT_DIR/bench_latest.json" 2>/dev/null; }  # grep -c prints 0 itself
        result="rc=$rc, $(count '"kernel_us_cold": *[0-9]') measured, $(count '"skipped"') skipped, $(count '"error"') failed"
        [ -f "$RESULT_DIR/bench_latest.json" ] || result="rc=$rc: $(tail -n 1 "$RESULT_DIR/bench.log")"
        row bench "$result"
    fi
fi

{
    echo "| stage | result | at s |"
    echo "|---|---|---|"
    printf '%s\n' "${rows[@]}"
    if [ -f "$RESULT_DIR/bench_latest.md" ]; then
        echo
        sed -n '/^### Summary/,/^### Forward$/p' "$RESULT_DIR/bench_latest.md" | sed '$d'
    fi
} >"$RESULT_DIR/summary.md"
cat "$RESULT_DIR/summary.md"
