"""``python -m csa_compressor bench``: the command line of the bench."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from ..__main__ import CommandParser, UsageError, parse_device, positive_float, positive_int
from .cases import CASES, KERNEL_BACKENDS, TAIL_MODES, select_backends, select_cases, select_directions
from .env import source_digest
from .run import FULL_REPS, QUICK_REPS, Method, run_bench

__all__ = ["DEFAULT_OUT", "build_parser", "main"]

DEFAULT_OUT = Path("csa_compressor_bench")

_DESCRIPTION = """\
Time the fused compressor-pooling kernels on this GPU and compare them with PyTorch.

For each case of the DeepSeek-V4 matrix (--list) and each backend it measures the forward and the
backward call: kernel time with L2 flushed ("cold") and in L2 ("warm"), the wall time a caller
waits for one call, and the host time per call; beside them the eager PyTorch region and
torch.compile of it. With the tail (--tail on, the default) every case is timed again with RMSNorm
and RoPE applied to the output: fused into our kernels where the installed API has them, against our
pooling followed by PyTorch's RMSNorm and RoPE, and against torch.compile of the whole chain.

Writes a markdown report (also printed), the JSON records and a PNG chart (ours, cudnn-frontend's
published kernels and torch.compile, relative to the DRAM floor) to ./csa_compressor_bench/ or --out.
Needs a CUDA GPU; a full run takes several minutes, most of it compiling the torch.compile baselines.
Exit status: 0 when every measurement ran, 1 when some failed (listed in the report), 2 on a usage error."""


def build_parser() -> argparse.ArgumentParser:
    p = CommandParser(
        prog="python -m csa_compressor bench", description=_DESCRIPTION, formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--cases", nargs="*", help="case names (e.g. 3x8192-d512-r4-c2) or indices from --list; default all")
    p.add_argument(
        "--tail",
        choices=TAIL_MODES,
        default="on",
        help="the cases with the RMSNorm + RoPE tail too (on, default), not (off), alone (only)",
    )
    p.add_argument(
        "--backends",
        nargs="*",
        help="cute, triton, reference, torch.compile, eager or all\n(default: the GPU backends and the two baselines)",
    )
    p.add_argument("--directions", nargs="*", help="fwd and/or bwd (for the PyTorch baselines bwd = fwd+bwd)")
    p.add_argument("--device", default="cuda", help="CUDA device (default: the current one)")
    quick = "{} cold / {} warm / {} wall calls instead of {} / {} / {}".format(*QUICK_REPS, *FULL_REPS)
    p.add_argument("--quick", action="store_true", help=quick)
    p.add_argument("--reps", type=positive_int, nargs=3, metavar=("COLD", "WARM", "WALL"), help="timed calls each")
    p.add_argument("--budget-s", type=positive_float, help="start no new measurement after this many seconds")
    p.add_argument("--out", default=str(DEFAULT_OUT), help="folder for the report files (default ./%(default)s)")
    p.add_argument("--name", help="file stem of the report files (default bench_<device>_<UTC time>)")
    p.add_argument("--no-write", action="store_true", help="print the report only, write no files")
    p.add_argument("--commit", help="commit id to record when the tree has no .git")
    p.add_argument("--clean-cold", action="store_true", help="also time kernels cold after a flush leaving L2 clean")
    p.add_argument(
        "--timing-probe",
        action="store_true",
        help="also time every call unqueued (each call's kernels may start on an idle\n"
        "device) and after the device idled: what separates warm from cold times",
    )
    p.add_argument(
        "--compile-only",
        action="store_true",
        help="build and call every row once, time nothing: fills the compile caches\non disk for a later run",
    )
    p.add_argument(
        "--from-json",
        metavar="FILE",
        help="render the report and chart of a recorded run again (next to FILE; no GPU)",
    )
    p.add_argument(
        "--host-only",
        action="store_true",
        help="no GPU: Python microseconds, launches and aten operations per call of the\n"
        "wrappers (fwd, bwd) and compressor_pool (pool) for triton and cute on CPU\n"
        "tensors, the device launches stubbed (csa_compressor.bench.host); prints a table\n"
        "(--cases, --tail and --backends select)",
    )
    p.add_argument("--list", action="store_true", help="list the cases and exit")
    p.add_argument("--source-digest", action="store_true", help="print the package's source digest and exit")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")
    return p


def _listing() -> str:
    lines = [f"{i}: {c.name}  (T={c.total_tokens}, N={c.total_comp})" for i, c in enumerate(CASES)]
    lines.append("each also with -tail: RMSNorm over head_dim, then RoPE on the last 64 columns (--tail)")
    return "\n".join(lines)


def _check_backends(tokens, device) -> list[str]:
    """The chosen backends; an explicitly named one that cannot run on ``device`` is a UsageError with the reason."""
    from .. import dispatch

    chosen, unavailable = select_backends(tokens, dispatch.available_backends(device))
    for name in unavailable:
        reason = dispatch.unavailable_reason(name) or dispatch.backend_module(name).device_unsupported_reason(device)
        raise UsageError(f"backend {name!r} cannot run on {device}: {reason}")
    return chosen


def _render(path: Path) -> int:
    """The markdown and the chart of a JSON record, written beside it (``bench_latest.json`` -> ``.md``, ``.png``)."""
    import json

    from .report import expand_records, format_markdown, meta_of
    from .run import BenchResult, write_outputs

    records = expand_records(json.loads(path.read_text()))
    result = BenchResult(records=records, markdown=format_markdown(records, meta_of(records)), meta={})
    for kind, out in write_outputs(result, path.parent, path.stem, records_too=False).items():
        print(f"wrote {kind}: {out}", file=sys.stderr)
    return 0


def _check_out(path: str) -> Path:
    out = Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"cannot write to --out {path!r}: {exc.strerror or exc}") from None
    return out


def _validate(args):
    """Everything that can be wrong with the command line, before anything is measured."""
    select_cases(args.cases, args.tail)
    select_directions(args.directions)
    select_backends(args.backends, KERNEL_BACKENDS)  # the names; what can run here once the device is known
    import torch

    if not torch.cuda.is_available():
        raise UsageError("needs a CUDA GPU and this machine has none (`python -m csa_compressor` runs the self-check)")
    device = parse_device(args.device)
    if device.type != "cuda":
        raise UsageError(f"the bench times CUDA kernels; --device {args.device!r} is not a CUDA device")
    backends = _check_backends(args.backends, device)
    out = None if args.no_write or args.compile_only else _check_out(args.out)
    return device, backends, out


def _host_only(args, parser) -> int:
    """``--host-only``: the cases chosen (``--tail`` as for the bench), triton and cute unless ``--backends`` names
    one of them."""
    from .host import format_host_table, host_costs

    try:
        cases = select_cases(args.cases, args.tail)
        wanted = [b for b in select_backends(args.backends, KERNEL_BACKENDS)[0] if b in ("triton", "cute")]
    except ValueError as exc:
        return parser.fail(exc)
    print(format_host_table(host_costs(cases, wanted or ("triton", "cute"))))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.source_digest:
        print(source_digest())
        return 0
    if args.list:
        print(_listing())
        return 0
    if args.from_json:
        try:
            return _render(Path(args.from_json))
        except (OSError, ValueError, KeyError) as exc:
            return parser.fail(UsageError(f"cannot render {args.from_json!r}: {exc}"))
    if args.host_only:
        return _host_only(args, parser)
    try:
        device, backends, out = _validate(args)
    except (ValueError, UsageError) as exc:
        return parser.fail(exc)
    reps = tuple(args.reps) if args.reps else (QUICK_REPS if args.quick else FULL_REPS)
    method = Method(reps, args.clean_cold, args.timing_probe, args.budget_s, args.compile_only)
    result = run_bench(
        args.cases, backends, args.directions, tail=args.tail, method=method, quick=args.quick, out_dir=out,
        name=args.name, progress=not args.quiet, device=device, commit=args.commit,
    )  # fmt: skip
    if result.markdown:
        print(result.markdown)
    for kind, path in result.paths.items():
        print(f"wrote {kind}: {path}", file=sys.stderr)
    return 1 if any(r.get("error") for r in result.records) else 0
