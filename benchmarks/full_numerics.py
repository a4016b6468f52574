"""Numerics of the GPU backends on the full-size SPEC section 6 packs (the benchmark's inputs).

    python3 benchmarks/full_numerics.py [--backends cute,triton] [--cases 1x65536-d512-r128-c2,...] [--out DIR]

For every case and backend: forward and backward through the backend's launch functions on the pack
``python -m csa_compressor bench`` times (``make_pack(seed=0)``), checked with
``csa_compressor.testing.contract_report`` (SPEC 3 against the fp32 reference / fp64 oracle, exact zeros,
dAPE rel-L2), plus bitwise flags. The test suite checks many small packs; this checks the sizes that
are timed. Prints one line per (case, backend) and writes ``full_numerics.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from csa_compressor import dispatch
from csa_compressor.bench import SPEC_H200
from csa_compressor.testing import contract_report, make_pack


def parse(name: str):
    b, rest = name.split("x", 1)
    seqlen = int(rest.split("-")[0])
    d = int(name.split("-d")[1].split("-")[0])
    ratio = int(name.split("-r")[1].split("-")[0])
    coff = int(name.split("-c")[1])
    return (seqlen,) * int(b), d, ratio, coff


def check(name: str, backend: str, dev) -> dict:
    seqlens, d, ratio, coff = parse(name)
    pack = make_pack(seqlens, d, ratio, coff, device=dev, seed=0)
    mod = dispatch.backend_module(backend)
    for direction in ("forward", "backward"):
        mod.compile(direction, ratio, coff, d, torch.bfloat16, dev)
    kv, score, ape, cu, cuc = pack.inputs
    out = torch.full((pack.total_comp, d), float("nan"), dtype=torch.bfloat16, device=dev)
    mod.forward(kv, score, ape, cu, cuc, out, ratio, coff, None)
    grads = tuple(torch.full_like(t, float("nan")) for t in (kv, score, ape))
    mod.backward(kv, score, ape, cu, cuc, pack.grad_out, *grads, ratio, coff, None)
    torch.cuda.synchronize()
    rep = contract_report(pack, out, grads)
    res = {k: v for k, v in rep.items() if isinstance(v, (bool, int, float))}
    supports = getattr(mod, "supports_stats", None)
    if supports is not None and supports(ratio, coff, d):
        # The softmax-statistics pair, as autograd runs long windows.
        stats = torch.full((pack.total_comp, 3, d), float("nan"), dtype=torch.float32, device=dev)
        out_st = torch.full_like(out, float("nan"))
        mod.forward(kv, score, ape, cu, cuc, out_st, ratio, coff, None, stats)
        grads_st = tuple(torch.full_like(t, float("nan")) for t in (kv, score, ape))
        mod.backward(kv, score, ape, cu, cuc, pack.grad_out, *grads_st, ratio, coff, None, stats)
        torch.cuda.synchronize()
        rep_st = contract_report(pack, out_st, grads_st)
        res["stats_ok"] = bool(rep_st["ok"])
        res["stats_out_equal"] = bool(torch.equal(out_st, out))
        res["ok"] = bool(res["ok"] and rep_st["ok"])  # out_st meets the contract on its own (rep_st)
    return res


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backends", default="cute,triton")
    ap.add_argument("--cases", default=",".join(SPEC_H200))
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    dev = torch.device("cuda", torch.cuda.current_device())
    rows = []
    for name in args.cases.split(","):
        for backend in args.backends.split(","):
            t0 = time.time()
            try:
                rec = check(name, backend, dev)
            except Exception as exc:  # report and go on with the other cases
                rec = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            rec.update(case=name, backend=backend, seconds=round(time.time() - t0, 1))
            rows.append(rec)
            print(json.dumps(rec), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "full_numerics.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(dev), "rows": rows}, f, indent=1)
    bad = [r for r in rows if not r.get("ok")]
    print(f"{len(rows) - len(bad)}/{len(rows)} meet the contract")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
