"""One-off measurement (issue: one launch path): CuTe-DSL's TVM-FFI host function against today's launch paths.

For 1x8192 d128 r4 c2 forward and backward, on one GPU: host time per call back to back and the idle wall
(CUDA events) of (a) one eager x.add_(1), (b) the packed ctypes path (launch.forward / launch.backward),
(c) the wrapper through the C++ host extension, (d) the TVM-FFI-compiled host function called with integer
pointers and an explicit stream, (e) a lean Python wrapper on (d): torch.empty + the call. Checks that (d)
writes the same bits as (b), and that an exported object file loads in a fresh process and runs.

    python3 benchmarks/tvm_ffi_probe.py --out $OUT/tvm_ffi_probe.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from launch_overhead import _time_gpu

import csa_compressor as cc
from csa_compressor.backends.cute import launch as L
from csa_compressor.testing import make_pack


def tvm_compile(direction, ratio, coff, head_dim, arch, sch):
    import cuda.bindings.driver as cuda
    import cutlass.cute as cute
    from cutlass import Int32

    from csa_compressor.backends.cute.backward import build_backward
    from csa_compressor.backends.cute.forward import build_forward

    build = build_forward if direction.startswith("forward") else build_backward
    host = build(ratio, coff, head_dim, sch)
    args = [L._fake_ptr(t) for t in L._dtypes(direction)] + [Int32(1)] * L._N_INT[direction]
    return cute.compile(host, *args, cuda.CUstream(0), options=f"--gpu-arch={arch} --enable-tvm-ffi")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tvm_ffi_probe.json")
    ap.add_argument("--calls", type=int, default=300)
    opts = ap.parse_args()
    dev = torch.device("cuda", 0)
    p = make_pack((8192,), 128, 4, 2, device=dev, seed=0)
    kv, score, ape, cu, cuc = p.inputs
    n, b = p.total_comp, cu.shape[0] - 1
    res: dict = {"device": torch.cuda.get_device_name(0), "calls": opts.calls}
    x = torch.zeros(1, device=dev)
    res["x.add_(1)"] = _time_gpu(lambda: x.add_(1), opts.calls)

    out_fast = torch.empty(n, 128, dtype=torch.bfloat16, device=dev)
    L.compile("forward", 4, 2, 128, torch.bfloat16, dev)
    L.compile("backward", 4, 2, 128, torch.bfloat16, dev)
    lf = L._get_launcher("forward", 4, 2, 128, torch.bfloat16, dev)
    lb = L._get_launcher("backward", 4, 2, 128, torch.bfloat16, dev)
    gkv, gsc, gape = torch.empty_like(kv), torch.empty_like(score), torch.empty_like(ape)

    res["packed fast: forward"] = _time_gpu(
        lambda: L.forward(kv, score, ape, cu, cuc, out_fast, 4, 2, None), opts.calls
    )
    res["packed fast: backward"] = _time_gpu(
        lambda: L.backward(kv, score, ape, cu, cuc, p.grad_out, gkv, gsc, gape, 4, 2, None), opts.calls
    )
    res["C++ ext wrapper: forward"] = _time_gpu(
        lambda: cc.csa_compressor_forward_wrapper(kv, score, ape, cu, cuc, 4, 128, 2, n), opts.calls
    )
    res["C++ ext wrapper: backward"] = _time_gpu(
        lambda: cc.csa_compressor_backward_wrapper(kv, score, ape, cu, cuc, p.grad_out, 4, 128, 2, n), opts.calls
    )

    arch = "sm_90a"
    t0 = time.perf_counter()
    tf = tvm_compile("forward", 4, 2, 128, arch, lf.sch)
    tb = tvm_compile("backward", 4, 2, 128, arch, lb.sch)
    res["tvm compile s (fwd+bwd)"] = time.perf_counter() - t0
    stream = torch.cuda.current_stream(dev).cuda_stream
    out_tvm = torch.empty_like(out_fast)
    fptrs = (kv.data_ptr(), score.data_ptr(), ape.data_ptr(), cu.data_ptr(), cuc.data_ptr())
    tf(*fptrs, out_tvm.data_ptr(), b, n, stream)
    L.forward(kv, score, ape, cu, cuc, out_fast, 4, 2, None)
    torch.cuda.synchronize()
    res["tvm forward bitwise == packed"] = bool(torch.equal(out_tvm.view(torch.int16), out_fast.view(torch.int16)))

    rows_per_cta, num_ctas = L.backward_grid(lb, n, ape.numel())
    ws = torch.empty(num_ctas * ape.numel(), dtype=torch.float32, device=dev)
    g2 = [torch.empty_like(t) for t in (kv, score, ape)]
    bargs = (*fptrs, p.grad_out.data_ptr(), *(t.data_ptr() for t in g2), ws.data_ptr(), b, n, kv.shape[0],
             rows_per_cta, num_ctas)  # fmt: skip
    tb(*bargs, stream)
    L.backward(kv, score, ape, cu, cuc, p.grad_out, gkv, gsc, gape, 4, 2, None)
    torch.cuda.synchronize()
    res["tvm backward bitwise == packed"] = all(
        torch.equal(
            a.view(torch.int16) if a.dtype == torch.bfloat16 else a,
            c.view(torch.int16) if c.dtype == torch.bfloat16 else c,
        )
        for a, c in zip(g2, (gkv, gsc, gape), strict=True)
    )

    def tvm_fwd_bare():
        tf(*fptrs, out_tvm.data_ptr(), b, n, stream)

    def tvm_fwd_ptrs():
        tf(kv.data_ptr(), score.data_ptr(), ape.data_ptr(), cu.data_ptr(), cuc.data_ptr(), out_tvm.data_ptr(),
           cu.shape[0] - 1, out_tvm.shape[0], torch.cuda.current_stream(dev).cuda_stream)  # fmt: skip

    raw_stream = torch._C._cuda_getCurrentRawStream

    def tvm_fwd_lean_wrapper():
        out = torch.empty((n, 128), dtype=kv.dtype, device=kv.device)
        tf(kv.data_ptr(), score.data_ptr(), ape.data_ptr(), cu.data_ptr(), cuc.data_ptr(), out.data_ptr(),
           cu.shape[0] - 1, n, raw_stream(0))  # fmt: skip
        return out

    def tvm_bwd_bare():
        tb(*bargs, stream)

    def tvm_bwd_lean_wrapper():
        a, c, e = torch.empty_like(kv), torch.empty_like(score), torch.empty_like(ape)
        tb(kv.data_ptr(), score.data_ptr(), ape.data_ptr(), cu.data_ptr(), cuc.data_ptr(), p.grad_out.data_ptr(),
           a.data_ptr(), c.data_ptr(), e.data_ptr(), ws.data_ptr(), cu.shape[0] - 1, n, kv.shape[0], rows_per_cta,
           num_ctas, raw_stream(0))  # fmt: skip
        return a, c, e

    res["tvm bare (fixed ints): forward"] = _time_gpu(tvm_fwd_bare, opts.calls)
    res["tvm with data_ptr() per call: forward"] = _time_gpu(tvm_fwd_ptrs, opts.calls)
    res["tvm lean wrapper: forward"] = _time_gpu(tvm_fwd_lean_wrapper, opts.calls)
    res["tvm bare (fixed ints): backward"] = _time_gpu(tvm_bwd_bare, opts.calls)
    res["tvm lean wrapper: backward"] = _time_gpu(tvm_bwd_lean_wrapper, opts.calls)
    lf_bare = lambda: lf.capi(lf.packed)  # noqa: E731
    lf._pack(lf.slots, 0, *fptrs, out_fast.data_ptr(), b, n, stream)
    res["packed bare capi (fixed ints): forward"] = _time_gpu(lf_bare, opts.calls)

    # Disk cache: export, load in a fresh process, run, compare.
    with tempfile.TemporaryDirectory() as tmp:
        obj = os.path.join(tmp, "fwd.o")
        t0 = time.perf_counter()
        tf.export_to_c(obj, function_name="func")
        res["export_to_c s"] = time.perf_counter() - t0
        torch.save({"kv": kv.cpu(), "score": score.cpu(), "ape": ape.cpu(), "cu": cu.cpu(), "cuc": cuc.cpu(),
                    "ref": out_fast.cpu()}, os.path.join(tmp, "in.pt"))  # fmt: skip
        child = f"""
import time, torch, cutlass.cute as cute
t0 = time.perf_counter(); f = cute.runtime.load_module({obj!r}, enable_tvm_ffi=True)["func"]; t1 = time.perf_counter()
d = torch.load({os.path.join(tmp, "in.pt")!r}); g = {{k: v.cuda() for k, v in d.items()}}
out = torch.empty_like(g["ref"])
f(g["kv"].data_ptr(), g["score"].data_ptr(), g["ape"].data_ptr(), g["cu"].data_ptr(), g["cuc"].data_ptr(), out.data_ptr(),
  g["cu"].shape[0] - 1, out.shape[0], torch.cuda.current_stream().cuda_stream)
torch.cuda.synchronize()
print("LOAD_S", t1 - t0, "EQUAL", torch.equal(out.view(torch.int16), g["ref"].view(torch.int16)))
"""
        r = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120)
        res["fresh process load"] = r.stdout.strip() or r.stderr.strip()[-800:]

    print(f"{'path':45s} {'b2b host':>9s} {'b2b wall':>9s} {'idle host':>9s} {'idle wall':>9s}")
    for k, v in res.items():
        if isinstance(v, dict):
            print(f"{k:45s} {v['b2b_host']:9.2f} {v['b2b_wall']:9.2f} {v['idle_host']:9.2f} {v['idle_wall']:9.2f}")
        else:
            print(f"{k:45s} {v}")
    with open(opts.out, "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
