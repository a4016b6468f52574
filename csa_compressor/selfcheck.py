"""The main job, ``python -m csa_compressor``: every available backend against the fp64 oracle.

Runs small ragged packs (short and empty segments, token and row padding) through the
public wrappers, checks the SPEC section 3 contract and prints a table. On a CPU-only
machine the Triton backend runs under its interpreter. On a GPU it also times each
call. Exit status 1 if any backend breaks the contract.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

# (ratio, coff, head_dim, seqlens): short and empty segments, tails, odd head_dim.
CASES = (
    (4, 2, 33, (37, 3, 0, 20)),
    (4, 1, 16, (9, 0, 14)),
    (128, 1, 8, (300, 60, 130)),
    (128, 2, 8, (260, 129)),
)


_BITWISE = ("fwd_bitwise", "dkv_bitwise", "dscore_bitwise")


def _check_one(backend: str, ratio: int, coff: int, head_dim: int, seqlens, device) -> dict:
    from . import api
    from .testing import contract_report, make_pack

    pack = make_pack(seqlens, head_dim, ratio, coff, token_padding=3, comp_padding=2, device=device, seed=ratio + coff)
    kw = dict(ratio=ratio, coff=coff, backend=backend)
    out = api.csa_compressor_forward_wrapper(*pack.inputs, total_comp=pack.total_comp, **kw)["out"]
    grads = api.csa_compressor_backward_wrapper(*pack.inputs, pack.grad_out, **kw)
    row = contract_report(pack, out, tuple(grads))
    if device.type == "cuda":
        row["fwd_us"], row["bwd_us"] = _time(backend, pack, ratio, coff)
    return row


def _time(backend, pack, ratio, coff, reps: int = 20) -> tuple[float, float]:
    from . import api

    def median_us(fn) -> float:
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        return statistics.median(times)

    kw = dict(ratio=ratio, coff=coff, backend=backend)
    fwd = median_us(lambda: api.csa_compressor_forward_wrapper(*pack.inputs, total_comp=pack.total_comp, **kw))
    bwd = median_us(lambda: api.csa_compressor_backward_wrapper(*pack.inputs, pack.grad_out, **kw))
    return fwd, bwd


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m csa_compressor", description=__doc__.splitlines()[0])
    parser.add_argument("--backends", nargs="*", help="backends to check (default: every available one)")
    parser.add_argument("--device", default=None, help="device (default: cuda if available, else cpu)")
    opts = parser.parse_args(argv)

    device = torch.device(opts.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cpu":
        # Triton kernels execute their real logic on the CPU through the interpreter.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from .dispatch import available_backends, unavailable_reason

    backends = opts.backends or available_backends(device)
    print(
        f"csa_compressor self-check on {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'})"
    )
    for name in ("cute", "triton", "reference"):
        if name not in backends:
            reason = unavailable_reason(name) or f"not usable on {device.type}"
            print(f"  skipping {name}: {reason}")
    header = (
        "| backend | ratio | coff | d | fwd ulp | fwd err (upstream) | dkv ulp | dscore ulp | dape rel-L2 "
        "| bitwise out/dkv/dscore |"
    )
    timed = device.type == "cuda"
    if timed:
        header += " fwd us | bwd us |"
    header += " ok |"
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    all_ok = True
    for backend in backends:
        for ratio, coff, head_dim, seqlens in CASES:
            row = _check_one(backend, ratio, coff, head_dim, seqlens, device)
            all_ok &= row["ok"]
            line = (
                f"| {backend} | {ratio} | {coff} | {head_dim} | {row['fwd_ulp']} | "
                f"{row['fwd_err']:.2e} ({row['upstream_err']:.2e}) | {row['dkv_ulp']} | {row['dscore_ulp']} | "
                f"{row['dape_rel']:.1e} | {'/'.join('y' if row[k] else 'n' for k in _BITWISE)} |"
            )
            if timed:
                line += f" {row['fwd_us']:.1f} | {row['bwd_us']:.1f} |"
            lines.append(line + (" yes |" if row["ok"] else " NO |"))
    print("\n".join(lines))
    print("all backends meet the numerics contract" if all_ok else "CONTRACT VIOLATED (see rows marked NO)")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
