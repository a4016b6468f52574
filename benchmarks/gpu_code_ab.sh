#!/usr/bin/env bash
# A/B of two versions of the code on one GPU, kernel time per kernel (benchmarks/kernel_breakdown.py), order
# A B B A so that drift over the run cancels: A = the working tree, B = the package of git revision $BASE, archived
# locally beforehand into the ignored folder ab_base/ (the device copy has no history):
#   rm -rf ab_base && mkdir ab_base && git archive $BASE csa_compressor | tar -x -C ab_base && mkdir ab_base/benchmarks && cp benchmarks/kernel_breakdown.py ab_base/benchmarks/
# and carried with the call (carry: [".cutedsl", "ab_base"]). Optional: $PRE (a command run first, e.g. tests),
# $AB_ARGS (kernel_breakdown arguments), $POST (run last). Results: $OUT/ab_{A,B}{1,2}.json and the logs.
set -uo pipefail
OUT=${OUT:-/tmp/csa_out}
mkdir -p "$OUT"
. benchmarks/device_env.sh
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/gpu.txt"
if [ -n "${PRE:-}" ]; then bash -c "$PRE" >"$OUT/pre.log" 2>&1; echo "rc=$?" >>"$OUT/pre.log"; tail -5 "$OUT/pre.log"; fi
run() {  # tag dir
    (cd "$2" && PYTHONPATH=/tmp/cutedsl/nvidia_cutlass_dsl/dsl_packages:/tmp/cutedsl:$PWD timeout ${AB_TIMEOUT:-150} \
        python3 benchmarks/kernel_breakdown.py ${AB_ARGS:-} --out "$OUT/ab_$1.json" >"$OUT/ab_$1.log" 2>&1)
    echo "$1 rc=$?"
}
if [ -d ab_base ]; then
    run A1 . ; run B1 ab_base ; run B2 ab_base ; run A2 .
    python3 - "$OUT" <<'PY'
import json, sys, os
out = sys.argv[1]
runs = {t: json.load(open(os.path.join(out, f"ab_{t}.json")))["rows"] for t in ("A1", "B1", "B2", "A2")
        if os.path.exists(os.path.join(out, f"ab_{t}.json"))}
keys = [(r["case"], r["backend"], r["direction"], r["mode"]) for r in runs.get("A1", [])]
print(f"{'case':22s} {'dir':4s} {'mode':5s} {'A1':>7s} {'A2':>7s} {'B1':>7s} {'B2':>7s} {'A/B':>6s}")
for k in keys:
    v = {t: next((r["total"] for r in rows if (r["case"], r["backend"], r["direction"], r["mode"]) == k), None)
         for t, rows in runs.items()}
    a = [x for x in (v.get("A1"), v.get("A2")) if x]
    b = [x for x in (v.get("B1"), v.get("B2")) if x]
    ratio = (sum(a) / len(a)) / (sum(b) / len(b)) if a and b else float("nan")
    print(f"{k[0]:22s} {k[2]:4s} {k[3]:5s} " + " ".join(f"{v.get(t) or 0:7.2f}" for t in ("A1", "A2", "B1", "B2"))
          + f" {ratio:6.3f}")
PY
fi
if [ -n "${POST:-}" ]; then bash -c "$POST" >"$OUT/post.log" 2>&1; echo "rc=$?" >>"$OUT/post.log"; tail -5 "$OUT/post.log"; fi
