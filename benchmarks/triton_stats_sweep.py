"""Tile sweep of the Triton softmax-statistics backward (``csa_bwd_stats_kernel``) on one GPU.

    python benchmarks/triton_stats_sweep.py [--out DIR]

For 1x65536-d512-r128-c2, 3x8192-d512-r128-c1 and 1x8192-d128-r128-c1 (``make_pack(..., seed=3)``) it computes the
statistics with the Triton forward, then times ``launch.backward(..., stats=...)`` (stats kernel + dAPE reduction)
for the default tile and ~6 candidates set through ``launch.STATS_TILE_OVERRIDE`` (block_d, slots, num_warps, rows
per program; rows 0 = from the problem size), and the backward without statistics for comparison. Kernel time from
``csa_compressor.bench._Timer``: cold (L2 flushed before each call) and warm, 10 calls each. The two smaller cases
are also checked against the SPEC contract (``contract_report``). Prints a markdown table (and writes
``triton_stats_sweep.json`` to ``--out``). About a minute on an H200, most of it JIT builds.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

COPY_RATE = 4.22e12  # bytes/s, SPEC section 6
# (name, sequences, seqlen, head_dim, ratio, coff, check the contract)
CASES = [
    ("1x65536-d512-r128-c2", 1, 65536, 512, 128, 2, False),
    ("3x8192-d512-r128-c1", 3, 8192, 512, 128, 1, True),
    ("1x8192-d128-r128-c1", 1, 8192, 128, 128, 1, True),
]


def candidates(default_rows: int) -> list[tuple[int, int, int, int] | None]:
    """None (the default tile), then (block_d, slots, num_warps, rows) overrides."""
    return [
        None,
        (64, 32, 4, 2 * default_rows),
        (64, 32, 4, max(1, default_rows // 2)),
        (128, 32, 8, 0),
        (64, 64, 8, 0),
        (64, 16, 2, 0),
        (32, 32, 2, 0),
    ]


def floor_us(tokens: int, n_rows: int, head_dim: int, coff: int) -> float:
    """SPEC 6 backward floor: read kv, score, grad_out; write grad_kv, grad_score."""
    return (4 * tokens * coff * head_dim * 2 + n_rows * head_dim * 2) / COPY_RATE * 1e6


def _compiled(kernel) -> set:
    """Compiled variants of a Triton JIT function (best effort: the cache layout is Triton's, not an API)."""
    try:
        return {k for cache in kernel.device_caches.values() for k in cache[0].values()}
    except Exception:
        return set()


def _regs(kernels) -> str:
    """Registers and spills of the variants built by a call ("=": nothing new, an earlier row's build)."""
    try:
        return "/".join(sorted({f"{k.n_regs} ({k.n_spills} spills)" for k in kernels})) or "="
    except Exception:
        return "?"


def main() -> None:
    import torch

    from csa_compressor.backends.triton import launch
    from csa_compressor.bench import _Timer
    from csa_compressor.testing import contract_report, make_pack

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    dev = torch.device("cuda", 0)
    timer = _Timer(dev, (args.reps, args.reps, 5))
    bwd_mod = launch._kernels()[1]
    t_start = time.time()
    rows = []
    for name, n, seqlen, d, ratio, coff, check in CASES:
        pack = make_pack((seqlen,) * n, d, ratio, coff, device="cuda", seed=3)
        n_rows, tokens = pack.total_comp, pack.kv.shape[0]
        out = torch.empty((n_rows, d), dtype=pack.kv.dtype, device=dev)
        stats = torch.empty((n_rows, 3, d), dtype=torch.float32, device=dev)
        launch.forward(*pack.inputs, out, ratio, coff, None, stats)
        grads = torch.empty_like(pack.kv), torch.empty_like(pack.score), torch.empty_like(pack.ape)
        key = (ratio, coff, d)
        default = launch.stats_tile(ratio, coff, d, interpret=False)
        default_rows = launch._stats_rows(default, ratio, coff, d, n_rows)
        floor = floor_us(tokens, n_rows, d, coff)

        def run(stats_arg, grads=grads, pack=pack, ratio=ratio, coff=coff):
            launch.backward(*pack.inputs, pack.grad_out, *grads, ratio, coff, None, stats_arg)

        with_stats = functools.partial(run, stats)

        for tile in [*candidates(default_rows), "no stats"]:
            if tile == "no stats":
                label, fn, kernel = "no stats (long kernel)", functools.partial(run, None), None
            else:
                launch.STATS_TILE_OVERRIDE.pop(key, None)
                if tile is not None:
                    launch.STATS_TILE_OVERRIDE[key] = tile
                tile_used = launch.stats_tile(ratio, coff, d, interpret=False)
                r = launch._stats_rows(tile_used, ratio, coff, d, n_rows)
                tile_used = tile_used._replace(rows=r)
                programs = -(-n_rows // r) * -(-(coff * ratio) // tile_used.slots) * -(-d // tile_used.block_d)
                label = f"{'*' if tile is None else ''}d{tile_used.block_d} s{tile_used.slots} w{tile_used.num_warps} rows{r} ({programs} progs)"
                fn, kernel = with_stats, bwd_mod.csa_bwd_stats_kernel
            try:
                before = _compiled(kernel) if kernel is not None else set()
                for t in grads:
                    t.fill_(float("nan"))
                fn()  # JIT build and warm-up
                torch.cuda.synchronize(dev)
                regs = _regs(_compiled(kernel) - before) if kernel is not None else "-"
                ok = contract_report(pack, grads=grads)["ok"] if check else None
                cold = timer.kernel_us(fn, args.reps, cold=True)
                warm = timer.kernel_us(fn, args.reps, cold=False)
                rec = dict(case=name, tile=label, cold=cold, warm=warm, floor=floor, regs=regs, contract=ok)
            except Exception as exc:  # keep sweeping: a tile may not build or fit
                rec = dict(case=name, tile=label, error=f"{type(exc).__name__}: {exc}"[:200])
            rows.append(rec)
            print(json.dumps(rec), flush=True)
        launch.STATS_TILE_OVERRIDE.pop(key, None)
    with open(os.path.join(args.out, "triton_stats_sweep.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print(f"\n{torch.cuda.get_device_name(dev)}, {time.time() - t_start:.0f} s; * = default tile\n")
    print("| case | tile | cold us | warm us | floor us | cold / floor | regs | contract |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['case']} | {r['tile']} | error: {r['error']} | | | | | |")
            continue
        ratio = r["cold"] / r["floor"]
        print(
            f"| {r['case']} | {r['tile']} | {r['cold']:.1f} | {r['warm']:.1f} | {r['floor']:.1f} | {ratio:.2f} | "
            f"{r['regs']} | {r['contract']} |"
        )


if __name__ == "__main__":
    main()
