"""GPU timing sweep of the Triton backend's tile configurations on the SPEC section 6 cases.

For every case and direction it times each candidate ``KernelConfig`` (plus the
default that ``launch.choose_config`` picks), L2 cold: a CUDA graph of one call
is replayed after a 256 MiB flush, CUDA events around the replay, median of
``--iters``. It also checks every configuration against the fp32 reference
(max bf16 ulp, count of non-bitwise elements) and dAPE against fp64, and prints
kernel us, floor us (SPEC 6: bytes that must move / 4.22 TB/s) and their ratio.

Kernels are JIT-built first in parallel worker processes (Triton's disk cache),
so the timing loop only loads them.

    python3 benchmarks/triton_sweep.py --out results/ [--quick] [--cases 3x8192_d512_r4_c2,...]

Long windows (ratio 128: the ``*_long_kernel``s), the three r128 cases, <= 12 tiles per direction and case
(block_d x num_warps x slots per thread, rows per program), about 2-3 minutes on one H200 with the build:

    python3 benchmarks/triton_sweep.py --cases r128 --out $OUT

``--cases`` takes case names, or ``r4`` / ``r128`` for every case of that ratio. Each row of the table has the
kernel us (write flush), the floor, max bf16 ulp / non-bitwise count vs the fp32 reference and dAPE rel-L2 vs
fp64, and ``ok`` from ``csa_compressor.testing.contract_report`` (SPEC 3); ``*`` marks ``choose_config``'s pick.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import json
import multiprocessing as mp
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from csa_compressor import reference
from csa_compressor.backends.triton import launch
from csa_compressor.backends.triton.launch import KernelConfig
from csa_compressor.testing import contract_report, make_pack

COPY_RATE = 4.22e12  # bytes/s, SPEC section 6
# (name, sequences, seqlen, head_dim, ratio, coff)
CASES = [
    ("1x8192_d128_r4_c2", 1, 8192, 128, 4, 2),
    ("3x8192_d128_r4_c2", 3, 8192, 128, 4, 2),
    ("1x8192_d512_r4_c2", 1, 8192, 512, 4, 2),
    ("3x8192_d512_r4_c2", 3, 8192, 512, 4, 2),
    ("1x8192_d128_r128_c1", 1, 8192, 128, 128, 1),
    ("1x65536_d512_r128_c2", 1, 65536, 512, 128, 2),
    ("3x8192_d512_r128_c1", 3, 8192, 512, 128, 1),
]


def floor_us(direction, tokens, n_rows, head_dim, coff) -> float:
    width = coff * head_dim
    if direction == "forward":
        nbytes = 2 * tokens * width * 2 + n_rows * head_dim * 2
    else:
        nbytes = 4 * tokens * width * 2 + n_rows * head_dim * 2
    return nbytes / COPY_RATE * 1e6


def long_candidates(direction, ratio, coff, head_dim, quick=False):
    """Long-window tiles (<= 12): forward (block_d, num_warps, slots_per_thread, rows_per_prog, prefetch_depth), backward
    (block_d, num_warps, rows_per_prog; 0 = from the problem size) at 16 or 32 window elements per thread."""
    k = coff * launch._pow2(ratio)
    d2 = launch._pow2(head_dim)
    default = launch.choose_config(direction, ratio, coff, head_dim, interpret=False)
    if direction == "forward":
        # (block_d, num_warps, slots per thread, rows per program, chunks in flight[, vector width])
        if head_dim <= 128:
            # Small problems: fewer window elements per thread (8-byte vectors, whole-window chunks, more warps).
            tiles = [(16, 4, 2, 1, 1), (16, 4, 4, 1, 1, 4), (32, 4, 2, 1, 1, 4), (32, 4, 2, 1, 2, 4),
                     (32, 4, 4, 1, 1, 4), (16, 2, 4, 1, 1, 4), (32, 4, 2, 1, 1), (16, 8, 2, 1, 1),
                     (8, 4, 4, 1, 1, 4), (64, 4, 2, 1, 2, 4), (32, 2, 2, 1, 2)]  # fmt: skip
        else:
            # Depth 2 keeps two chunks of a row in flight (the 1-warp tiles are under one wave at r128 c1: their
            # bytes in flight per SM are what they prefetch); the rest are the best depth-1 tiles of earlier sweeps.
            tiles = [(64, 1, 2, 1, 2), (128, 1, 2, 1, 2), (128, 2, 2, 1, 2), (64, 1, 1, 1, 2), (32, 1, 2, 1, 2),
                     (64, 2, 2, 1, 2), (128, 1, 4, 1, 2), (128, 1, 4, 1, 1), (128, 2, 2, 1, 1), (64, 1, 4, 1, 1),
                     (64, 1, 2, 1, 1)]  # fmt: skip
        out = [
            dataclasses.replace(
                default,
                block_d=min(t[0], d2),
                num_warps=t[1],
                slots_per_thread=t[2],
                rows_per_prog=t[3],
                prefetch_depth=t[4],
                vec=t[5] if len(t) > 5 else default.vec,
            )
            for t in tiles
        ]
    else:
        tiles = []
        for nw in (4, 8):
            for per_thread in (32, 16):
                bd = 32 * nw * per_thread // k
                if 8 <= bd <= d2:
                    tiles.append((bd, nw))
        out = []
        for bd, nw in tiles:
            for rows in (0, -2) if (bd, nw) != (default.block_d, default.num_warps) else (0, -2, 2, 4):
                out.append(dataclasses.replace(default, block_d=bd, num_warps=nw, rows_per_prog=rows))
    out = [default] + [c for c in out if c != default]
    return out[: 3 if quick else 12]


def candidates(direction, ratio, coff, head_dim, quick=False):
    """Tile candidates x exact/approximate exp x ``rows_per_prog`` (runtime-only: no recompilation)."""
    k = coff * launch._pow2(ratio)
    d2 = launch._pow2(head_dim)
    default = launch.choose_config(direction, ratio, coff, head_dim, interpret=False)
    if k > 16:
        return long_candidates(direction, ratio, coff, head_dim, quick)
    tiles = []
    if k <= 16:
        vec = min(8, 32 // k)
        for bd, nw in ((32 * vec, 1), (16 * vec, 1), (32 * vec, 2), (16 * vec, 2)):
            bd = min(bd, d2)
            tiles.append((max(1, (32 * vec) // bd) * nw, bd, nw, vec))
    else:
        for bd, vec in ((16, 4), (32, 8), (32, 4)):
            bd = min(bd, d2)
            for nw in (2, 4, 8):
                per_thread = k * bd // (32 * nw)
                if 16 <= per_thread <= 32:
                    tiles.append((1, bd, nw, vec))
    if quick:
        tiles = tiles[:2]
    out = {default}
    for br, bd, nw, vec in dict.fromkeys(tiles):
        if direction == "forward":
            rows_options = [br * m for m in ((2, 4, 8, 16) if k <= 16 else (1, 2, 4, 8))]
        elif k <= 16:
            rows_options = [max(br, r) for r in (8, 16, 32, 64)]
        else:
            rows_options = [4, 8, 16, 32]
        for precise in (True, False):
            for rows in rows_options:
                out.add(
                    dataclasses.replace(
                        default,
                        block_r=br,
                        block_d=bd,
                        num_warps=nw,
                        vec=vec,
                        rows_per_prog=rows,
                        precise_exp=precise,
                    )
                )
    return sorted(out, key=dataclasses.astuple)


def _compile_key(cfg: KernelConfig):
    return dataclasses.replace(cfg, rows_per_prog=cfg.block_r)


def _resolve(cfg: KernelConfig, direction, n_rows, head_dim, device, k):
    """``rows_per_prog = -2``: twice the rows the launcher picks for a long-window backward (half the programs)."""
    if cfg.rows_per_prog >= 0:
        return cfg
    auto = launch._long_rows(
        dataclasses.replace(cfg, rows_per_prog=0), direction, n_rows, -(-head_dim // cfg.block_d), device
    )
    return dataclasses.replace(cfg, rows_per_prog=-cfg.rows_per_prog * auto)


def _compile_job(job):
    """Worker: build one (direction, ratio, coff, head_dim, tiles) on a tiny problem of the same specialisation."""
    direction, ratio, coff, head_dim, cfg = job
    device = torch.device("cuda")
    t = time.time()
    try:
        width = coff * head_dim
        tokens = 2 * ratio
        kv = torch.zeros((tokens, width), dtype=torch.bfloat16, device=device)
        ape = torch.zeros((ratio, width), dtype=torch.float32, device=device)
        cu = torch.tensor([0, tokens], dtype=torch.int32, device=device)
        cu_comp = torch.tensor([0, 2], dtype=torch.int32, device=device)
        if direction == "forward":
            out = torch.empty((2, head_dim), dtype=torch.bfloat16, device=device)
            launch.launch_forward(kv, kv.clone(), ape, cu, cu_comp, out, ratio, coff, cfg)
        else:
            g = torch.zeros((2, head_dim), dtype=torch.bfloat16, device=device)
            grads = torch.empty_like(kv), torch.empty_like(kv), torch.empty_like(ape)
            launch.launch_backward(kv, kv.clone(), ape, cu, cu_comp, g, *grads, ratio, coff, cfg)
        torch.cuda.synchronize()
        return None, time.time() - t
    except Exception as exc:  # report, keep sweeping
        return f"{job}: {type(exc).__name__}: {exc}", time.time() - t


def _ordered(x):
    bits = x.contiguous().view(torch.int16).to(torch.int32)
    return torch.where(bits < 0, -(bits & 0x7FFF), bits)


def ulp_stats(actual, expected):
    dist = (_ordered(actual) - _ordered(expected)).abs()
    nan_a, nan_e = torch.isnan(actual), torch.isnan(expected)
    dist = torch.where(nan_a & nan_e, torch.zeros_like(dist), dist)
    dist = torch.where(nan_a ^ nan_e, torch.full_like(dist, 1 << 20), dist)
    return int(dist.max()), int((dist != 0).sum())


def rel_l2(a, e):
    a, e = a.double(), e.double()
    return float(torch.linalg.vector_norm(a - e) / torch.linalg.vector_norm(e))


class ProfilerTimer:
    """The project bench's method (``csa_compressor.bench``): sum of the profiler's kernel durations per call after
    an L2 flush, with no launch latency in it (graph replay timed by events adds ~5 us at the small cases)."""

    def __init__(self, iters, flush_mode="write"):
        from csa_compressor.bench import _Timer

        self.iters = iters
        self.flush_mode = flush_mode
        self.timer = _Timer(torch.device("cuda", torch.cuda.current_device()), (iters, iters, 1))

    def time_us(self, fn):
        fn()
        for _attempt in range(3):  # a profiler session can lose device records (flush > total)
            try:
                return self.timer.kernel_us(fn, self.iters, cold=True, clean=self.flush_mode == "read")
            except (RuntimeError, ValueError) as exc:
                err = exc
        raise err


class Timer:
    def __init__(self, iters, flush_mode="write"):
        self.iters = iters
        self.flush_mode = flush_mode
        self.buf = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        self.sink = torch.empty((), dtype=torch.int64, device="cuda")

    def flush(self):
        if self.flush_mode == "write":
            self.buf.fill_(1)
        else:
            torch.sum(self.buf.view(torch.int64), dim=0, out=self.sink)

    def time_us(self, fn):
        fn()  # eager once (loads the module)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            with torch.cuda.graph(graph, stream=stream):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        events = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(self.iters)
        ]
        for start, stop in events:
            self.flush()
            start.record()
            graph.replay()
            stop.record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) * 1e3 for s, e in events)


def run_case(case, timer, quick, log, directions=("forward", "backward"), use_stats=False):
    name, seqs, seqlen, head_dim, ratio, coff = case
    long = coff * launch._pow2(ratio) > 16
    # The full SPEC 3 contract check (fp64 oracle, CPU comparisons: seconds per call) for the default tile of the
    # long-window cases; every candidate gets the on-device ulp / rel-L2 figures.
    check_contract = long
    pack = make_pack([seqlen] * seqs, head_dim, ratio, coff, device="cuda", seed=1)
    tokens, n_rows = pack.kv.shape[0], pack.total_comp
    kw = dict(ratio=ratio, coff=coff)
    ref_out = reference.forward(*pack.inputs, total_comp=n_rows, precision="fp32", **kw)
    ref_kv, ref_score, _ = reference.backward(*pack.inputs, pack.grad_out, precision="fp32", **kw)
    _, _, ape64 = reference.backward(*pack.inputs, pack.grad_out, precision="fp64", **kw)
    # Softmax statistics (long windows, as autograd runs them): the forward writes them, the backward reads the
    # reference's.
    stats_buf = torch.empty((n_rows, 3, head_dim), dtype=torch.float32, device="cuda") if use_stats and long else None
    stats_ref = reference.softmax_stats(*pack.inputs, total_comp=n_rows, **kw) if stats_buf is not None else None
    results = []
    for direction in directions:
        fl = floor_us(direction, tokens, n_rows, head_dim, coff)
        default = launch.choose_config(direction, ratio, coff, head_dim, interpret=False)

        def make_fn(cfg, direction=direction):
            if direction == "forward":
                out = torch.empty_like(ref_out)

                def call():
                    launch.launch_forward(*pack.inputs, out, ratio, coff, cfg, stats_buf)

                return call, out, None
            grads = torch.empty_like(pack.kv), torch.empty_like(pack.score), torch.empty_like(pack.ape)

            def call():
                launch.launch_backward(*pack.inputs, pack.grad_out, *grads, ratio, coff, cfg, stats_ref)

            return call, None, grads

        first = len(results)
        for cand in candidates(direction, ratio, coff, head_dim, quick):
            cfg = _resolve(cand, direction, n_rows, head_dim, pack.kv.device, coff * launch._pow2(ratio))
            fn, out, grads = make_fn(cfg)
            try:
                us = timer.time_us(fn)
            except Exception as exc:
                log(f"  FAILED {name} {direction} {cfg}: {type(exc).__name__}: {exc}")
                continue
            if direction == "forward":
                out.fill_(float("nan"))
                fn()
                check = {"out": ulp_stats(out, ref_out)}
                if check_contract and cand == default:
                    check["ok"] = bool(contract_report(pack, out=out)["ok"])
            else:
                for g in grads:
                    g.fill_(float("nan"))
                fn()
                check = {
                    "grad_kv": ulp_stats(grads[0], ref_kv),
                    "grad_score": ulp_stats(grads[1], ref_score),
                    "dape_rel_l2": rel_l2(grads[2], ape64),
                }
                if check_contract and cand == default:
                    check["ok"] = bool(contract_report(pack, grads=grads)["ok"])
            row = dict(
                case=name,
                direction=direction,
                config=dataclasses.asdict(cfg),
                default=cand == default,
                kernel_us=round(us, 2),
                floor_us=round(fl, 2),
                ratio_to_floor=round(us / fl, 3),
                check=check,
            )
            results.append(row)
            log(
                f"  {name:22s} {direction:8s} {'*' if row['default'] else ' '} br={cfg.block_r:2d} bd={cfg.block_d:3d} "
                f"nw={cfg.num_warps} vec={cfg.vec} rows={cfg.rows_per_prog:3d} "
                + (
                    f"cs={cfg.slots_per_thread} p={cfg.prefetch_depth} "
                    if long
                    else f"exact_exp={int(cfg.precise_exp)} "
                )
                + f"{us:8.2f} us  floor {fl:7.2f}  x{us / fl:5.2f}  {check}"
            )
        # The write flush leaves L2 full of dirty lines that the timed kernel pays to write back; time the best
        # and the default also after a read-only flush (clean L2) to separate that from the kernel.
        rows = results[first:]
        if rows:
            picks = [min(rows, key=lambda r: r["kernel_us"])] + [r for r in rows if r["default"]]
            mode = timer.flush_mode
            timer.flush_mode = "read" if mode == "write" else "write"
            for row in picks:
                us = timer.time_us(make_fn(KernelConfig(**row["config"]))[0])
                row[f"kernel_us_{timer.flush_mode}_flush"] = round(us, 2)
                log(f"  {name:22s} {direction:8s} {timer.flush_mode}-flush {us:8.2f} us for {row['config']}")
            timer.flush_mode = mode
    torch.cuda.empty_cache()
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--cases", default="all")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--workers", type=int, default=max(1, min(14, (os.cpu_count() or 2) - 2)))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--directions", default="forward,backward")
    parser.add_argument("--flush", choices=("write", "read"), default="write")
    parser.add_argument(
        "--timer", choices=("graph", "profiler"), default="graph", help="profiler: the bench's kernel-time method"
    )
    parser.add_argument("--stats", action="store_true", help="long windows: with softmax statistics, as autograd")
    parser.add_argument("--compile-only", action="store_true", help="only JIT-build the candidates (disk cache)")
    parser.add_argument("--no-compile", action="store_true", help="skip the parallel build step")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("triton_sweep: needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.cases in ("all", "r4", "r128"):
        cases = [c for c in CASES if args.cases == "all" or c[0].endswith(f"_{args.cases}_c{c[5]}")]
    else:
        cases = [c for c in CASES if c[0] in args.cases.split(",")]
    os.makedirs(args.out, exist_ok=True)
    log_path = os.path.join(args.out, "triton_sweep_compile.log" if args.compile_only else "triton_sweep.log")
    log_file = open(log_path, "w")

    def log(msg):
        print(msg, flush=True)
        log_file.write(msg + "\n")
        log_file.flush()

    t0 = time.time()
    jobs = {}
    for _, _, _, head_dim, ratio, coff in cases:
        for direction in args.directions.split(","):
            for cfg in candidates(direction, ratio, coff, head_dim, args.quick):
                jobs[(direction, ratio, coff, head_dim, _compile_key(cfg))] = None
    if not args.no_compile:
        log(f"compiling {len(jobs)} kernels with {args.workers} workers")
        with cf.ProcessPoolExecutor(args.workers, mp_context=mp.get_context("spawn")) as pool:
            for err, _ in pool.map(_compile_job, list(jobs)):
                if err:
                    log(f"  compile error: {err}")
        log(f"compiled in {time.time() - t0:.1f} s")
    if args.compile_only:
        return 0

    timer = (ProfilerTimer if args.timer == "profiler" else Timer)(args.iters, args.flush)
    results = []
    for case in cases:
        results += run_case(case, timer, args.quick, log, args.directions.split(","), args.stats)
    best = {}
    for row in results:
        key = (row["case"], row["direction"])
        if key not in best or row["kernel_us"] < best[key]["kernel_us"]:
            best[key] = row
    log("\nbest per case (kernel us / floor us / ratio) and the default config:")
    for (case, direction), row in best.items():
        dflt = [r for r in results if r["case"] == case and r["direction"] == direction and r["default"]]
        d_us = dflt[0]["kernel_us"] if dflt else float("nan")
        other = [k for k in row if k.startswith("kernel_us_")]
        alt = f" ({other[0]} {row[other[0]]:.2f})" if other else ""
        log(
            f"  {case:22s} {direction:8s} best {row['kernel_us']:8.2f}{alt} floor {row['floor_us']:7.2f} "
            f"x{row['ratio_to_floor']:5.2f}  default {d_us:8.2f}  best cfg {row['config']}"
        )
    with open(os.path.join(args.out, "triton_sweep.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "flush": args.flush, "results": results}, f, indent=1)
    log(f"total {time.time() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
