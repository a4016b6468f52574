"""Kernel time per call, split by kernel name: where a backward's time goes (main kernel vs grad_ape reduction).

GPU::

    python3 benchmarks/kernel_breakdown.py [--backends cute] [--cases NAME,...] [--directions fwd,bwd] [--reps 20]
        [--out FILE.json]

For every SPEC section 6 case and backend, the fwd and bwd callables the benchmark times (``bench._kernel_callables``),
each kernel's mean duration per call from torch.profiler, cold (the benchmark's L2 flush before each call) and warm.
The flush kernel itself is left out. Prints one line of JSON per (case, backend, direction, mode).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def breakdown(timer, fn, calls: int, cold: bool) -> dict[str, float]:
    """Kernel name -> mean microseconds per call, from the benchmark timer's profile (annotation spans and the
    flush's fill kernel excluded)."""
    from csa_compressor.bench import _FLUSH_KERNEL_HINT

    activities, _ = timer.device_activity(fn, calls, cold)
    totals: dict[str, float] = collections.defaultdict(float)
    for a in activities:
        if a.is_user_annotation or (cold and _FLUSH_KERNEL_HINT in a.name):
            continue
        totals[a.name[:90]] += a.duration_us
    return {k: round(v / calls, 2) for k, v in sorted(totals.items(), key=lambda kv: -kv[1])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", default="cute")
    ap.add_argument("--cases", default="")
    ap.add_argument("--directions", default="fwd,bwd")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default="")
    args = ap.parse_args()

    import torch

    from csa_compressor import available_backends
    from csa_compressor.bench import _kernel_callables, _Timer, select_cases
    from csa_compressor.testing import make_pack

    dev = torch.device("cuda", 0)
    timer = _Timer(dev, (args.reps, args.reps, 1))
    names = [b for b in args.backends.split(",") if b in available_backends(dev)]
    rows = []
    for case in select_cases(args.cases.split(",") if args.cases else None):
        pack = make_pack(case.seqlens, case.head_dim, case.ratio, case.coff, device=dev, seed=3)
        for backend in names:
            for direction, fn in _kernel_callables(backend, pack, case).items():
                if direction not in args.directions.split(","):
                    continue
                for _ in range(3):
                    fn()
                for mode in ("cold", "warm"):
                    per = breakdown(timer, fn, args.reps, mode == "cold")
                    rec = dict(case=case.name, backend=backend, direction=direction, mode=mode,
                               total=round(sum(per.values()), 2), kernels=per)  # fmt: skip
                    rows.append(rec)
                    print(json.dumps(rec), flush=True)
        del pack
        torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(dev), "reps": args.reps, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
