"""Kernels to read with Nsight Compute: one call each inside a cudaProfilerStart/Stop region.

    ncu --clock-control none --profile-from-start off --section SpeedOfLight \\
        --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \\
        python3 benchmarks/ncu_probe.py [--case 1x65536-d512-r128-c2] [--backends cute,triton]

Profiled, in order: a device-to-device copy of the same byte count as the backward's inputs (the floor's
reference), then per backend its forward and its backward (main + grad_ape reduction kernels) as autograd runs
them (the bench's callables: long windows write and read the softmax statistics); with ``--tile-probe`` last the
Triton kernel of ``read_floor_probe.py`` that only reads kv and score in the forward's tiles. Everything is compiled and
run before the region, so the region holds only the probed launches.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from csa_compressor.bench import _kernel_callables, select_cases
from csa_compressor.testing import make_pack


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", default="1x65536-d512-r128-c2")
    ap.add_argument("--backends", default="cute")
    ap.add_argument("--directions", default="fwd,bwd")
    ap.add_argument(
        "--tile-probe",
        action="store_true",
        help="also the Triton tile read of the forward's access pattern (read_floor_probe.py, 128x64, 8 warps)",
    )
    args = ap.parse_args()
    dev = torch.device("cuda", torch.cuda.current_device())
    (case,) = select_cases([args.case])
    pack = make_pack(case.seqlens, case.head_dim, case.ratio, case.coff, device=dev, seed=3)
    src = torch.empty(2 * pack.kv.numel(), dtype=torch.bfloat16, device=dev)
    dst = torch.empty_like(src)
    calls = [lambda: dst.copy_(src)]
    for backend in args.backends.split(","):
        fns = _kernel_callables(backend, pack, case)
        calls += [fns[d] for d in args.directions.split(",")]
    if args.tile_probe:
        from read_floor_probe import tile_probes

        calls += list(tile_probes(case, dev, configs=((64, 8, 0),)).values())
    for fn in calls:
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for fn in calls:
        fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print("probe done", args.case, args.backends)


if __name__ == "__main__":
    main()
