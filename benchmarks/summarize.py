"""Compact markdown summary of one benchmark JSON (the table README.md shows).

    python3 benchmarks/summarize.py benchmarks/results/bench_<device>_<time>.json [--backend cute]

Columns: floor (SPEC bytes / copy rate measured in that run), the backend's cold kernel time forward
and backward, their ratio to the floor and to the seed's kernels (SPEC section 6, cold), wall time per
wrapper call, and forward+backward speedup over torch.compile of the eager region in the same run.
"""

import argparse
import json
import sys
from collections import defaultdict

from csa_compressor.bench import SPEC_H200  # SPEC section 6: the seed's kernels on an H200


def summarize(records: list[dict], backend: str) -> str:
    by = defaultdict(dict)
    for r in records:
        if r.get("kernel_us_cold") is not None:
            by[r["case"]][(r["backend"], r["direction"])] = r
    lines = [
        f"{backend} backend, {records[0]['device']}, {records[0]['date'][:10]}, commit {records[0]['commit']}; "
        f"copy rate {records[0]['copy_tb_s']:.2f} TB/s; microseconds, L2 cold unless noted.",
        "",
        "| case | floor fwd / bwd | fwd cold (warm) | bwd cold (warm) | x floor fwd / bwd | x faster than seed fwd / bwd "
        "| wall fwd / bwd | fwd+bwd vs torch.compile |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for case, rows in by.items():
        f, b = rows.get((backend, "fwd")), rows.get((backend, "bwd"))
        tc = rows.get(("torch.compile", "fwd+bwd"))
        if not f or not b:
            continue
        spec = SPEC_H200.get(case, {})
        seed = (spec.get("seed_fwd_cold", float("nan")), spec.get("seed_bwd_cold", float("nan")))
        ours = f["kernel_us_cold"] + b["kernel_us_cold"]
        vs_tc = f"{tc['kernel_us_cold'] / ours:.1f}x" if tc else "-"
        lines.append(
            f"| {case} | {f['floor_us']:.1f} / {b['floor_us']:.1f} "
            f"| {f['kernel_us_cold']:.1f} ({f['kernel_us_warm']:.1f}) | {b['kernel_us_cold']:.1f} ({b['kernel_us_warm']:.1f}) "
            f"| {f['kernel_us_cold'] / f['floor_us']:.2f} / {b['kernel_us_cold'] / b['floor_us']:.2f} "
            f"| {seed[0] / f['kernel_us_cold']:.2f} / {seed[1] / b['kernel_us_cold']:.2f} "
            f"| {f['wall_us']:.0f} / {b['wall_us']:.0f} | {vs_tc} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("json")
    parser.add_argument("--backend", default="cute")
    opts = parser.parse_args()
    with open(opts.json) as f:
        print(summarize(json.load(f), opts.backend))
    return 0


if __name__ == "__main__":
    sys.exit(main())
