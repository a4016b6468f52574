"""Kernels to read with Nsight Compute: one call each inside a cudaProfilerStart/Stop region.

    ncu --clock-control none --profile-from-start off --section SpeedOfLight \\
        --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \\
        python3 benchmarks/ncu_probe.py [--case 1x65536-d512-r128-c2] [--backend cute]

Profiled, in order: a device-to-device copy of the same byte count as the backward's inputs
(the floor's reference), the backend's forward, and its backward (main + grad_ape reduction kernels).
Everything is compiled and run once before the region, so the region holds only the timed launches.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from csa_compressor import dispatch
from csa_compressor.testing import make_pack


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", default="1x65536-d512-r128-c2")
    ap.add_argument("--backend", default="cute")
    args = ap.parse_args()
    b, rest = args.case.split("x", 1)
    seqlen = int(rest.split("-")[0])
    d = int(args.case.split("-d")[1].split("-")[0])
    ratio = int(args.case.split("-r")[1].split("-")[0])
    coff = int(args.case.split("-c")[1])
    dev = torch.device("cuda", torch.cuda.current_device())
    pack = make_pack((seqlen,) * int(b), d, ratio, coff, device=dev, seed=3)
    kv, score, ape, cu, cuc = pack.inputs
    mod = dispatch.backend_module(args.backend)
    mod.compile("forward", ratio, coff, d, torch.bfloat16, dev)
    mod.compile("backward", ratio, coff, d, torch.bfloat16, dev)
    out = torch.empty((pack.total_comp, d), dtype=torch.bfloat16, device=dev)
    gkv, gsc, gape = torch.empty_like(kv), torch.empty_like(score), torch.empty_like(ape)
    src = torch.empty(2 * kv.numel(), dtype=torch.bfloat16, device=dev)
    dst = torch.empty_like(src)

    def run():
        dst.copy_(src)
        mod.forward(kv, score, ape, cu, cuc, out, ratio, coff, None)
        mod.backward(kv, score, ape, cu, cuc, pack.grad_out, gkv, gsc, gape, ratio, coff, None)

    run()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    run()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print("probe done", args.case, args.backend)


if __name__ == "__main__":
    main()
