"""The cute backend's development loop on the bench's cases: numerics and kernel time of each kernel, one GPU run.

    python benchmarks/cute_sweep.py [--cases NAME,...] [--reps 10] [--out DIR]

For every case it runs the cute forward and backward through the public wrappers (and, for long windows, the
softmax-statistics pair autograd uses), checks them against the contract on the full-size pack
(``csa_compressor.testing.contract_report``), and times them with the bench's timer: cold and warm kernel time
and the wall per call. It uses only the public API, so it times the configurations the backend picks; sweeping
other configurations goes through the backend's per-architecture config factories. Prints a table and writes
``cute_sweep.json`` to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from csa_compressor import api, available_backends
from csa_compressor.bench import CASES, CUDNN_FRONTEND_H200, Timer, floor_us
from csa_compressor.testing import contract_report, make_pack


def calls(pack, stats: bool):
    """The forward and backward wrapper calls (with the statistics pair where ``stats``) and their outputs."""
    kw = dict(ratio=pack.ratio, coff=pack.coff, total_comp=pack.total_comp, backend="cute")
    saved = api.csa_compressor_forward_wrapper(*pack.inputs, return_softmax_stats=True, **kw) if stats else None

    def fwd():
        return api.csa_compressor_forward_wrapper(*pack.inputs, return_softmax_stats=stats, **kw)

    def bwd():
        return api.csa_compressor_backward_wrapper(
            *pack.inputs, pack.grad_out, softmax_stats=saved["softmax_stats"] if stats else None, **kw
        )

    return fwd, bwd


def check_and_walls(case, timer: Timer, reps: int) -> dict:
    """One case's pack, calls, contract report and walls (walls come before any profiler session: the timer's
    module says why)."""
    pack = make_pack(case.seqlens, case.head_dim, case.ratio, case.coff, device="cuda", seed=0)
    stats = api.autograd_uses_stats(pack.kv, case.ratio, case.coff, "cute")
    fwd, bwd = calls(pack, stats)
    report = contract_report(pack, fwd()["out"], tuple(bwd().values()))
    walls = {}
    for direction, fn in (("fwd", fwd), ("bwd", bwd)):
        timer.warm_up(fn)
        walls[direction] = timer.wall_us(fn, reps)
    return dict(case=case, pack=pack, stats=stats, calls={"fwd": fwd, "bwd": bwd}, ok=bool(report["ok"]), walls=walls)


def kernel_rows(item: dict, timer: Timer, rate: float, reps: int) -> list[dict]:
    case, rows = item["case"], []
    for direction, fn in item["calls"].items():
        cold, warm = timer.kernel(fn, reps, cold=True), timer.kernel(fn, reps, cold=False)
        rows.append(dict(case=case.name, direction=direction, stats=item["stats"], cold_us=cold.us, warm_us=warm.us,
                         wall_us=item["walls"][direction], floor_us=floor_us(case, direction, rate),
                         cudnn_frontend_us=CUDNN_FRONTEND_H200.get(case.name, {}).get(direction),
                         contract_ok=item["ok"]))  # fmt: skip
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="", help="comma-separated case names (default: the bench's matrix)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    if not torch.cuda.is_available() or "cute" not in available_backends("cuda"):
        print("cute_sweep: needs a GPU the cute backend runs on", file=sys.stderr)
        return 2
    names = [n for n in args.cases.split(",") if n]
    cases = [c for c in CASES if not names or c.name in names]
    timer = Timer(torch.device("cuda", torch.cuda.current_device()))
    rate = timer.copy_rate()
    items = [check_and_walls(case, timer, args.reps) for case in cases]
    rows = []
    print("| case | dir | stats | cold | warm | wall | cold / floor | vs cudnn-frontend | contract |")
    print("|---|---|---|---|---|---|---|---|---|")
    for item in items:
        for r in kernel_rows(item, timer, rate, args.reps):
            rows.append(r)
            vs = f"{r['cudnn_frontend_us'] / r['cold_us']:.2f}x" if r["cudnn_frontend_us"] else "—"
            print(f"| {r['case']} | {r['direction']} | {r['stats']} | {r['cold_us']:.1f} | {r['warm_us']:.1f} | "
                  f"{r['wall_us']:.1f} | {r['cold_us'] / r['floor_us']:.2f}x | {vs} | {r['contract_ok']} |", flush=True)  # fmt: skip
    with open(os.path.join(args.out, "cute_sweep.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return 0 if all(r["contract_ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
