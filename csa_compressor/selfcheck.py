"""The self-check, ``python -m csa_compressor``: every available backend against a float64 oracle.

Runs small ragged packs (short and empty segments, token and row padding) through the public
wrappers, checks the numerics contract (docs/numerics.md) and prints a table. On a CPU-only
machine the Triton backend runs under its interpreter. On a GPU it also times each call.
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


_DESCRIPTION = """\
Check that the installed backends compute the compressor pooling correctly on this machine.

Runs small packed batches (ragged and empty sequences, padding rows, odd head_dim) through the
public API on every available backend (or those named), compares the output and the gradients
with a float64 reference, and prints one row per backend and case (on a GPU with the time per
call). On a CPU the Triton backend runs under its interpreter.
Exit status: 0 when every backend is correct, 1 when one is not, 2 on a usage error."""

_EPILOG = "python -m csa_compressor bench --help: the benchmark (needs a CUDA GPU)."


def _parse(argv):
    from .__main__ import CommandParser

    parser = CommandParser(
        prog="python -m csa_compressor",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--backends", nargs="*", help="backends to check: cute, triton, reference (default: all available)"
    )
    parser.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if there is one, else cpu)")
    return parser, parser.parse_args(argv)


def _select(requested, device) -> tuple[list[str], list[str]]:
    """``(backends to check, lines about the ones left out)``; a named backend that cannot run is a UsageError."""
    from . import dispatch
    from .__main__ import UsageError
    from .backends import BACKENDS

    available = dispatch.available_backends(device)
    names = [n.strip().lower() for raw in requested or () for n in raw.split(",") if n.strip()]
    for name in names:
        if name not in BACKENDS:
            raise UsageError(f"unknown backend {name!r}; choose from {', '.join(BACKENDS)}")
        if name not in available:
            raise UsageError(f"backend {name!r} cannot run on {device}: {_reason(name, device)}")
    if names:
        return list(dict.fromkeys(names)), []
    left_out = [f"  not checked: {name} ({_reason(name, device)})" for name in BACKENDS if name not in available]
    return available, left_out


def _reason(name: str, device) -> str:
    from . import dispatch

    return dispatch.unavailable_reason(name) or dispatch.backend_module(name).device_unsupported_reason(device) or "?"


def _table(backends, device) -> tuple[list[str], bool]:
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
    return lines, all_ok


def main(argv: list[str] | None = None) -> int:
    from .__main__ import UsageError, parse_device

    parser, opts = _parse(argv)
    try:
        device = parse_device(opts.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if device.type == "cpu":
            # Triton kernels execute their real logic on the CPU through the interpreter; set before triton loads.
            os.environ.setdefault("TRITON_INTERPRET", "1")
        backends, left_out = _select(opts.backends, device)
    except UsageError as exc:
        return parser.fail(exc)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"csa_compressor self-check on {device} ({name})")
    for line in left_out:
        print(line)
    lines, all_ok = _table(backends, device)
    print("\n".join(lines))
    print("all backends meet the numerics contract" if all_ok else "CONTRACT VIOLATED (see rows marked NO)")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
