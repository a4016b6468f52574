"""Long-window backward with and without the forward's softmax statistics, per GPU backend (development aid).

    python benchmarks/stats_compare.py [--backends cute,triton] [--cases 1x65536-d512-r128-c2,...]

Times (the bench's timer: profiler kernel time, L2 flushed by a write before each call / back to back) the
forward with and without writing the statistics and the backward with and without reading them, and checks
each backward against the SPEC contract. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch

from csa_compressor import api
from csa_compressor.bench import _Timer, select_cases
from csa_compressor.reference import uses_softmax_stats
from csa_compressor.testing import contract_report, make_pack

LONG_CASES = "1x65536-d512-r128-c2,3x8192-d512-r128-c1,1x8192-d128-r128-c1"


def _callables(inputs, grad_out, kw, stats):
    fwd, bwd = api.csa_compressor_forward_wrapper, api.csa_compressor_backward_wrapper
    return {
        "fwd": lambda: fwd(*inputs, **kw),
        "fwd+stats": lambda: fwd(*inputs, return_softmax_stats=True, **kw),
        "bwd": lambda: bwd(*inputs, grad_out, **kw),
        "bwd(stats)": lambda: bwd(*inputs, grad_out, softmax_stats=stats, **kw),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backends", default="cute,triton")
    ap.add_argument("--cases", default=LONG_CASES)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    dev = torch.device("cuda", 0)
    timer = _Timer(dev, (args.reps, args.reps, 5))
    rows = []
    for case in select_cases(args.cases.split(",")):
        if not uses_softmax_stats(case.ratio, case.coff):
            continue
        pack = make_pack(case.seqlens, case.head_dim, case.ratio, case.coff, device=dev, seed=3)
        inputs = pack.inputs
        for backend in args.backends.split(","):
            kw = dict(ratio=case.ratio, coff=case.coff, total_comp=pack.total_comp, backend=backend)
            stats = api.csa_compressor_forward_wrapper(*inputs, return_softmax_stats=True, **kw)["softmax_stats"]
            fns = _callables(inputs, pack.grad_out, kw, stats)
            for name, fn in fns.items():
                cold, warm = timer.kernel_us(fn, args.reps, cold=True), timer.kernel_us(fn, args.reps, cold=False)
                ok = None
                if name.startswith("bwd") and case.seqlens[0] * len(case.seqlens) <= 24576:
                    ok = contract_report(pack, grads=tuple(fn()))["ok"]
                rows.append(dict(case=case.name, backend=backend, what=name, cold=cold, warm=warm, contract=ok))
                print(json.dumps(rows[-1]), flush=True)
    with open(os.path.join(args.out, "stats_compare.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print("\n| case | backend | call | cold us | warm us | contract |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['backend']} | {r['what']} | {r['cold']:.1f} | {r['warm']:.1f} | {r['contract']} |")


if __name__ == "__main__":
    main()
