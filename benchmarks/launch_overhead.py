"""Host overhead of one call, layer by layer: bare backend launch, class ``execute``, wrapper, autograd op.

GPU (one H200; measuring takes about 10 s, the rest is compiling the kernels of the two cases; no new
case starts after ``--budget-s``, 75 s by default, and skipped cases are listed)::

    python3 benchmarks/launch_overhead.py --out $OUT/launch_overhead.json

For each available GPU backend (cute, triton) and each case (1x8192 d128 r4 c2, 1x8192 d128 r128 c1)
it reports, per layer, the median over ``--calls`` calls (after warm-up) of

- ``host``: ``time.perf_counter`` around the call (no synchronisation inside);
- ``wall``: CUDA events recorded right before and right after the call;

in two modes: ``b2b`` (back-to-back calls, the events of each call timed afterwards) and ``idle``
(each call started on an idle device: synchronise, sleep 200 us, call). ``kernel`` is the summed CUDA
kernel time per call of the bare launch (torch.profiler, warm L2, back-to-back) so that
``wall - kernel`` is what the host adds; the SPEC target is wrapper wall <= kernel + 10 us (forward),
+ 15 us (backward).

Layers: ``bare`` (the backend's ``forward``/``backward`` on preallocated buffers), ``execute``
(``CSACompressorForward/Backward.execute``), ``wrapper`` (``csa_compressor_*_wrapper`` with
``total_comp``, allocating its outputs), ``autograd fwd`` (``compressor_pool`` on leaves that require
grad), ``autograd fwd+bwd`` (the same plus ``torch.autograd.grad``).

One switch of the cute wrappers on against off, alternated in one process (GPU): the backward's per-stream slab
scratch (``launch.CACHE_SLABS``) or the C++ host fast path (``host_ext``)::

    python3 benchmarks/launch_overhead.py --ab slab-cache|host-ext [--rounds 8] [--out FILE.json]

CPU mock (no GPU needed; the backend launch is replaced by a no-op, so only the Python layers are
timed, best of ``--repeat`` rounds of ``--number`` calls)::

    python3 benchmarks/launch_overhead.py --cpu-mock [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import timeit
import types

import torch

from csa_compressor import (
    CSACompressorBackward,
    CSACompressorForward,
    available_backends,
    compressor_pool,
    csa_compressor_backward_wrapper,
    csa_compressor_forward_wrapper,
    dispatch,
)
from csa_compressor.testing import make_pack

CASES = ((4, 2), (128, 1))  # (ratio, coff) at 1x8192 tokens, head_dim 128


def _layers(p, backend: str, module, device) -> dict:
    """name -> zero-argument callable for every layer, on pack ``p``."""
    ratio, coff, head_dim, rows = p.ratio, p.coff, p.head_dim, p.total_comp
    inputs = p.inputs
    out = torch.empty(rows, head_dim, dtype=p.kv.dtype, device=device)
    grads = [torch.empty_like(p.kv), torch.empty_like(p.score), torch.empty_like(p.ape)]
    fwd = CSACompressorForward(*inputs, out, ratio=ratio, coff=coff, backend=backend)
    bwd = CSACompressorBackward(*inputs, p.grad_out, *grads, ratio=ratio, coff=coff, backend=backend)
    fwd.compile()
    bwd.compile()
    leaves = [t.detach().clone().requires_grad_(True) for t in (p.kv, p.score, p.ape)]
    cu, cuc, g = p.cu_seqlens, p.cu_seqlens_comp, p.grad_out
    kv, score, ape = inputs[:3]

    def autograd_fwd():
        return compressor_pool(*leaves, cu, cuc, ratio, coff, rows, backend)

    def autograd_fwd_bwd():
        y = compressor_pool(*leaves, cu, cuc, ratio, coff, rows, backend)
        return torch.autograd.grad(y, leaves, g)

    # Pieces of the wrapper's own work (where "wrapper fwd" spends its time above "execute fwd").
    from csa_compressor import api

    csa_compressor_forward_wrapper(kv, score, ape, cu, cuc, ratio=ratio, coff=coff, total_comp=rows, backend=backend)
    fast_op = api._FWD_FAST[api._fast_key(kv, ratio, coff, None, backend)]
    pieces = {
        "piece fast_key": lambda: api._fast_key(kv, ratio, coff, None, backend),
        "piece new_empty": lambda: kv.new_empty((rows, head_dim)),
        "piece TupleDict": lambda: api.TupleDict(out=out),
        "piece run_fresh": lambda: fast_op._run_fresh(kv, score, ape, cu, cuc, out, None),
        "piece pool_forward": lambda: api._pool_forward(kv, score, ape, cu, cuc, ratio, coff, rows, backend),
    }
    return pieces | {
        "bare fwd": lambda: module.forward(kv, score, ape, cu, cuc, out, ratio, coff, None),
        "execute fwd": lambda: fwd.execute(kv, score, ape, cu, cuc, out),
        "wrapper fwd": lambda: csa_compressor_forward_wrapper(
            kv, score, ape, cu, cuc, ratio=ratio, coff=coff, total_comp=rows, backend=backend
        ),
        "bare bwd": lambda: module.backward(kv, score, ape, cu, cuc, g, *grads, ratio, coff, None),
        "execute bwd": lambda: bwd.execute(kv, score, ape, cu, cuc, g, *grads),
        "wrapper bwd": lambda: csa_compressor_backward_wrapper(
            kv, score, ape, cu, cuc, g, ratio=ratio, coff=coff, backend=backend
        ),
        "autograd fwd": autograd_fwd,
        "autograd fwd+bwd": autograd_fwd_bwd,
    }


# ---------------------------------------------------------------------------------------------- CPU mock


def _noop_backend() -> types.ModuleType:
    mod = types.ModuleType("csa_compressor_noop_backend")
    mod.unavailable_reason = lambda: None
    mod.device_unsupported_reason = lambda device: None
    mod.config_unsupported_reason = lambda ratio, coff, head_dim: None
    mod.compile = lambda direction, ratio, coff, head_dim, dtype, device: None
    mod.supports_stats = lambda ratio, coff, head_dim: True
    mod.AUTOGRAD_STATS = False

    def forward(kv, score, ape, cu_seqlens, cu_seqlens_comp, out, ratio, coff, stream=None, stats=None):
        return None

    def backward(
        kv,
        score,
        ape,
        cu_seqlens,
        cu_seqlens_comp,
        grad_out,
        grad_kv,
        grad_score,
        grad_ape,
        ratio,
        coff,
        stream=None,
        stats=None,
    ):
        return None

    mod.forward, mod.backward = forward, backward
    return mod


def cpu_mock(opts) -> dict:
    """Per-call Python overhead of each layer with a no-op backend standing in for "reference" (CPU tensors)."""
    noop = _noop_backend()
    real_load = dispatch._load
    dispatch._load = lambda name: (noop, None) if name == "reference" else real_load(name)
    device = torch.device("cpu")
    x = torch.zeros(1)
    kv = torch.empty(8192, 256, dtype=torch.bfloat16)
    results: dict[str, dict[str, float]] = {}

    def best_us(fn) -> float:
        fn()
        return min(timeit.repeat(fn, number=opts.number, repeat=opts.repeat)) / opts.number * 1e6

    results["torch"] = {
        "x.add_(1)": best_us(lambda: x.add_(1)),
        "torch.empty_like(kv 8192x256 bf16)": best_us(lambda: torch.empty_like(kv)),
        "no-op python call": best_us(lambda: noop.forward(0, 0, 0, 0, 0, 0, 4, 2, None)),
    }
    for ratio, coff in CASES:
        p = make_pack((8192,), 128, ratio, coff, device=device, seed=0)
        layers = _layers(p, "reference", noop, device)
        results[f"r{ratio}c{coff}"] = {name: best_us(fn) for name, fn in layers.items()}
    print(f"CPU mock: best of {opts.repeat} x {opts.number} calls, us per call (no-op backend launch)")
    for group, rows in results.items():
        print(f"  [{group}]")
        for name, us in rows.items():
            print(f"    {name:36s} {us:8.2f}")
    return {"mode": "cpu-mock", "torch_version": torch.__version__, "us_per_call": results}


# ---------------------------------------------------------------------------------------------- GPU


def _kernel_us(fn, calls: int = 50) -> float | None:
    """Summed CUDA kernel time per call (torch.profiler, as csa_compressor.bench does), None if nothing recorded."""
    try:
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
        total = sum(
            e.time_range.elapsed_us()
            for e in prof.events()
            if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
        )
        return total / calls if total > 0 else None
    except Exception as exc:  # report and go on
        print(f"  (profiler failed: {type(exc).__name__}: {exc})")
        return None


def _time_gpu(fn, calls: int, warmup: int = 20) -> dict[str, float]:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(calls)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(calls)]
    host = []
    for i in range(calls):  # back-to-back
        starts[i].record()
        h0 = time.perf_counter()
        fn()
        h1 = time.perf_counter()
        ends[i].record()
        host.append((h1 - h0) * 1e6)
    torch.cuda.synchronize()
    b2b_wall = [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends, strict=True)]
    idle_host, idle_wall = [], []
    for i in range(calls):  # one call on an idle device
        torch.cuda.synchronize()
        time.sleep(0.0002)
        starts[i].record()
        h0 = time.perf_counter()
        fn()
        h1 = time.perf_counter()
        ends[i].record()
        ends[i].synchronize()
        idle_host.append((h1 - h0) * 1e6)
        idle_wall.append(starts[i].elapsed_time(ends[i]) * 1e3)
    med = statistics.median
    return {
        "b2b_host": med(host),
        "b2b_wall": med(b2b_wall),
        "idle_host": med(idle_host),
        "idle_wall": med(idle_wall),
    }


def toggle_ab(opts) -> dict:
    """One switch of the cute wrappers on against off, alternated in one process (``--rounds`` rounds of ``--calls``
    calls per side), so that host drift hits both sides alike. ``--ab slab-cache``: the backward's per-stream slab
    scratch (``launch.CACHE_SLABS``; off also turns the C++ backward path off); ``--ab host-ext``: the C++ host fast
    path of both wrappers (the ops' ``_host``)."""
    from csa_compressor import api
    from csa_compressor.backends.cute import launch as cute_launch

    device = torch.device("cuda", torch.cuda.current_device())
    result: dict = {"device": torch.cuda.get_device_name(device), "torch_version": torch.__version__}
    result.update(calls=opts.calls, rounds=opts.rounds, mode=f"ab {opts.ab}")
    for ratio, coff in CASES:
        p = make_pack((8192,), 128, ratio, coff, device=device, seed=0)
        layers = _layers(p, "cute", dispatch.backend_module("cute"), device)
        for layer in ("wrapper fwd", "wrapper bwd"):
            fn = layers[layer]
            fn()
            fn()  # the ops exist and the stream has its slabs
            ops = [op for op in (*api._FWD_FAST.values(), *api._BWD_FAST.values()) if op.backend == "cute"]
            saved = [op._host for op in ops]

            def switch(on: bool, ops=ops, saved=saved) -> None:
                if opts.ab == "slab-cache":
                    cute_launch.CACHE_SLABS = on
                else:
                    for op, host in zip(ops, saved, strict=True):
                        op._host = host if on else None

            sides: dict[str, list[dict]] = {"on": [], "off": []}
            for _ in range(opts.rounds):
                for name in ("on", "off"):
                    switch(name == "on")
                    sides[name].append(_time_gpu(fn, opts.calls))
            switch(True)
            case = f"cute 1x8192 d128 r{ratio} c{coff} {layer}"
            result[case] = {
                name: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for name, runs in sides.items()
            }
            result[case]["host path bound"] = all(h is not None for h in saved)
            print(case, "(C++ host path bound)" if result[case]["host path bound"] else "")
            for name in ("on", "off"):
                print(f"  {name:4s} " + " ".join(f"{k} {v:.1f}" for k, v in result[case][name].items()))
    return result


def gpu(opts) -> dict:
    device = torch.device("cuda", torch.cuda.current_device())
    t_start = time.perf_counter()
    x = torch.zeros(1, device=device)
    result: dict = {"device": torch.cuda.get_device_name(device), "torch_version": torch.__version__}
    result["calls"] = opts.calls
    result["torch"] = {
        # The two CUDA events around nothing: what the wall-time method itself costs on this host.
        "nothing (events only)": _time_gpu(lambda: None, opts.calls),
        "x.add_(1)": _time_gpu(lambda: x.add_(1), opts.calls),
        "torch.empty(1)+add_": _time_gpu(lambda: torch.empty(1, device=device).add_(1), opts.calls),
    }
    backends = [b for b in available_backends(device) if b != "reference"]
    if opts.backends:
        backends = [b for b in backends if b in opts.backends.split(",")]
    skipped = result["skipped"] = []
    measured = []  # (case, layers, rows, set-up seconds)
    for backend in backends:
        module = dispatch.backend_module(backend)
        for ratio, coff in CASES:
            case = f"{backend} 1x8192 d128 r{ratio} c{coff}"
            if time.perf_counter() - t_start > opts.budget_s:
                skipped.append(case)
                print(f"[{case}] skipped: past the --budget-s of {opts.budget_s:.0f} s")
                continue
            t0 = time.perf_counter()
            try:
                p = make_pack((8192,), 128, ratio, coff, device=device, seed=0)
                layers = _layers(p, backend, module, device)
                compile_s = time.perf_counter() - t0
                rows = {name: _time_gpu(fn, opts.calls) for name, fn in layers.items()}
            except Exception as exc:  # report and go on with the other cases
                result[case] = {"error": f"{type(exc).__name__}: {exc}"}
                print(f"[{case}] error: {type(exc).__name__}: {exc}")
                continue
            measured.append((case, layers, rows, compile_s))
    # Kernel times last: after a profiler session every CUDA API call of the process is slower
    # (benchmarks/wall_profiler_probe.py), so no wall is timed after one.
    for case, layers, rows, compile_s in measured:
        kernel = {"fwd": _kernel_us(layers["bare fwd"]), "bwd": _kernel_us(layers["bare bwd"])}
        result[case] = {"compile_s": compile_s, "kernel_us": kernel, "layers": rows}
        shown = {k: "n/a" if v is None else f"{v:.1f}" for k, v in kernel.items()}
        print(f"[{case}] (set-up {compile_s:.1f} s) kernel fwd {shown['fwd']} us, bwd {shown['bwd']} us")
        print(f"  {'layer':18s} {'b2b host':>9s} {'b2b wall':>9s} {'idle host':>10s} {'idle wall':>10s}")
        for name, r in rows.items():
            print(
                f"  {name:18s} {r['b2b_host']:9.1f} {r['b2b_wall']:9.1f} {r['idle_host']:10.1f} {r['idle_wall']:10.1f}"
            )
        for direction, layer, slack in (("fwd", "wrapper fwd", 10.0), ("bwd", "wrapper bwd", 15.0)):
            k = kernel[direction]
            if k is not None:
                wall = rows[layer]["idle_wall"]
                verdict = "meets" if wall <= k + slack else "misses"
                print(f"  target {layer}: idle wall {wall:.1f} <= kernel {k:.1f} + {slack:.0f}: {verdict}")
    for name, r in result["torch"].items():
        print(f"  {name:22s} {r['b2b_host']:9.1f} {r['b2b_wall']:9.1f} {r['idle_host']:10.1f} {r['idle_wall']:10.1f}")
    result["runtime_s"] = time.perf_counter() - t_start
    print(f"total {result['runtime_s']:.1f} s")
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="write the figures as JSON here")
    parser.add_argument("--cpu-mock", action="store_true", help="time the Python layers over a no-op backend")
    parser.add_argument("--calls", type=int, default=200, help="GPU: timed calls per layer and mode")
    parser.add_argument("--backends", help="GPU: comma-separated subset of the GPU backends")
    parser.add_argument("--budget-s", type=float, default=75.0, help="GPU: start no new case after this many seconds")
    parser.add_argument("--ab", choices=("slab-cache", "host-ext"), help="GPU: one cute switch on vs off, alternated")
    parser.add_argument("--rounds", type=int, default=8, help="--ab: alternating rounds")
    parser.add_argument("--number", type=int, default=2000, help="CPU mock: calls per round")
    parser.add_argument("--repeat", type=int, default=7, help="CPU mock: rounds (the best is kept)")
    opts = parser.parse_args()
    if opts.cpu_mock:
        result = cpu_mock(opts)
    elif not torch.cuda.is_available():
        print("no CUDA device: nothing to measure (use --cpu-mock for the Python layers)")
        return 0
    elif opts.ab:
        result = toggle_ab(opts)
    else:
        result = gpu(opts)
    if opts.out:
        with open(opts.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
