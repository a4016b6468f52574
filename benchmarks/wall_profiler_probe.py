"""Does a torch.profiler session leave the host slower for the wall-time measurements that follow it?

The bench measures a wrapper call's wall time (CUDA events around one call on an idle device) in the same process
as its profiler sessions (kernel time). Kineto keeps CUPTI subscribed after a session unless it tears CUPTI down
(``TEARDOWN_CUPTI``), and every CUDA API call then pays its callbacks. This probe measures the same walls before
any profiler session, after one, and after many (the bench runs ~200), in this process.

GPU (one H200, ~1 min with compiling)::

    python3 benchmarks/wall_profiler_probe.py [--out FILE.json]
    TEARDOWN_CUPTI=1 python3 benchmarks/wall_profiler_probe.py   # kineto tears CUPTI down after each session
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from csa_compressor import api
from csa_compressor.bench import Case, _Timer
from csa_compressor.testing import make_pack

CASES = (Case((8192,), 128, 4, 2), Case((8192,), 128, 128, 1), Case((8192,) * 3, 512, 128, 1))


def profile_once(fn, calls: int = 5) -> None:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    prof.events()  # the bench reads the events too


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--sessions", type=int, default=100, help="profiler sessions before the third measurement")
    ap.add_argument("--out")
    opts = ap.parse_args()
    x = torch.zeros(1, device="cuda")
    fns = {"events only": lambda: None, "x.add_(1)": lambda: x.add_(1)}
    for case in CASES:
        p = make_pack(case.seqlens, case.head_dim, case.ratio, case.coff, device="cuda", seed=0)
        stats = api.autograd_uses_stats(p.kv, case.ratio, case.coff, "cute")
        kw = dict(ratio=case.ratio, coff=case.coff, total_comp=p.total_comp, backend="cute")
        saved = (
            api.csa_compressor_forward_wrapper(*p.inputs, return_softmax_stats=True, **kw)["softmax_stats"]
            if stats
            else None
        )
        fns[f"{case.name} fwd"] = lambda p=p, kw=kw, s=stats: api.csa_compressor_forward_wrapper(
            *p.inputs, return_softmax_stats=s, **kw
        )
        fns[f"{case.name} bwd"] = lambda p=p, kw=kw, s=saved: api.csa_compressor_backward_wrapper(
            *p.inputs, p.grad_out, softmax_stats=s, **kw
        )
    for fn in fns.values():  # compile, slabs, warm-up
        for _ in range(3):
            fn()
    torch.cuda.synchronize()

    timer = _Timer(torch.device("cuda", torch.cuda.current_device()), (1, 1, opts.calls))  # the bench's wall method

    phases = {}
    phases["before any profiler"] = {k: timer.wall_us(fn, opts.calls) for k, fn in fns.items()}
    profile_once(fns["x.add_(1)"])
    phases["after 1 session"] = {k: timer.wall_us(fn, opts.calls) for k, fn in fns.items()}
    t0 = time.perf_counter()
    for _ in range(opts.sessions - 1):
        profile_once(fns["x.add_(1)"], 2)
    spent = time.perf_counter() - t0
    phases[f"after {opts.sessions} sessions"] = {k: timer.wall_us(fn, opts.calls) for k, fn in fns.items()}

    env = os.environ.get("TEARDOWN_CUPTI")
    print(
        f"idle wall, us, median of {opts.calls} (TEARDOWN_CUPTI={env}; {opts.sessions - 1} sessions took {spent:.1f} s)"
    )
    names = list(phases)
    print(f"{'call':32s}" + "".join(f"{n:>24s}" for n in names))
    for k in fns:
        print(f"{k:32s}" + "".join(f"{phases[n][k]:24.1f}" for n in names))
    if opts.out:
        with open(opts.out, "w") as f:
            json.dump(
                {
                    "device": torch.cuda.get_device_name(),
                    "torch": torch.__version__,
                    "TEARDOWN_CUPTI": env,
                    "calls": opts.calls,
                    "phases": phases,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
