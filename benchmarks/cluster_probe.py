"""Residency of the cute statistics backward's cluster form (``Schedule.CL``) on this GPU (development aid).

The cluster form launches the same CTAs as the slab form (grid ``[num_ctas, nchunk]``), with grid x as one
cluster. If fewer clusters than the grid holds can be resident at once, the single-wave design runs in more than
one wave. This asks the driver, for the compiled kernel of each ratio-128 SPEC configuration: resident CTAs per SM
without clusters (``cuOccupancyMaxActiveBlocksPerMultiprocessor``) and resident clusters of 1, 2, 3, 4 and 8 CTAs
(``cuOccupancyMaxActiveClusters``), beside the clusters the grid needs::

    python3 benchmarks/cluster_probe.py [--out probe.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def probe(ratio: int, coff: int, head_dim: int) -> dict:
    import cuda.bindings.driver as cuda
    import torch

    from csa_compressor.backends.cute import launch

    dev = torch.device("cuda", 0)
    key = ("backward_stats", ratio, coff, head_dim)
    launch.SCHEDULE_OVERRIDE[key] = replace(launch._default_schedule(*key), CL=True)
    try:
        launcher = launch._get_launcher(*key, torch.bfloat16, dev)
    finally:
        launch.SCHEDULE_OVERRIDE.pop(key)
    sch = launcher.sch
    smem = launch.backward_smem_bytes(sch)
    (err,) = cuda.cuInit(0)
    torch.zeros(1, device=dev)  # the primary context is current from here on (cuModuleLoadData needs one)
    cubin = launcher.compiled.artifacts.CUBIN
    names = [n for n in launch._ptx_entries(launcher.compiled.artifacts.PTX) if "reduce_kernel" not in n]
    err, module = cuda.cuModuleLoadData(bytes(cubin))
    assert err == cuda.CUresult.CUDA_SUCCESS, err
    err, func = cuda.cuModuleGetFunction(module, names[0].encode())
    assert err == cuda.CUresult.CUDA_SUCCESS, err
    attr = cuda.CUfunction_attribute
    for k, v in (
        (attr.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem),
        (attr.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, 100),
        (attr.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1),
    ):
        (err,) = cuda.cuFuncSetAttribute(func, k, v)
        assert err == cuda.CUresult.CUDA_SUCCESS, (k, err)
    err, per_sm = cuda.cuOccupancyMaxActiveBlocksPerMultiprocessor(func, sch.threads, smem)
    rec = dict(
        config=f"r{ratio} c{coff} d{head_dim}",
        threads=sch.threads,
        smem=smem,
        ctas_per_sm=per_sm,
        sms=launcher.num_sms,
        nchunk=launcher.nchunk,
        grid_x=launch.backward_capacity(launcher) // launcher.nchunk,
    )
    for size in (1, 2, 3, 4, 8):
        cfg = cuda.CUlaunchConfig()
        cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = size, launcher.nchunk, 1
        cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = sch.threads, 1, 1
        cfg.sharedMemBytes = smem
        la = cuda.CUlaunchAttribute()
        la.id = cuda.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
        la.value.clusterDim.x, la.value.clusterDim.y, la.value.clusterDim.z = size, 1, 1
        cfg.attrs = [la]
        cfg.numAttrs = 1
        err, n = cuda.cuOccupancyMaxActiveClusters(func, cfg)
        rec[f"max_clusters_{size}"] = n if err == cuda.CUresult.CUDA_SUCCESS else str(err)
    rec["clusters_needed"] = launcher.nchunk
    return rec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = [probe(*cfg) for cfg in ((128, 1, 128), (128, 1, 512), (128, 2, 512))]
    for r in rows:
        print(json.dumps(r))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
