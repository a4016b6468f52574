"""The cute backend's development loop on the bench's cases: numerics and kernel time of each kernel, one GPU run.

    python benchmarks/cute_sweep.py [--cases NAME,...] [--reps 10] [--out DIR]

For every case it runs the cute forward and backward through the public wrappers (and, for long windows, the
softmax-statistics pair autograd uses), checks them against the contract on the full-size pack
(``csa_compressor.testing.contract_report``), and times them with the bench's timer: cold and warm kernel time
and the wall per call. It uses only the public API, so it times the configurations the backend picks; sweeping
other configurations goes through the backend's per-architecture config factories. Prints a table and writes
``cute_sweep.json`` to --out.

    python benchmarks/cute_sweep.py --tail-parts [--cases 1x8192-d128,3x8192-d512]

times instead which part of the fused tail costs the ratio-4 kernels their time: each case's forward and backward
built with the pooling alone, the norm alone, the rotation alone (rope_dim 64, interleaved), both, and both with
per-segment positions; cold and warm kernel time, the backward as autograd calls it (the forward's rstd handed
over). One line per (case, variant): ``fwd cold / warm  bwd cold / warm`` in microseconds.

    python benchmarks/cute_sweep.py --tail-tiles [--cases 1x8192-d128,3x8192-d512]

times the fused short forward of the ratio-4 cases at other tiles than ``tail_configs.fused_forward_for_sm90``
picks (vector width, rows per CTA), each built through the backend's factory table and checked
against the tail's fp32 reference (``tail.contract_report``), beside the pooling alone. The builds are compiled
first in parallel processes (the disk cache), then timed in this one. One line per (case, tile).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from csa_compressor import api, available_backends
from csa_compressor import tail as T
from csa_compressor.bench import CASES, CUDNN_FRONTEND_H200, TAIL_ARGS, TailCase, Timer, floor_us
from csa_compressor.bench.calls import _autograd_tail_backward, _kernel_callables
from csa_compressor.bench.cases import Case
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


# --tail-parts: the ratio-4 cases, each with the tail's parts alone and together.
TAIL_PART_RATIO, TAIL_PART_COFF = 4, 2
TAIL_PART_CASES = {
    "1x8192-d128": ((8192,), 128),
    "3x8192-d128": ((8192,) * 3, 128),
    "1x8192-d512": ((8192,), 512),
    "3x8192-d512": ((8192,) * 3, 512),
}
TAIL_PART_VARIANTS = {
    "norm": dict(norm=True, rope_dim=0),
    "rope": dict(norm=False, rope_dim=64),
    "both": dict(norm=True, rope_dim=64),
    "both+pos": dict(norm=True, rope_dim=64, positions=True),
}


def cold_and_warm(timer: Timer, fn) -> list[float]:
    timer.warm_up(fn)
    return [timer.kernel(fn, calls, cold).us for calls, cold in ((10, True), (20, False))]


def line(name: str, variant: str, fwd: list[float], bwd: list[float]) -> str:
    return f"{name} {variant}: fwd {fwd[0]:.2f} / {fwd[1]:.2f}  bwd {bwd[0]:.2f} / {bwd[1]:.2f}"


def time_tail_parts(timer: Timer, name: str, backend: str, device: str = "cuda") -> None:
    """One case's lines: the bench's pooling calls, then each variant's autograd forward (rstd saved) and the
    bench's tail backward (autograd's call, that rstd given)."""
    seqlens, head_dim = TAIL_PART_CASES[name]
    case = Case(seqlens, head_dim, TAIL_PART_RATIO, TAIL_PART_COFF)
    pack = make_pack(seqlens, head_dim, case.ratio, case.coff, device=device, seed=1)
    pooling = _kernel_callables(backend, pack, case, None)
    print(line(name, "pooling", cold_and_warm(timer, pooling["fwd"]), cold_and_warm(timer, pooling["bwd"])), flush=True)
    inputs = (pack.kv, pack.score, pack.ape, pack.cu_seqlens, pack.cu_seqlens_comp)
    for variant, options in TAIL_PART_VARIANTS.items():
        tail = TailCase(T.random_tail(pack, interleaved=True, seed=1, **options), positions=None)
        tail_args = tuple(tail.kwargs()[a] for a in TAIL_ARGS)

        def forward(tail_args=tail_args):
            return api._pool_forward_tail(inputs, case.ratio, case.coff, pack.total_comp, backend, tail_args,
                                          return_rstd=True)  # fmt: skip

        backward = _autograd_tail_backward(api, inputs, pack, case, backend, tail, stats=False)
        print(line(name, variant, cold_and_warm(timer, forward), cold_and_warm(timer, backward)), flush=True)


# --tail-tiles: candidate tiles of the fused short forward (ratio 4, rotation interleaved as DeepSeek-V4's).
TILE_WIDTHS = (2, 4, 8)
TILE_MAX_THREADS = 512
TILE_ROW_LIMIT = 32


def tail_tiles(head_dim: int, spec) -> list:
    """The default fused tile first, then whole rows of each vector width, rows per CTA in powers of two up to
    TILE_MAX_THREADS threads, without a launch bound."""
    from csa_compressor.backends.cute import tail_configs
    from csa_compressor.backends.cute.configs import ForwardShortConfig
    from csa_compressor.backends.cute.device import offline_spec

    ratio, coff = TAIL_PART_RATIO, TAIL_PART_COFF
    default = tail_configs.fused_forward_for_sm90(ratio, coff, head_dim, offline_spec("sm_90a"), spec)
    tiles = [default]
    for width in TILE_WIDTHS:
        row_threads = tail_configs.fused_row_threads(head_dim, width)
        rows = 1
        while row_threads * rows <= TILE_MAX_THREADS and rows <= TILE_ROW_LIMIT:
            tiles.append(ForwardShortConfig(ratio, coff, head_dim, width, row_threads, rows_per_cta=rows, tail=spec))
            rows *= 2
    return list(dict.fromkeys(tiles))


def tile_tail(pack) -> T.Tail:
    """The tail the tiles are built and timed for: a norm and DeepSeek-V4's interleaved rotation of 64 columns."""
    return T.random_tail(pack, interleaved=True, seed=1, rope_dim=64)


def _compile_tile(tile) -> str:
    from csa_compressor.backends.cute import launch
    from csa_compressor.backends.cute.device import device_spec
    from csa_compressor.backends.cute.forward import ForwardShortWindow

    try:
        launch.host_function(ForwardShortWindow, tile, device_spec(0).arch)
        return ""
    except Exception as e:  # a tile the kernel cannot build: reported, not timed
        return f"{type(e).__name__}: {e}"[:200]


def time_tail_tiles(timer: Timer, name: str, failed: dict, device: str = "cuda") -> None:
    """One case's lines: the pooling alone, then the fused forward at each tile (its route built through the
    factory table ``select._FUSED_FACTORIES``) with its contract check and its ratio to the pooling."""
    from csa_compressor.backends.cute import select, tail_launch

    seqlens, head_dim = TAIL_PART_CASES[name]
    case = Case(seqlens, head_dim, TAIL_PART_RATIO, TAIL_PART_COFF)
    pack = make_pack(seqlens, head_dim, case.ratio, case.coff, device=device, seed=1)
    pooling = cold_and_warm(timer, _kernel_callables("cute", pack, case, None)["fwd"])
    print(f"{name} pooling: {pooling[0]:.2f} / {pooling[1]:.2f}", flush=True)
    tail = tile_tail(pack)
    inputs = (pack.kv, pack.score, pack.ape, pack.cu_seqlens, pack.cu_seqlens_comp)
    out = pack.kv.new_empty((pack.total_comp, head_dim))
    saved = dict(select._FUSED_FACTORIES)
    try:
        for tile in tail_tiles(head_dim, tail_launch.spec_of(tail)):
            label = (f"w{tile.vector_width} x{tile.column_threads} rows {tile.rows_per_cta} "
                     f"cap {tile.ctas_per_sm_cap}")  # fmt: skip
            if failed.get(tile):
                print(f"{name} {label}: not built ({failed[tile]})", flush=True)
                continue
            factories = (lambda *a, tile=tile: tile, saved["sm_90"][1])
            select._FUSED_FACTORIES.update({"sm_90": factories, "sm_100": factories})
            tail_launch._ROUTES.clear()

            def forward():  # the backend's own entry: the api's ops keep their bound routes
                tail_launch.forward(*inputs, out, case.ratio, case.coff, None, None, tail, None)
                return out

            ok = T.contract_report(pack, tail, out=forward())["ok"]
            fused = cold_and_warm(timer, forward)
            print(f"{name} {label}: {fused[0]:.2f} / {fused[1]:.2f}  x{fused[0] / pooling[0]:.3f} cold "
                  f"x{fused[1] / pooling[1]:.3f} warm  contract {'ok' if ok else 'FAILED'}", flush=True)  # fmt: skip
    finally:
        select._FUSED_FACTORIES.update(saved)
        tail_launch._ROUTES.clear()


def run_tail_tiles(names: list) -> int:
    import multiprocessing

    from csa_compressor.backends.cute import tail_launch

    tiles = []
    for name in names:
        probe = make_pack(*TAIL_PART_CASES[name], TAIL_PART_RATIO, TAIL_PART_COFF, device="cpu", seed=1)
        spec = tail_launch.spec_of(tile_tail(probe))
        tiles += [t for t in tail_tiles(TAIL_PART_CASES[name][1], spec) if t not in tiles]
    with multiprocessing.get_context("spawn").Pool(min(8, os.cpu_count() or 1)) as pool:
        failed = dict(zip(tiles, pool.map(_compile_tile, tiles), strict=True))
    timer = Timer(torch.device("cuda", torch.cuda.current_device()))
    for name in names:
        time_tail_tiles(timer, name, failed)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="", help="comma-separated case names (default: the bench's matrix)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--tail-parts", action="store_true", help="time the fused tail's parts instead (see above)")
    ap.add_argument("--tail-tiles", action="store_true", help="time the fused forward's tiles instead (see above)")
    args = ap.parse_args()
    if not torch.cuda.is_available() or "cute" not in available_backends("cuda"):
        print("cute_sweep: needs a GPU the cute backend runs on", file=sys.stderr)
        return 2
    names = [n for n in args.cases.split(",") if n]
    if args.tail_parts or args.tail_tiles:
        unknown = sorted(set(names) - set(TAIL_PART_CASES))
        if unknown:
            known = list(TAIL_PART_CASES)
            mode = "--tail-tiles" if args.tail_tiles else "--tail-parts"
            print(f"cute_sweep {mode}: cases {unknown} are not among {known}", file=sys.stderr)
            return 2
        if args.tail_tiles:
            return run_tail_tiles(names or list(TAIL_PART_CASES))
        timer = Timer(torch.device("cuda", torch.cuda.current_device()))
        for name in names or TAIL_PART_CASES:
            time_tail_parts(timer, name, "cute")
        return 0
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
