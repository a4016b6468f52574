"""One side of an A/B of kernel variants on the SPEC section 6 cases, in its own process (the switches below are
read at import, and each side should start from a fresh allocator and L2 anyway). Written for the evict-first
policies and first named ``evict_first_ab.py``.

Variants: the evict-first policies (``csa_compressor.backends.STREAM_LOADS`` for the forwards, ``STREAM_BACKWARD``
for the backwards), set by ``--set KEY=VALUE`` before the package is imported; the cute statistics backward's
window slots per CTA (``--stats-slots``) and thread tile (``--stats-tile``); the register cap of the cute forwards (``--forward-min-blocks``,
``--forward-min-blocks-long``, ``--backward-min-blocks``: resident CTAs per SM); the streaming schedule for the
long-window forward at a given column width (``--forward-long-stream-cols``) and its 64-column tile (``--forward-long-tile``);
the short-window forward's thread tile (``--forward-tile``) and its register-capped build for large launches
(``--no-wide-forward``: not built); the backwards' prefetch ahead
(``--prefetch-ahead``); the short-window backward's thread tile (``--backward-tile``), CTA size (``--backward-threads``) and held ape (``--hold-ape``); the
statistics backward's cluster form (``--stats-cluster``, ``--stats-cluster-rows``) and whole-tile form
(``--stats-whole-tile``) and the slab form's CTA size (``--stats-threads``); or two package versions on ``PYTHONPATH``::

    python3 benchmarks/variant_ab.py --out $OUT/ab_on.json
    python3 benchmarks/variant_ab.py --set CSA_COMPRESSOR_STREAM_LOADS=0 --out $OUT/ab_off.json
    python3 benchmarks/variant_ab.py --compare $OUT/ab_on.json $OUT/ab_off.json   # A = on, B = off
    python3 benchmarks/variant_ab.py --set CSA_COMPRESSOR_STREAM_BACKWARD=stores --directions bwd --out $OUT/st.json

``benchmarks/gpu_variants_ab_session.sh`` runs every variant on both GPUs of one machine in opposite orders.

Each process times, per backend and case, the forward and the backward as autograd runs them (the bench's
``_kernel_callables``; ``--triton-stats`` forces Triton's softmax-statistics pair, autograd's default since c939852) with the
bench's timer: kernel us per call from the profiler, L2 flushed by a write before each call ("cold", the bench's
method), by a write then a read ("clean": L2 holds no dirty lines) and not at all ("warm").
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def _override(cases, directions, make) -> None:
    """``SCHEDULE_OVERRIDE[(direction, ratio, coff, head_dim)] = make(direction, case, schedule)`` for every case and
    direction where ``make`` returns a schedule; ``schedule`` is the override set so far, else the default (the
    cache policies apply on top, as for the defaults). Directions without a form for a case are skipped."""
    from csa_compressor.backends.cute import launch as cute_launch

    for case in cases:
        for direction in directions:
            key = (direction, case.ratio, case.coff, case.head_dim)
            try:
                sch = cute_launch.SCHEDULE_OVERRIDE.get(key) or cute_launch._default_schedule(*key)
            except ValueError:
                continue  # no statistics form for short windows
            new = make(direction, case, sch)
            if new is not None:
                cute_launch.SCHEDULE_OVERRIDE[key] = new


def _resized(threads: int, skip):
    """``_override`` maker: the schedule's thread tile in CTAs of ``threads`` (``Schedule.with_threads``), except where
    ``skip(sch)`` or the CTA size is already ``threads``."""

    def make(d, c, sch):
        return None if skip(sch) or sch.threads == threads else sch.with_threads(threads)

    return make


def apply_overrides(args, cases) -> None:
    """The cute schedule switches of ``args`` as ``SCHEDULE_OVERRIDE`` entries for ``cases`` (they compose)."""
    if args.stats_slots or args.stats_tile:
        from csa_compressor.backends.cute.backward_stats import stats_backward_schedule

        tile = {}
        if args.stats_tile:
            tile = dict(zip(("vcap", "slots"), (int(x) for x in args.stats_tile.split(",")), strict=True))
        _override(
            cases,
            ("backward_stats",),
            lambda d, c, sch: stats_backward_schedule(c.ratio, c.coff, c.head_dim, args.stats_slots or None, **tile),
        )
    if args.no_wide_forward:
        from csa_compressor.backends.cute import launch as cute_launch

        # The short-window forward's register-capped build for large launches (launch.forward picks it from
        # ``wide_rows`` rows on) is not built: every launch takes the default build.
        cute_launch.wide_forward_schedule = lambda sch: None
    if args.forward_min_blocks or args.forward_min_blocks_long:

        def capped(d, c, sch):
            mb = args.forward_min_blocks if sch.G == 1 else args.forward_min_blocks_long if sch.NB == 1 else 0
            return replace(sch, MB=mb) if mb else None

        _override(cases, ("forward", "forward_stats"), capped)
    if args.forward_long_stream_cols:
        from csa_compressor.backends.cute.forward import streaming_schedule

        def streaming(d, c, sch):
            if c.ratio * c.coff <= 16:
                return None  # short windows have no streaming form
            sch = streaming_schedule(c.ratio, c.coff, c.head_dim, cols_cap=args.forward_long_stream_cols)
            return replace(sch, ST=d == "forward_stats")

        _override(cases, ("forward", "forward_stats"), streaming)
    if args.forward_long_tile:
        from csa_compressor.backends.cute.forward import make_schedule

        fvcap, fthreads = (int(x) for x in args.forward_long_tile.split(","))

        def long_tile(d, c, sch):
            if not 8 < c.ratio * c.coff <= 128:
                return None  # the 64-column one-batch schedule of forward_schedule only
            new = make_schedule(c.ratio, c.coff, c.head_dim, vcap=fvcap, threads=fthreads, cols_cap=64)
            return replace(new, CM=True, ST=d == "forward_stats")

        _override(cases, ("forward", "forward_stats"), long_tile)
    if args.forward_tile:
        from csa_compressor.backends.cute.forward import make_schedule

        svcap, sthreads = (int(x) for x in args.forward_tile.split(","))

        def short_tile(d, c, sch):
            if c.ratio * c.coff > 8:
                return None  # the one-group (exact) forward of short windows only
            return make_schedule(c.ratio, c.coff, c.head_dim, vcap=svcap, threads=sthreads, cols_cap=512, md=True)

        _override(cases, ("forward",), short_tile)
    if args.backward_tile:
        from csa_compressor.backends.cute.forward import make_schedule

        vcap, cols = (int(x) for x in args.backward_tile.split(","))

        def tile(d, c, sch):
            if sch.LONG or sch.SC:
                return None
            new = make_schedule(c.ratio, c.coff, c.head_dim, vcap=vcap, threads=sch.threads, cols_cap=cols, md=sch.MD)
            return replace(new, MB=sch.MB, PF=sch.PF)

        _override(cases, ("backward",), tile)
    if args.stats_cluster_rows:
        from csa_compressor.backends.cute import launch as cute_launch

        cute_launch.CLUSTER_MAX = args.stats_cluster_rows  # row ranges per tile, read by backward_capacity per call
        args.stats_cluster = 1
    if args.stats_whole_tile is not None:
        from csa_compressor.backends.cute.backward_stats import with_whole_tile

        _override(cases, ("backward_stats",), lambda d, c, sch: with_whole_tile(sch, bool(args.stats_whole_tile)))
    if args.stats_threads:
        _override(cases, ("backward_stats",), _resized(args.stats_threads, lambda sch: sch.WT or sch.CL))
    if args.stats_cluster is not None:
        from csa_compressor.backends.cute.backward_stats import with_whole_tile

        # The cluster form splits the rows over the cluster's CTAs: the slab form's 128-thread tile.
        _override(
            cases,
            ("backward_stats",),
            lambda d, c, sch: replace(with_whole_tile(sch, False), CL=bool(args.stats_cluster)),
        )
    if args.backward_threads:
        _override(cases, ("backward",), _resized(args.backward_threads, lambda sch: sch.LONG or sch.SC))
    if args.hold_ape:
        _override(cases, ("backward",), lambda d, c, sch: None if sch.LONG or sch.SC else replace(sch, HA=True))
    # The two-pass long backward (LONG without SC) sizes its grid by shared memory and prefetches by its own rule.
    if args.backward_min_blocks:

        def capped_backward(d, c, sch):
            if sch.LONG and not sch.SC:
                return None
            if args.backward_min_blocks * sch.threads > 2048:  # more threads than an SM holds: no such launch bound
                print(f"--backward-min-blocks {args.backward_min_blocks}: {d} of {c.name} has {sch.threads}-thread "
                      "CTAs, left at its default", file=sys.stderr)  # fmt: skip
                return None
            return replace(sch, MB=args.backward_min_blocks)

        _override(cases, ("backward", "backward_stats"), capped_backward)
    if args.prefetch_ahead:
        _override(
            cases,
            ("backward", "backward_stats"),
            lambda d, c, sch: None if sch.LONG and not sch.SC else replace(sch, PF=True),
        )


def measure(args) -> dict:
    import torch

    from csa_compressor import available_backends, backends
    from csa_compressor.bench import _kernel_callables, _Timer, select_cases
    from csa_compressor.testing import make_pack

    dev = torch.device("cuda", 0)
    if args.triton_stats:
        from csa_compressor.backends.triton import launch as triton_launch

        triton_launch.AUTOGRAD_STATS = True
    cases = select_cases(args.cases.split(",") if args.cases else None)
    apply_overrides(args, cases)
    timer = _Timer(dev, (args.reps, args.reps, 1))
    names = [b for b in args.backends.split(",") if b in available_backends(dev)]
    rows = []
    t0 = time.time()
    for case in cases:
        pack = make_pack(case.seqlens, case.head_dim, case.ratio, case.coff, device=dev, seed=3)
        for backend in names:
            fns = _kernel_callables(backend, pack, case)
            for direction, fn in fns.items():
                if direction not in args.directions.split(","):
                    continue
                for _ in range(3):
                    fn()
                rec = dict(case=case.name, backend=backend, direction=direction)
                for key, cold, clean in (("cold", True, False), ("clean", True, True), ("warm", False, False)):
                    for _attempt in range(2):  # a profiler session can lose device records (flush > total)
                        try:
                            rec[key] = round(timer.kernel_us(fn, args.reps, cold=cold, clean=clean), 2)
                            break
                        except (RuntimeError, ValueError) as exc:
                            rec[f"{key}_error"] = str(exc)[:200]
                rows.append(rec)
                print(json.dumps(rec), flush=True)
        del pack
        torch.cuda.empty_cache()
    return {
        "stream_loads": backends.STREAM_LOADS,
        "stream_backward": backends.STREAM_BACKWARD,
        "stats_slots": args.stats_slots,
        "stats_tile": args.stats_tile,
        "forward_min_blocks": [args.forward_min_blocks, args.forward_min_blocks_long],
        "backward_min_blocks": args.backward_min_blocks,
        "forward_long_stream_cols": args.forward_long_stream_cols,
        "prefetch_ahead": args.prefetch_ahead,
        "backward_tile": args.backward_tile,
        "hold_ape": args.hold_ape,
        "stats_cluster": args.stats_cluster,
        "stats_whole_tile": args.stats_whole_tile,
        "backward_threads": args.backward_threads,
        "forward_long_tile": args.forward_long_tile,
        "forward_tile": args.forward_tile,
        "no_wide_forward": args.no_wide_forward,
        "stats_threads": args.stats_threads,
        "stats_cluster_rows": args.stats_cluster_rows,
        "device": torch.cuda.get_device_name(dev),
        "triton_stats": args.triton_stats,
        "reps": args.reps,
        "seconds": round(time.time() - t0, 1),
        "rows": rows,
    }


# Keys of a run record that are not switches; a switch left at its default (0, "", None, False, [0, 0]) is not shown.
_NOT_SWITCHES = ("rows", "device", "reps", "seconds")
_ALWAYS_SHOWN = ("stream_loads", "stream_backward")


def _switches(run: dict) -> str:
    """``key=value`` of the run's cache policies and of every switch it set."""
    shown = [
        f"{k}={v}"
        for k, v in run.items()
        if k not in _NOT_SWITCHES and (k in _ALWAYS_SHOWN or v not in (0, "", None, False, [0, 0]))
    ]
    return ", ".join(shown)


def compare(a_path: str, b_path: str) -> str:
    """Table of run A against run B (any two runs of this script: evict-first on / off, or two kernel versions)."""
    a_run, b_run = (json.load(open(p)) for p in (a_path, b_path))
    index = {(r["case"], r["backend"], r["direction"]): r for r in b_run["rows"]}
    lines = [
        f"A = {a_path} ({_switches(a_run)}), ",
        f"B = {b_path} ({_switches(b_run)}); ",
        f"{a_run.get('device')}; kernel us per call",
        "",
        "| case | backend | dir | cold A / B | clean A / B | warm A / B | cold A/B |",
        "|---|---|---|---|---|---|---|",
    ]
    for a in a_run["rows"]:
        b = index.get((a["case"], a["backend"], a["direction"]))
        if b is None or "cold" not in a or "cold" not in b:
            continue

        def pair(key, a=a, b=b):
            return f"{a.get(key, '-')} / {b.get(key, '-')}"

        lines.append(
            f"| {a['case']} | {a['backend']} | {a['direction']} | {pair('cold')} | {pair('clean')} | {pair('warm')} "
            f"| {a['cold'] / b['cold']:.3f} |"
        )
    return "\n".join(lines)


# CTA sizes the backwards' thread-count switches accept: 1024 threads would not fit 128 registers each.
BACKWARD_CTA_SIZES = (128, 256, 512)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", default="cute,triton")
    ap.add_argument("--cases", default="", help="comma-separated case names (default: the SPEC section 6 cases)")
    ap.add_argument("--directions", default="fwd,bwd", help="comma-separated: fwd, bwd")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--stats-slots", type=int, default=0, help="cute statistics backward: window slots per CTA")
    ap.add_argument(
        "--forward-min-blocks", type=int, default=0, help="cute short-window forward: CTAs per SM to cap registers for"
    )
    ap.add_argument(
        "--forward-min-blocks-long",
        type=int,
        default=0,
        help="cute long-window forward with one batch per group (windows <= 128): CTAs per SM to cap registers for",
    )
    ap.add_argument(
        "--backward-min-blocks", type=int, default=0, help="cute backwards: CTAs per SM to cap registers for"
    )
    ap.add_argument(
        "--stats-tile", default="", help="cute statistics backward: 'VCAP,SLOTS' (vector cap, slots per thread)"
    )
    ap.add_argument(
        "--forward-long-stream-cols",
        type=int,
        default=0,
        help="cute long-window forward: the streaming schedule (batches in flight) with this many columns per CTA",
    )
    ap.add_argument(
        "--prefetch-ahead",
        action="store_true",
        help="cute backwards (short windows, statistics): prefetch rows ahead (Schedule.PF)",
    )
    ap.add_argument(
        "--backward-tile",
        default="",
        help="cute short-window backward: 'VCAP,COLS' (vector cap, columns per CTA) of its tile, same CTA size",
    )
    ap.add_argument(
        "--hold-ape", action="store_true", help="cute short-window backward: ape held in registers (Schedule.HA)"
    )
    ap.add_argument(
        "--stats-cluster",
        type=int,
        choices=(0, 1),
        default=None,
        help="cute statistics backward: 1 the cluster form (Schedule.CL), 0 slabs + reduction kernel",
    )
    ap.add_argument(
        "--stats-cluster-rows",
        type=int,
        choices=range(1, 9),
        default=0,
        help="cute statistics backward: the cluster form with at most this many row ranges per tile (cluster size)",
    )
    ap.add_argument(
        "--stats-whole-tile",
        type=int,
        choices=(0, 1),
        default=None,
        help="cute statistics backward: 1 the whole-tile form (Schedule.WT, 512-thread CTAs, no slabs), 0 the slab form",
    )
    ap.add_argument(
        "--forward-long-tile",
        default="",
        metavar="VCAP,THREADS",
        help="cute forwards of 9-128 slots: 64-column chunks at this vector cap and CTA size (default 4,256)",
    )
    ap.add_argument(
        "--forward-tile",
        default="",
        metavar="VCAP,THREADS",
        help="cute forwards of up to 8 slots (one group, exact): this vector cap and CTA size (default 4,128)",
    )
    ap.add_argument(
        "--backward-threads",
        type=int,
        choices=BACKWARD_CTA_SIZES,
        default=0,
        help="cute short-window backward: CTA size by more row lanes at the same thread tile (fewer grad_ape slabs)",
    )
    ap.add_argument(
        "--stats-threads",
        type=int,
        choices=BACKWARD_CTA_SIZES,
        default=0,
        help="cute statistics backward, slab form: CTA size by more row lanes at the same thread tile (fewer slabs)",
    )
    ap.add_argument(
        "--no-wide-forward",
        action="store_true",
        help="cute short-window forward: no register-capped build for large launches",
    )
    ap.add_argument("--triton-stats", action="store_true", help="force AUTOGRAD_STATS on for Triton")
    ap.add_argument("--out", default=None)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="environment variable for this run")
    ap.add_argument("--compare", nargs=2, metavar=("A_JSON", "B_JSON"))
    return ap


def main() -> int:
    args = build_parser().parse_args()
    for item in args.set:
        key, _, value = item.partition("=")
        os.environ[key] = value  # before the package is imported (measure imports it)
    if args.compare:
        print(compare(*args.compare))
        return 0
    result = measure(args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
