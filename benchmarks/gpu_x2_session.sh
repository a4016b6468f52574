#!/usr/bin/env bash
# Issue 28 in one call on a two-GPU machine (nvidia-h200-x2), within one device call's 10 minutes:
#   1. the context-parallel correctness checks over NCCL, one process per GPU, cute and triton
#      (tests/test_distributed.py::test_nccl_two_gpus_match_single_gpu, the cases of tests/cp_worker.py's
#      _nccl_suite): gathered rows and kv/score gradients bitwise equal to the single-GPU op on the whole
#      pack, grad_ape within 1e-6 relative, bad layouts a ValueError on both ranks;
#   2. the benchmark: benchmarks/cp_bench.py --world 2 (CP forward / forward+backward for 2x8192 and
#      2x65536-token packs split over the GPUs, against the single-GPU op on one rank's share; the NCCL
#      kernels' time in the halo exchange; the bytes it moved against the docs' formula);
#   3. the tests that need two GPUs: tensors on cuda:1 while cuda:0 is current, both backends
#      (pytest -k non_current).
# NVLink multicast stays off (the device docs require it). Logs and records come back as one tarball
# under $OUT. Run from the repository root:  bash benchmarks/gpu_x2_session.sh
set -uo pipefail
RESULT_DIR=${OUT:-/tmp/csa_out}
LOGS=/tmp/csa_logs
mkdir -p "$LOGS" "$RESULT_DIR"
. benchmarks/device_env.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
nvidia-smi --query-gpu=index,name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$LOGS/gpu.txt"
nvidia-smi topo -m >>"$LOGS/gpu.txt" 2>&1
python3 -c "import torch, triton, cutlass; print('torch', torch.__version__, 'triton', triton.__version__, 'cutlass-dsl', cutlass.__version__, 'nccl', torch.cuda.nccl.version())" | tee -a "$LOGS/gpu.txt"

PYTEST="python3 -m pytest -q -ra -p no:cacheprovider -s"
# 1. CP correctness over NCCL (both GPUs; each rank compiles its kernels once). The test kills its rank
#    processes (and reports their stacks) at CP_NCCL_TIMEOUT, before the shell's timeout would orphan them.
export CP_NCCL_TIMEOUT=${CP_NCCL_TIMEOUT:-230}
timeout ${CP_TEST_TIMEOUT:-250} $PYTEST tests/test_distributed.py -k nccl >"$LOGS/cp_nccl_tests.log" 2>&1
echo "rc=$?" >>"$LOGS/cp_nccl_tests.log"
# 2. The two-GPU benchmark.
timeout ${CP_BENCH_TIMEOUT:-250} python3 benchmarks/cp_bench.py --world 2 --out "$LOGS/cp_two_gpus" >"$LOGS/cp_bench.txt" 2>&1
echo "rc=$?" >>"$LOGS/cp_bench.txt"
# 3. Tensors on a non-current device (both GPUs).
timeout ${NONCURRENT_TIMEOUT:-80} $PYTEST tests -k non_current >"$LOGS/non_current.log" 2>&1
echo "rc=$?" >>"$LOGS/non_current.log"

tar czf "$RESULT_DIR/logs_cp_x2.tar.gz" -C "$LOGS" .
[ -d "$LOGS/cp_two_gpus" ] && cp "$LOGS/cp_two_gpus/cp_bench.json" "$LOGS/cp_two_gpus/cp_bench.md" "$RESULT_DIR/" 2>/dev/null
echo "==== CP over NCCL"; grep -E "^(FAILED|ERROR)|passed|failed|skipped|case seconds" "$LOGS/cp_nccl_tests.log" | cut -c1-400 | tail -n 8; tail -n 1 "$LOGS/cp_nccl_tests.log"
echo "==== benchmark"; cat "$LOGS/cp_two_gpus/cp_bench.md" 2>/dev/null || tail -n 20 "$LOGS/cp_bench.txt"; tail -n 1 "$LOGS/cp_bench.txt"
echo "==== non-current device"; grep -E "^(FAILED|ERROR)" "$LOGS/non_current.log" | head -n 10; tail -n 2 "$LOGS/non_current.log"
