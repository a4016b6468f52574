"""Run one case's forward and backward (as autograd runs them) a few times, for Nsight Compute.

    ncu --profile-from-start off --clock-control none --section SpeedOfLight --section Occupancy --section WarpStateStats \\
        python3 benchmarks/ncu_case.py --case 1x8192-d128-r128-c1 --backends triton,cute

With ``ncu --profile-from-start off`` only the ``--calls`` calls per backend and direction, between
``cudaProfilerStart`` and ``cudaProfilerStop``, are profiled; the warm-up calls (compiles included) are not.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main() -> int:
    import torch

    from csa_compressor.bench import _kernel_callables, select_cases
    from csa_compressor.testing import make_pack

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", required=True)
    ap.add_argument("--backends", default="triton,cute")
    ap.add_argument("--directions", default="fwd,bwd")
    ap.add_argument("--calls", type=int, default=1)
    args = ap.parse_args()
    dev = torch.device("cuda", 0)
    (case,) = select_cases([args.case])
    pack = make_pack(case.seqlens, case.head_dim, case.ratio, case.coff, device=dev, seed=3)
    for backend in args.backends.split(","):
        fns = _kernel_callables(backend, pack, case)
        for direction in args.directions.split(","):
            fn = fns[direction]
            for _ in range(3):
                fn()
            torch.cuda.synchronize(dev)
            torch.cuda.cudart().cudaProfilerStart()
            torch.cuda.nvtx.range_push(f"{backend}.{direction}")
            for _ in range(args.calls):
                fn()
            torch.cuda.nvtx.range_pop()
            torch.cuda.synchronize(dev)
            torch.cuda.cudart().cudaProfilerStop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
