"""Tuning sweep of the Triton backend's tiles on the bench's cases, timed by the bench's timer.

    python benchmarks/triton_sweep.py [--cases r4|r128|NAME,...] [--directions forward,backward] [--quick] [--out DIR]
    python benchmarks/triton_sweep.py --stats [--cases r128]      # the softmax-statistics backward's tiles
    python benchmarks/triton_sweep.py --tail [--cases r4]         # the short windows' whole-row tiles with the tail

Default mode: for every case and direction, each candidate ``KernelConfig`` (and the default the backend picks)
is built first in parallel worker processes (Triton's disk cache), then launched directly with that config and
timed cold and warm (``csa_compressor.bench.Timer``), with its numerics beside it: max bf16 ulp and the count of
non-bitwise elements against the fp32 reference, dAPE rel-L2 against fp64, and the full contract for the default.
``--stats``: the statistics backward (long windows) with the default tile and candidates, against the backward
without statistics. ``--tail``: the short windows' forward and backward with DeepSeek-V4's tail (fp32 norm, 64
rotary columns), whole-row tiles (``config.whole_rows``'s shape at other warps and vector widths), numerics against
the tail's fp32 reference and the default against the tail's contract. Prints one line per candidate and the best
per case; writes ``triton_sweep.json`` to --out.

The sweep drives the backend below its public API, through the few names of ``backends.triton.launch`` used in
``_Backend`` (configs, their launches, the statistics tile): the one place to follow when those move.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import json
import multiprocessing as mp
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from csa_compressor import reference
from csa_compressor.bench import CASES, Timer, floor_us
from csa_compressor.testing import bf16_ulp_distance, contract_report, make_pack, rel_l2


class _Backend:
    """The Triton launch module's names the sweep uses."""

    def __init__(self):
        from csa_compressor.backends.triton import launch

        self.launch = launch
        self.KernelConfig = launch.KernelConfig

    def default(self, direction, ratio, coff, head_dim):
        return self.launch.choose_config(direction, ratio, coff, head_dim, interpret=False)

    def forward(self, pack, out, cfg, stats=None):
        self.launch.launch_forward(*pack.inputs, out, pack.ratio, pack.coff, cfg, stats)

    def backward(self, pack, grads, cfg, stats=None):
        self.launch.launch_backward(*pack.inputs, pack.grad_out, *grads, pack.ratio, pack.coff, cfg, stats)

    def forward_with_stats(self, pack, out, stats):
        """The default forward, filling the softmax statistics (as autograd's forward does)."""
        self.launch.forward(*pack.inputs, out, pack.ratio, pack.coff, None, stats)

    def default_backward(self, pack, grads, stats=None):
        self.launch.backward(*pack.inputs, pack.grad_out, *grads, pack.ratio, pack.coff, None, stats)

    def stats_backward(self, pack, grads, stats, tile):
        """The backward with statistics at ``tile`` (None: the default), as autograd runs it."""
        if tile is not None:
            tile = self.launch.StatsTile(*tile)
        self.launch.launch_backward(*pack.inputs, pack.grad_out, *grads, pack.ratio, pack.coff, None, stats, tile)

    def pow2(self, n):
        from csa_compressor.backends.triton.config import pow2

        return pow2(n)

    def tail_default(self, direction, ratio, coff, head_dim):
        return self.launch.whole_rows(self.default(direction, ratio, coff, head_dim), head_dim)

    def tail_forward(self, pack, out, cfg, tail, rstd):
        """The forward with ``tail`` at tile ``cfg``, writing the rows' rstd into ``rstd``."""
        self.launch.launch_forward(*pack.inputs, out, pack.ratio, pack.coff, cfg, tail=tail, rstd=rstd)

    def tail_backward(self, pack, grads, cfg, tail, rstd):
        """The backward with ``tail`` at tile ``cfg`` from the forward's ``rstd``; ``grads`` ends with the norm
        weight's."""
        self.launch.launch_backward(*pack.inputs, pack.grad_out, *grads[:3], pack.ratio, pack.coff, cfg, tail=tail,
                                    grad_norm_weight=grads[3], rstd=rstd)  # fmt: skip


# ---------------------------------------------------------------------------------------------- candidates


def _long_tiles(direction, head_dim):
    """Long-window tiles. Forward: (block_d, num_warps, slots per thread, rows per program, chunks in flight[,
    vector width]); backward: (block_d, num_warps) at 16 or 32 window elements per thread."""
    if direction == "forward" and head_dim <= 128:
        return [(16, 4, 2, 1, 1), (16, 4, 4, 1, 1, 4), (32, 4, 2, 1, 1, 4), (32, 4, 2, 1, 2, 4), (32, 4, 4, 1, 1, 4),
                (16, 2, 4, 1, 1, 4), (32, 4, 2, 1, 1), (16, 8, 2, 1, 1), (8, 4, 4, 1, 1, 4), (64, 4, 2, 1, 2, 4)]  # fmt: skip
    if direction == "forward":
        return [(64, 1, 2, 1, 2), (128, 1, 2, 1, 2), (128, 2, 2, 1, 2), (64, 1, 1, 1, 2), (32, 1, 2, 1, 2),
                (64, 2, 2, 1, 2), (128, 1, 4, 1, 2), (128, 1, 4, 1, 1), (128, 2, 2, 1, 1), (64, 1, 4, 1, 1)]  # fmt: skip
    return [(bd, nw) for nw in (4, 8) for bd in (32 * nw * 32, 32 * nw * 16)]


def long_candidates(backend, direction, ratio, coff, head_dim):
    default = backend.default(direction, ratio, coff, head_dim)
    k, d2 = coff * backend.pow2(ratio), backend.pow2(head_dim)
    out = []
    for t in _long_tiles(direction, head_dim):
        if direction == "forward":
            vec = t[5] if len(t) > 5 else default.vec
            fields = dict(block_d=min(t[0], d2), num_warps=t[1], slots_per_thread=t[2], rows_per_prog=t[3])
            out.append(dataclasses.replace(default, prefetch_depth=t[4], vec=vec, **fields))
        elif 8 <= t[0] // k <= d2:
            out += [dataclasses.replace(default, block_d=t[0] // k, num_warps=t[1], rows_per_prog=r) for r in (0, 4)]
    return [default] + [c for c in dict.fromkeys(out) if c != default]


def short_candidates(backend, direction, ratio, coff, head_dim):
    """Short windows: tiles x exact / approximate exp x rows per program (a runtime argument: no new build)."""
    default = backend.default(direction, ratio, coff, head_dim)
    k, d2 = coff * backend.pow2(ratio), backend.pow2(head_dim)
    vec = min(8, 32 // k)
    out = {default}
    for bd, nw in ((32 * vec, 1), (16 * vec, 1), (32 * vec, 2), (16 * vec, 2)):
        bd = min(bd, d2)
        br = max(1, (32 * vec) // bd) * nw
        rows = [br * m for m in (2, 4, 8, 16)] if direction == "forward" else [max(br, r) for r in (8, 16, 32, 64)]
        for precise in (True, False):
            for r in rows:
                fields = dict(block_r=br, block_d=bd, num_warps=nw, vec=vec, rows_per_prog=r, precise_exp=precise)
                out.add(dataclasses.replace(default, **fields))
    return [default, *sorted(out - {default}, key=dataclasses.astuple)]


def tail_candidates(backend, direction, ratio, coff, head_dim):
    """Short windows with the tail: whole rows (``block_d`` covers head_dim) of 1 to 16 warps and 2- to 8-column
    vectors (at most 32 window elements per thread, at most 4 rows per tile), several rows per program."""
    default = backend.tail_default(direction, ratio, coff, head_dim)
    k, d2 = coff * backend.pow2(ratio), backend.pow2(head_dim)
    out = {default}
    for vec in (2, 4, 8):
        for nw in (1, 2, 4, 8, 16):
            lanes = 32 * nw * vec
            if k * vec > 32 or lanes < d2 or lanes > 4 * d2:
                continue
            br = lanes // d2
            rows = [br, 2 * br, 4 * br] if direction == "forward" else [max(br, r) for r in (8, 16, 32)]
            for r in rows:
                out.add(dataclasses.replace(default, block_r=br, block_d=d2, num_warps=nw, vec=vec, rows_per_prog=r))
    return [default, *sorted(out - {default}, key=dataclasses.astuple)]


def candidates(backend, direction, ratio, coff, head_dim, quick=False):
    long = coff * backend.pow2(ratio) > 16
    make = long_candidates if long else short_candidates
    found = make(backend, direction, ratio, coff, head_dim)
    return found[: 3 if quick else 12] if long else found[: 6 if quick else len(found)]


# ---------------------------------------------------------------------------------------------- build, time, check


def _build_job(job):
    """Worker: build one (direction, config) on a tiny problem of the same specialisation."""
    direction, ratio, coff, head_dim, cfg = job
    t0 = time.time()
    try:
        pack = make_pack((2 * ratio,), head_dim, ratio, coff, device="cuda", seed=0)
        backend = _Backend()
        if direction == "forward":
            backend.forward(pack, torch.empty(pack.total_comp, head_dim, dtype=torch.bfloat16, device="cuda"), cfg)
        else:
            backend.backward(pack, [torch.empty_like(t) for t in (pack.kv, pack.score, pack.ape)], cfg)
        torch.cuda.synchronize()
        return None, time.time() - t0
    except Exception as exc:  # reported; the sweep goes on
        return f"{job}: {type(exc).__name__}: {exc}", time.time() - t0


def build_all(jobs, workers, log) -> None:
    log(f"building {len(jobs)} kernels with {workers} workers")
    t0 = time.time()
    with cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
        for err, _ in pool.map(_build_job, jobs):
            if err:
                log(f"  build error: {err}")
    log(f"built in {time.time() - t0:.1f} s")


def _ulps(actual, expected) -> tuple[int, int]:
    d = bf16_ulp_distance(actual, expected)
    return (int(d.max()), int((d != 0).sum())) if d.numel() else (0, 0)


def time_and_check(timer, fn, outputs, refs, reps, contract=None) -> dict:
    """Cold and warm kernel us of ``fn``, then its outputs (NaN first: every element must be written) against
    ``refs``: ulps for bf16 tensors, rel-L2 for the fp32 dAPE; ``contract(outputs)`` for the full check."""
    fn()
    cold = timer.kernel(fn, reps, cold=True).us
    warm = timer.kernel(fn, reps, cold=False).us
    for t in outputs:
        t.fill_(float("nan"))
    fn()
    check = {}
    for name, actual, expected in zip(("out_or_dkv", "dscore", "dape"), outputs, refs, strict=False):
        check[name] = _ulps(actual, expected) if actual.dtype == torch.bfloat16 else rel_l2(actual, expected)
    if contract is not None:
        check["ok"] = bool(contract(outputs))
    return dict(cold_us=round(cold, 2), warm_us=round(warm, 2), check=check)


# ---------------------------------------------------------------------------------------------- the two modes


def _references(pack):
    kw = dict(ratio=pack.ratio, coff=pack.coff)
    out = reference.forward(*pack.inputs, total_comp=pack.total_comp, precision="fp32", **kw)
    dkv, dscore, _ = reference.backward(*pack.inputs, pack.grad_out, precision="fp32", **kw)
    _, _, dape64 = reference.backward(*pack.inputs, pack.grad_out, precision="fp64", **kw)
    return out, (dkv, dscore, dape64)


def sweep_case(backend, timer, rate, case, directions, quick, reps, log) -> list[dict]:
    """Every candidate of one case and direction: time and numerics; the default also against the contract."""
    pack = make_pack(case.seqlens, case.head_dim, case.ratio, case.coff, device="cuda", seed=1)
    ref_out, ref_grads = _references(pack)
    rows = []
    for direction in directions:
        bench_dir = "fwd" if direction == "forward" else "bwd"
        floor = floor_us(case, bench_dir, rate)
        default = backend.default(direction, case.ratio, case.coff, case.head_dim)
        for cfg in candidates(backend, direction, case.ratio, case.coff, case.head_dim, quick):
            if direction == "forward":
                outputs = [torch.empty_like(ref_out)]
                fn, refs = (lambda cfg=cfg, o=outputs: backend.forward(pack, o[0], cfg)), [ref_out]
                contract = (lambda o: contract_report(pack, out=o[0])["ok"]) if cfg == default else None
            else:
                outputs = [torch.empty_like(t) for t in (pack.kv, pack.score, pack.ape)]
                fn, refs = (lambda cfg=cfg, g=outputs: backend.backward(pack, g, cfg)), ref_grads
                contract = (lambda g: contract_report(pack, grads=tuple(g))["ok"]) if cfg == default else None
            try:
                row = time_and_check(timer, fn, outputs, refs, reps, contract)
            except Exception as exc:  # a tile may not build or fit: report, go on
                log(f"  FAILED {case.name} {direction} {cfg}: {type(exc).__name__}: {exc}")
                continue
            row.update(case=case.name, direction=direction, default=cfg == default, config=dataclasses.asdict(cfg))
            row["cold_over_floor"] = round(row["cold_us"] / floor, 3)
            rows.append(row)
            log(f"  {case.name:22s} {direction:8s} {'*' if row['default'] else ' '} {row['cold_us']:8.2f} cold "
                f"{row['warm_us']:8.2f} warm  x{row['cold_over_floor']:5.2f} floor  {row['check']}  {cfg}")  # fmt: skip
    return rows


def sweep_tail_case(backend, timer, case, directions, reps, log) -> list[dict]:
    """Every whole-row candidate of one short-window case with DeepSeek-V4's tail: time and numerics."""
    from csa_compressor import tail as T

    pack = make_pack(case.seqlens, case.head_dim, case.ratio, case.coff, device="cuda", seed=1)
    tail = T.random_tail(pack, rope_dim=min(64, case.head_dim), seed=2)
    kw = dict(ratio=pack.ratio, coff=pack.coff)
    ref_out = T.forward(*pack.inputs, tail, total_comp=pack.total_comp, **kw)
    rstd = torch.empty(pack.total_comp, dtype=torch.float32, device="cuda")
    backend.tail_forward(pack, torch.empty_like(ref_out), backend.tail_default("forward", *case_config(case)), tail,
                         rstd)  # fmt: skip
    ref_grads = T.backward(*pack.inputs, pack.grad_out, tail, **kw)
    rows = []
    for direction in directions:
        default = backend.tail_default(direction, *case_config(case))
        for cfg in tail_candidates(backend, direction, *case_config(case)):
            if direction == "forward":
                outputs = [torch.empty_like(ref_out)]
                fn = lambda cfg=cfg, o=outputs: backend.tail_forward(pack, o[0], cfg, tail, rstd)  # noqa: E731
                refs, contract = [ref_out], lambda o: T.contract_report(pack, tail, out=o[0])["ok"]
            else:
                outputs = [torch.empty_like(t) for t in (pack.kv, pack.score, pack.ape)]
                outputs.append(torch.empty(pack.head_dim, dtype=torch.float32, device="cuda"))
                fn = lambda cfg=cfg, g=outputs: backend.tail_backward(pack, g, cfg, tail, rstd)  # noqa: E731
                refs, contract = ref_grads, lambda g: T.contract_report(pack, tail, grads=tuple(g))["ok"]
            try:
                row = time_and_check(timer, fn, outputs, refs, reps, contract if cfg == default else None)
            except Exception as exc:  # a tile may not build or fit: report, go on
                log(f"  FAILED {case.name} {direction} {cfg}: {type(exc).__name__}: {exc}")
                continue
            row.update(case=case.name + "-tail", direction=direction, default=cfg == default,
                       config=dataclasses.asdict(cfg))  # fmt: skip
            rows.append(row)
            log(f"  {case.name:22s} {direction:8s} {'*' if row['default'] else ' '} {row['cold_us']:8.2f} cold "
                f"{row['warm_us']:8.2f} warm  {row['check']}  {cfg}")  # fmt: skip
    return rows


def case_config(case) -> tuple:
    return case.ratio, case.coff, case.head_dim


STATS_TILES = (None, (64, 32, 4, 0), (128, 32, 8, 0), (64, 64, 8, 0), (64, 16, 2, 0), (32, 32, 2, 0), (64, 32, 4, 8))


def sweep_stats_case(backend, timer, case, reps, log) -> list[dict]:
    """The statistics backward at the default tile (None) and the others of ``STATS_TILES``, (block_d, slots,
    num_warps, rows per program; rows 0: from the problem size), then the backward without statistics."""
    pack = make_pack(case.seqlens, case.head_dim, case.ratio, case.coff, device="cuda", seed=3)
    _, ref_grads = _references(pack)
    out = torch.empty(pack.total_comp, case.head_dim, dtype=torch.bfloat16, device="cuda")
    stats = torch.empty(pack.total_comp, 3, case.head_dim, dtype=torch.float32, device="cuda")
    backend.forward_with_stats(pack, out, stats)
    rows = []
    for tile in (*STATS_TILES, "no statistics"):
        grads = [torch.empty_like(t) for t in (pack.kv, pack.score, pack.ape)]
        with_stats = tile != "no statistics"

        def fn(tile=tile, grads=grads, with_stats=with_stats):
            if with_stats:
                backend.stats_backward(pack, grads, stats, tile)
            else:
                backend.default_backward(pack, grads)

        try:
            row = time_and_check(
                timer, fn, grads, ref_grads, reps, lambda g: contract_report(pack, grads=tuple(g))["ok"]
            )
        except Exception as exc:
            row = dict(error=f"{type(exc).__name__}: {exc}"[:200])
        row.update(case=case.name, tile=tile or "default")
        rows.append(row)
        log(json.dumps(row))
    backend.stats_backward(pack, grads, stats, None)  # the default tile back in force
    return rows


def _cases(text: str, stats: bool):
    long = [c for c in CASES if c.coff * c.ratio > 16]
    if text in ("all", ""):
        return long if stats else list(CASES)
    if text in ("r4", "r128"):
        return [c for c in CASES if f"-{text}-" in c.name]
    names = text.split(",")
    return [c for c in CASES if c.name in names]


def _summary(rows, log) -> None:
    best = {}
    for row in rows:
        key = (row["case"], row.get("direction", "stats"))
        if "cold_us" in row and (key not in best or row["cold_us"] < best[key]["cold_us"]):
            best[key] = row
    log("\nbest per case and direction (cold us), and the default:")
    for (case, direction), row in best.items():
        default = next((r for r in rows if r["case"] == case and r.get("default") and r["direction"] == direction), {})
        log(f"  {case:22s} {direction:8s} best {row['cold_us']:8.2f}  default {default.get('cold_us', '—')}  "
            f"{row.get('config') or row.get('tile')}")  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--cases", default="all", help="all, r4, r128 or comma-separated case names")
    ap.add_argument("--directions", default="forward,backward")
    ap.add_argument("--reps", type=int, default=10, help="cold and warm calls per candidate")
    ap.add_argument("--quick", action="store_true", help="fewer candidates")
    ap.add_argument("--stats", action="store_true", help="the statistics backward's tiles (long windows)")
    ap.add_argument("--tail", action="store_true", help="the short windows' whole-row tiles with the fused tail")
    ap.add_argument("--workers", type=int, default=max(1, min(14, (os.cpu_count() or 2) - 2)))
    ap.add_argument("--no-build", action="store_true", help="skip the parallel build step")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("triton_sweep: needs a CUDA GPU", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    log_file = open(os.path.join(args.out, "triton_sweep.log"), "w")

    def log(msg):
        print(msg, flush=True)
        log_file.write(msg + "\n")

    backend, timer = _Backend(), Timer(torch.device("cuda", torch.cuda.current_device()))
    rate = timer.copy_rate()
    cases, directions = _cases(args.cases, args.stats), args.directions.split(",")
    rows = []
    if args.stats:
        for case in cases:
            rows += sweep_stats_case(backend, timer, case, args.reps, log)
    elif args.tail:
        for case in (c for c in cases if c.coff * c.ratio <= 16):
            rows += sweep_tail_case(backend, timer, case, directions, args.reps, log)
            torch.cuda.empty_cache()
    else:
        jobs = [(d, c.ratio, c.coff, c.head_dim, dataclasses.replace(cfg, rows_per_prog=cfg.block_r))
                for c in cases for d in directions for cfg in candidates(backend, d, c.ratio, c.coff, c.head_dim, args.quick)]  # fmt: skip
        if not args.no_build:
            build_all(list(dict.fromkeys(jobs)), args.workers, log)
        for case in cases:
            rows += sweep_case(backend, timer, rate, case, directions, args.quick, args.reps, log)
            torch.cuda.empty_cache()
    _summary(rows, log)
    with open(os.path.join(args.out, "triton_sweep.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "stats": args.stats, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
