"""GPU development script of the cute backend: compile, check numerics, time (one run does it all).

    python benchmarks/cute_dev.py [--quick] [--out DIR] [--only-time] [--skip-time]

1. numerics of every configuration against ``reference`` (precision="fp32": bf16 ulps and the
   fraction of bitwise-equal elements; fp64: dAPE rel-L2; "upstream" vs fp64 error bound on the
   forward) on ragged packs with padding rows, token padding, short segments and odd head_dims;
   NaN canaries (outputs start as NaN: every element must be written); run-to-run determinism;
   the fast launch path against the regular compiled-function call; a CUDA graph of fwd+bwd
   replayed with a smaller true row count; the compile-under-capture error.
2. timing of the SPEC section 6 cases: kernel time per call from torch.profiler (cold = 256 MB
   write before each call, warm = back to back), wall time of one call (CUDA events, idle device),
   host time of one call (perf_counter).

Prints a table and writes ``cute_dev.json`` under ``--out`` (default ``$OUT`` or ``.``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from csa_compressor import reference
from csa_compressor.backends.cute import launch
from csa_compressor.testing import bf16_ulp_distance, make_pack, rel_l2

SPEC = {  # case: (floor fwd, floor bwd, seed fwd cold, seed bwd cold)
    "1x8192-d128-r4-c2": (2.1, 4.1, 6.9, 17.1),
    "3x8192-d128-r4-c2": (6.3, 12.3, 14.3, 27.6),
    "1x8192-d512-r4-c2": (8.5, 16.4, 17.5, 29.6),
    "3x8192-d512-r4-c2": (25.4, 49.2, 43.3, 76.0),
    "1x8192-d128-r128-c1": (1.0, 2.0, 11.8, 12.7),
    "1x65536-d512-r128-c2": (63.9, 127.7, 98.1, 260.0),
    "3x8192-d512-r128-c1": (12.0, 24.0, 28.6, 57.1),
}

# (seqlens, head_dim, ratio, coff, token_padding, comp_padding)
CHECKS = [
    ((37, 4, 3, 64, 129, 8), 128, 4, 2, 5, 3),
    ((37, 4, 3, 64, 129, 8), 128, 4, 1, 0, 2),
    ((1000, 2, 333), 512, 4, 2, 7, 4),
    ((8192,), 512, 4, 2, 0, 0),
    ((515, 1, 1030, 127, 260), 512, 128, 1, 3, 2),
    ((515, 1, 1030, 127, 260), 128, 128, 2, 0, 3),
    ((700, 300, 2000), 512, 128, 2, 9, 1),
    ((33, 5, 64, 2), 128, 2, 1, 1, 2),
    ((33, 5, 64, 2), 128, 2, 2, 1, 2),
    ((81, 7, 40), 128, 8, 1, 2, 1),
    ((81, 7, 40), 64, 8, 2, 2, 1),
    ((37, 4, 64, 129), 65, 4, 2, 3, 2),
    ((37, 4, 64, 129), 36, 4, 1, 0, 1),
    ((300, 129), 100, 128, 1, 1, 1),
    ((41, 100, 7), 130, 16, 2, 2, 2),
    ((3, 2), 128, 4, 2, 4, 3),  # no segment reaches ratio: every real row is padding
]


def _mode(launcher):
    return "raw" if launcher.raw is not None else ("fast" if launcher.fast else "dsl")


def _ulp_stats(actual, expected):
    d = bf16_ulp_distance(actual, expected)
    return int(d.max()) if d.numel() else 0, float((d == 0).float().mean()) if d.numel() else 1.0


def check_one(seqlens, head_dim, ratio, coff, tp, cp, dev):
    pack = make_pack(seqlens, head_dim, ratio, coff, token_padding=tp, comp_padding=cp, device=dev, seed=7)
    kv, score, ape, cu, cuc = pack.inputs
    n = pack.total_comp
    rec = {"seqlens": list(seqlens), "head_dim": head_dim, "ratio": ratio, "coff": coff, "tp": tp, "cp": cp, "N": n}
    if n == 0:
        rec["skipped"] = "N == 0"
        return rec
    launch.compile("forward", ratio, coff, head_dim, torch.bfloat16, dev)
    launch.compile("backward", ratio, coff, head_dim, torch.bfloat16, dev)
    out = torch.full((n, head_dim), float("nan"), dtype=torch.bfloat16, device=dev)
    launch.forward(kv, score, ape, cu, cuc, out, ratio, coff, None)
    ref32 = reference.forward(kv, score, ape, cu, cuc, ratio=ratio, coff=coff, total_comp=n, precision="fp32")
    ref64 = reference.forward(kv, score, ape, cu, cuc, ratio=ratio, coff=coff, total_comp=n, precision="fp64")
    refup = reference.forward(kv, score, ape, cu, cuc, ratio=ratio, coff=coff, total_comp=n, precision="upstream")
    rec["fwd_ulp_max"], rec["fwd_bitwise"] = _ulp_stats(out, ref32)
    rec["fwd_err64"] = float((out.double() - ref64).abs().max())
    rec["upstream_err64"] = float((refup.double() - ref64).abs().max())
    rec["fwd_nan"] = bool(torch.isnan(out).any())
    out2 = torch.empty_like(out)
    launch.forward(kv, score, ape, cu, cuc, out2, ratio, coff, None)
    rec["fwd_deterministic"] = bool(torch.equal(out.view(torch.int16), out2.view(torch.int16)))

    g = pack.grad_out
    gkv = torch.full_like(kv, float("nan"))
    gsc = torch.full_like(score, float("nan"))
    gape = torch.full_like(ape, float("nan"))
    launch.backward(kv, score, ape, cu, cuc, g, gkv, gsc, gape, ratio, coff, None)
    rkv, rsc, rape = reference.backward(kv, score, ape, cu, cuc, g, ratio=ratio, coff=coff, precision="fp32")
    _, _, rape64 = reference.backward(kv, score, ape, cu, cuc, g, ratio=ratio, coff=coff, precision="fp64")
    rec["dkv_ulp_max"], rec["dkv_bitwise"] = _ulp_stats(gkv, rkv)
    rec["dsc_ulp_max"], rec["dsc_bitwise"] = _ulp_stats(gsc, rsc)
    rec["dape_rel_l2"] = rel_l2(gape, rape64)
    rec["dape_ref32_rel_l2"] = rel_l2(rape, rape64)
    rec["bwd_nan"] = bool(torch.isnan(gkv).any() or torch.isnan(gsc).any() or torch.isnan(gape).any())
    gkv2, gsc2, gape2 = torch.empty_like(gkv), torch.empty_like(gsc), torch.empty_like(gape)
    launch.backward(kv, score, ape, cu, cuc, g, gkv2, gsc2, gape2, ratio, coff, None)
    rec["bwd_deterministic"] = bool(
        torch.equal(gkv.view(torch.int16), gkv2.view(torch.int16))
        and torch.equal(gsc.view(torch.int16), gsc2.view(torch.int16))
        and torch.equal(gape.view(torch.int32), gape2.view(torch.int32))
    )
    # Regular compiled-function call path must agree bitwise with the fast path.
    lf = launch._FASTMAP[("forward", ratio, coff, head_dim, torch.bfloat16, dev.index)]
    lb = launch._FASTMAP[("backward", ratio, coff, head_dim, torch.bfloat16, dev.index)]
    rec["launch_mode"] = [_mode(lf), _mode(lb)]
    rec["raw_error"] = lf.raw_error or lb.raw_error
    rec["fast_error"] = lf.fast_error or lb.fast_error
    # The regular compiled-function call path must agree bitwise with the launch path in use.
    saved = (lf.raw, lf.fast, lb.raw, lb.fast)
    lf.raw = lb.raw = None
    lf.fast = lb.fast = False
    try:
        out3 = torch.empty_like(out)
        launch.forward(kv, score, ape, cu, cuc, out3, ratio, coff, None)
        gkv3, gsc3, gape3 = torch.empty_like(gkv), torch.empty_like(gsc), torch.empty_like(gape)
        launch.backward(kv, score, ape, cu, cuc, g, gkv3, gsc3, gape3, ratio, coff, None)
        rec["slow_path_equal"] = bool(
            torch.equal(out3.view(torch.int16), out.view(torch.int16))
            and torch.equal(gkv3.view(torch.int16), gkv.view(torch.int16))
            and torch.equal(gsc3.view(torch.int16), gsc.view(torch.int16))
            and torch.equal(gape3.view(torch.int32), gape.view(torch.int32))
        )
    finally:
        lf.raw, lf.fast, lb.raw, lb.fast = saved
    rec["ok"] = bool(
        rec["fwd_ulp_max"] <= 1
        and rec["dkv_ulp_max"] <= 1
        and rec["dsc_ulp_max"] <= 1
        and rec["dape_rel_l2"] <= 1e-5
        and not rec["fwd_nan"]
        and not rec["bwd_nan"]
        and rec["fwd_deterministic"]
        and rec["bwd_deterministic"]
    )
    return rec


def graph_check(dev):
    """Capture fwd+bwd once, replay on new data with a smaller true row count (static capacity)."""
    ratio, coff, d = 4, 2, 128
    big = make_pack((300, 41, 77), d, ratio, coff, token_padding=8, comp_padding=4, device=dev, seed=1)
    n, t = big.total_comp, big.kv.shape[0]
    kv, score, ape, cu, cuc = (x.clone() for x in big.inputs)
    g = big.grad_out.clone()
    out = torch.empty((n, d), dtype=torch.bfloat16, device=dev)
    gkv, gsc, gape = torch.empty_like(kv), torch.empty_like(score), torch.empty_like(ape)
    launch.compile("forward", ratio, coff, d, torch.bfloat16, dev)
    launch.compile("backward", ratio, coff, d, torch.bfloat16, dev)
    s = torch.cuda.Stream(dev)
    s.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(s):
        for _ in range(2):
            launch.forward(kv, score, ape, cu, cuc, out, ratio, coff, None)
            launch.backward(kv, score, ape, cu, cuc, g, gkv, gsc, gape, ratio, coff, None)
    torch.cuda.current_stream(dev).wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch.forward(kv, score, ape, cu, cuc, out, ratio, coff, None)
        launch.backward(kv, score, ape, cu, cuc, g, gkv, gsc, gape, ratio, coff, None)
    small = make_pack((100, 9, 50), d, ratio, coff, device=dev, seed=2)
    ts = small.kv.shape[0]
    kv.zero_()
    score.zero_()
    kv[:ts].copy_(small.kv)
    score[:ts].copy_(small.score)
    ape.copy_(small.ape)
    cu.copy_(small.cu_seqlens)
    cuc.copy_(small.cu_seqlens_comp)
    g.copy_(torch.randn(n, d, device=dev).to(torch.bfloat16))
    gkv.fill_(float("nan"))
    gsc.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize(dev)
    rf = reference.forward(kv, score, ape, cu, cuc, ratio=ratio, coff=coff, total_comp=n, precision="fp32")
    rkv, rsc, rape64 = reference.backward(kv, score, ape, cu, cuc, g, ratio=ratio, coff=coff, precision="fp32")
    _, _, rape64 = reference.backward(kv, score, ape, cu, cuc, g, ratio=ratio, coff=coff, precision="fp64")
    res = {
        "fwd_ulp": _ulp_stats(out, rf)[0],
        "dkv_ulp": _ulp_stats(gkv, rkv)[0],
        "dsc_ulp": _ulp_stats(gsc, rsc)[0],
        "dape_rel_l2": rel_l2(gape, rape64),
        "tokens": t,
    }
    # Compile under capture must raise a clear RuntimeError.
    try:
        g2 = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g2):
            launch.compile("forward", 4, 2, 72, torch.bfloat16, dev)
        res["capture_error"] = "no error raised"
    except RuntimeError as exc:
        res["capture_error"] = str(exc)[:160]
    return res


def _profile_kernel_us(fn, flush, reps):
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            if flush is not None:
                flush()
            fn()
        torch.cuda.synchronize()
    total = 0.0
    names: dict[str, float] = {}
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA and "cutlass" in evt.name:
            t = evt.device_time if hasattr(evt, "device_time") else evt.cuda_time
            total += t
            names[evt.name[:60]] = names.get(evt.name[:60], 0.0) + t / reps  # per-kernel us per call
    return total / reps, names


def _wall_us(fn, reps=50):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    walls, hosts = [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        time.sleep(0.0002)
        start.record()
        h0 = time.perf_counter()
        fn()
        h1 = time.perf_counter()
        end.record()
        torch.cuda.synchronize()
        walls.append(start.elapsed_time(end) * 1e3)
        hosts.append((h1 - h0) * 1e6)
    return statistics.median(walls), statistics.median(hosts)


def time_case(name, dev, reps, only=None):
    b, rest = name.split("x", 1)
    seqlen = int(rest.split("-")[0])
    d = int(name.split("-d")[1].split("-")[0])
    ratio = int(name.split("-r")[1].split("-")[0])
    coff = int(name.split("-c")[1])
    pack = make_pack((seqlen,) * int(b), d, ratio, coff, device=dev, seed=3)
    kv, score, ape, cu, cuc = pack.inputs
    n = pack.total_comp
    out = torch.empty((n, d), dtype=torch.bfloat16, device=dev)
    gkv, gsc, gape = torch.empty_like(kv), torch.empty_like(score), torch.empty_like(ape)
    g = pack.grad_out
    launch.compile("forward", ratio, coff, d, torch.bfloat16, dev)
    launch.compile("backward", ratio, coff, d, torch.bfloat16, dev)
    flush_buf = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.float32, device=dev)

    def flush():
        flush_buf.fill_(1.0)

    def fwd():
        launch.forward(kv, score, ape, cu, cuc, out, ratio, coff, None)

    def bwd():
        launch.backward(kv, score, ape, cu, cuc, g, gkv, gsc, gape, ratio, coff, None)

    rec = {"case": name}
    floor_f, floor_b, seed_f, seed_b = SPEC[name]
    runs = [("fwd", fwd, floor_f, seed_f), ("bwd", bwd, floor_b, seed_b)]
    if launch.supports_stats(ratio, coff, d):
        # The softmax-statistics pair (what autograd runs for long windows).
        stats = torch.empty((n, 3, d), dtype=torch.float32, device=dev)

        def fwd_st():
            launch.forward(kv, score, ape, cu, cuc, out, ratio, coff, None, stats)

        def bwd_st():
            launch.backward(kv, score, ape, cu, cuc, g, gkv, gsc, gape, ratio, coff, None, stats)

        fwd_st()
        runs += [("fwd_st", fwd_st, floor_f, seed_f), ("bwd_st", bwd_st, floor_b, seed_b)]
    for tag, fn, floor, seed in runs:
        if only is not None and tag != only:
            continue
        cold, names = _profile_kernel_us(fn, flush, reps)
        warm, _ = _profile_kernel_us(fn, None, reps)
        wall, host = _wall_us(fn) if only is None else (0.0, 0.0)
        rec[tag] = {
            "cold": cold,
            "warm": warm,
            "wall": wall,
            "host": host,
            "floor": floor,
            "seed": seed,
            "x_floor": cold / floor,
            "x_seed": cold / seed,
            "kernels": names,
        }
    if only is not None:
        return rec
    lb = launch._FASTMAP[("backward", ratio, coff, d, torch.bfloat16, dev.index)]
    rec["bwd_grid"] = [*launch.backward_grid(lb, n, ape.numel()), lb.nchunk, lb.ctas_per_sm]
    lf = launch._FASTMAP[("forward", ratio, coff, d, torch.bfloat16, dev.index)]
    rec["launcher"] = {
        "fwd": _mode(lf),
        "bwd": _mode(lb),
        "raw_error": lf.raw_error or lb.raw_error,
        "fast_error": lf.fast_error or lb.fast_error,
        "bwd_ctas_per_sm": lb.ctas_per_sm,
    }
    rec["schedules"] = {
        "fwd": launch._FASTMAP[("forward", ratio, coff, d, torch.bfloat16, dev.index)].sch.key(),
        "bwd": lb.sch.key(),
    }
    return rec


VARIANTS = {
    # case: [(direction, (V, TC, G, SG, R, NB, CM, MD[, LONG, PF, AS, ST, SC, EF])), ...]; "bwd_st"/"fwd_st": the
    # softmax-statistics variants (ST = 1; SC: window slots per CTA of backward_stats.py).
    "1x65536-d512-r128-c2": [
        ("bwd_st", (8, 8, 16, 2, 1, 1, 0, 0, 1, 0, 0, 1, 32)),
        ("bwd_st", (8, 8, 32, 2, 1, 1, 0, 0, 1, 0, 0, 1, 64)),
    ],
    "3x8192-d512-r128-c1": [
        ("bwd_st", (8, 8, 16, 2, 1, 1, 0, 0, 1, 0, 0, 1, 32)),
        ("bwd_st", (8, 8, 8, 2, 1, 1, 0, 0, 1, 0, 0, 1, 16)),
        ("fwd", (4, 16, 16, 8, 1, 1, 1, 0)),
    ],
}

# Ragged pack (seqlens, token padding, comp padding) on which every variant's numerics are checked.
VARIANT_PACK = ((700, 300, 2000, 5, 0, 257), 9, 2)


def variant_numerics(ratio, coff, d, direction, dev):
    from csa_compressor.testing import contract_report

    seqlens, tp, cp = VARIANT_PACK
    pack = make_pack(seqlens, d, ratio, coff, token_padding=tp, comp_padding=cp, device=dev, seed=11)
    kv, score, ape, cu, cuc = pack.inputs
    n = pack.total_comp
    if direction == "fwd":
        out = torch.full((n, d), float("nan"), dtype=torch.bfloat16, device=dev)
        launch.forward(kv, score, ape, cu, cuc, out, ratio, coff, None)
        rep = contract_report(pack, out=out)
    elif direction == "bwd_st":
        stats = reference.softmax_stats(kv, score, ape, cu, cuc, ratio=ratio, coff=coff, total_comp=n)
        gkv, gsc, gape = (torch.full_like(t, float("nan")) for t in (kv, score, ape))
        launch.backward(kv, score, ape, cu, cuc, pack.grad_out, gkv, gsc, gape, ratio, coff, None, stats)
        rep = contract_report(pack, grads=(gkv, gsc, gape))
    else:
        gkv, gsc, gape = (torch.full_like(t, float("nan")) for t in (kv, score, ape))
        launch.backward(kv, score, ape, cu, cuc, pack.grad_out, gkv, gsc, gape, ratio, coff, None)
        rep = contract_report(pack, grads=(gkv, gsc, gape))
    return {k: v for k, v in rep.items() if isinstance(v, (bool, int, float))}


def time_variants(name, dev, reps):
    from csa_compressor.backends.cute.forward import Schedule

    out = []
    ratio = int(name.split("-r")[1].split("-")[0])
    coff = int(name.split("-c")[1])
    d = int(name.split("-d")[1].split("-")[0])
    for direction, key in VARIANTS.get(name, []):
        full = {"fwd": "forward", "bwd": "backward", "bwd_st": "backward_stats", "fwd_st": "forward_stats"}[direction]
        extra = dict(zip(("NB", "CM", "MD", "LONG", "PF", "AS", "ST", "SC", "EF"), key[5:], strict=False))
        extra.update({k: bool(v) for k, v in extra.items() if k not in ("NB", "SC")})
        launch.SCHEDULE_OVERRIDE[(full, ratio, coff, d)] = Schedule(*key[:5], **extra)
        launch._FASTMAP.pop((full, ratio, coff, d, torch.bfloat16, dev.index), None)
        try:
            launch.compile(full, ratio, coff, d, torch.bfloat16, dev)
            num = variant_numerics(ratio, coff, d, direction, dev)
            lau = launch._get_launcher(full, ratio, coff, d, torch.bfloat16, dev)
            rec = time_case(name, dev, reps, only=direction)
            out.append(
                {
                    "case": name,
                    "dir": direction,
                    "schedule": key,
                    "cold": rec[direction]["cold"],
                    "warm": rec[direction]["warm"],
                    "ctas_per_sm": getattr(lau, "ctas_per_sm", None),
                    "numerics": num,
                }
            )
        except Exception as exc:
            out.append({"case": name, "dir": direction, "schedule": key, "error": f"{type(exc).__name__}: {exc}"})
        print(json.dumps(out[-1]), flush=True)
        launch.SCHEDULE_OVERRIDE.clear()
        launch._FASTMAP.pop((full, ratio, coff, d, torch.bfloat16, dev.index), None)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--skip-time", action="store_true")
    ap.add_argument("--only-time", action="store_true")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--variants", action="store_true")
    ap.add_argument("--cases", help="comma-separated SPEC case names to time (default: all)")
    args = ap.parse_args()
    dev = torch.device("cuda", torch.cuda.current_device())
    result = {"device": torch.cuda.get_device_name(dev), "checks": [], "timing": []}
    t_start = time.time()
    if not args.only_time:
        for cfg in CHECKS[:4] if args.quick else CHECKS:
            t0 = time.time()
            try:
                rec = check_one(*cfg, dev)
            except Exception as exc:
                rec = {"cfg": repr(cfg), "error": f"{type(exc).__name__}: {exc}", "tb": traceback.format_exc()[-1500:]}
            rec["seconds"] = round(time.time() - t0, 2)
            result["checks"].append(rec)
            print(json.dumps(rec), flush=True)
        try:
            result["graph"] = graph_check(dev)
        except Exception as exc:
            result["graph"] = {"error": f"{type(exc).__name__}: {exc}", "tb": traceback.format_exc()[-1500:]}
        print("graph", json.dumps(result["graph"]), flush=True)
    if not args.skip_time:
        for name in SPEC:
            if args.cases and name not in args.cases.split(","):
                continue
            try:
                rec = time_case(name, dev, args.reps)
            except Exception as exc:
                rec = {"case": name, "error": f"{type(exc).__name__}: {exc}", "tb": traceback.format_exc()[-1500:]}
            result["timing"].append(rec)
            print(json.dumps(rec), flush=True)
    if args.variants:
        result["variants"] = []
        for name in VARIANTS:
            if args.cases and name not in args.cases.split(","):
                continue
            result["variants"] += time_variants(name, dev, max(5, args.reps // 2))
    result["seconds"] = time.time() - t_start
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "cute_dev.json"), "w") as f:
        json.dump(result, f, indent=1)
    print("\n| case | dir | floor | cold | warm | wall | host | x floor | x seed |")
    print("|---|---|---|---|---|---|---|---|---|")
    for rec in result["timing"]:
        for tag in ("fwd", "bwd", "fwd_st", "bwd_st"):
            if tag in rec:
                r = rec[tag]
                print(
                    f"| {rec['case']} | {tag} | {r['floor']} | {r['cold']:.1f} | {r['warm']:.1f} | {r['wall']:.1f} | "
                    f"{r['host']:.1f} | {r['x_floor']:.2f} | {r['x_seed']:.2f} |"
                )
    bad = [c for c in result["checks"] if not c.get("ok", "skipped" in c)]
    print(f"checks: {len(result['checks']) - len(bad)}/{len(result['checks'])} ok")


if __name__ == "__main__":
    main()
