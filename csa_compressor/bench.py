"""Benchmark of the compressor pooling: ``python -m csa_compressor bench``.

Runs the SPEC section 6 case matrix for every available kernel backend and for
two baselines, the eager region and ``torch.compile`` of it, and measures:

- kernel time: the sum of the durations of every device activity (kernels,
  memsets, memcpys) one call causes, from ``torch.profiler`` (as nsys reports
  it), averaged over the profiled calls. "cold" flushes L2 before each call by
  writing a buffer of at least twice the L2 size (the flush itself is excluded);
  "warm" runs the calls back to back.
- wall time of one call: CUDA events around the call with an idle device before
  it, so that host overhead shows; the median is reported. Walls are measured in
  a first pass, before the process's first profiler session (after one, CUPTI's
  callbacks slow every CUDA API call), with the host's own figures: the events
  around nothing and one eager ``x.add_(1)``.
- the DRAM floor: the bytes the operation must move (SPEC section 6) divided by a
  device-to-device copy rate measured in the same run.

Kernel backends are timed per direction ("fwd" = forward wrapper call, "bwd" =
backward wrapper call alone). The baselines are timed as "fwd" and "fwd+bwd"
(forward, then autograd backward), as in SPEC section 6.

Results: a markdown table on stdout, and under ``--out`` (default
``benchmarks/results/``) a JSON list of records (one per case x backend x
direction), the same markdown, and a PNG chart of the achieved fraction of the
floor. Importable: ``run_bench(...)`` returns the records and the markdown.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import hashlib
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "CASES",
    "SPEC_H200",
    "BenchResult",
    "Case",
    "NoGPUError",
    "draw_chart",
    "floor_bytes",
    "floor_us",
    "flush_device_us",
    "format_markdown",
    "main",
    "make_record",
    "parse_case",
    "run_bench",
    "select_cases",
]

KERNEL_BACKENDS = ("cute", "triton", "reference")
BASELINES = ("torch.compile", "eager")
DIRECTIONS = ("fwd", "bwd")
FLUSH_RANGE = "csa_bench.l2_flush"
_FLUSH_KERNEL_HINT = "FillFunctor<double>"  # ATen's kernel for a float64 fill_, which only the flush launches

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "benchmarks" / "results"

# (cold, warm, wall) timed calls per measurement; warm-up calls are extra and untimed.
FULL_REPS = (10, 20, 20)
QUICK_REPS = (3, 5, 5)
WARMUP_CALLS = 3


class NoGPUError(RuntimeError):
    """Raised by ``run_bench`` when no CUDA device is present."""


@dataclass(frozen=True)
class Case:
    """One problem shape: ``B`` sequences of ``seqlen`` tokens, packed THD."""

    seqlens: tuple[int, ...]
    head_dim: int
    ratio: int
    coff: int

    @property
    def name(self) -> str:
        lens = set(self.seqlens)
        body = f"{len(self.seqlens)}x{self.seqlens[0]}" if len(lens) == 1 else "+".join(map(str, self.seqlens))
        return f"{body}-d{self.head_dim}-r{self.ratio}-c{self.coff}"

    @property
    def total_tokens(self) -> int:
        return sum(self.seqlens)

    @property
    def total_comp(self) -> int:
        return sum(s // self.ratio for s in self.seqlens)


CASES: tuple[Case, ...] = (
    Case((8192,), 128, 4, 2),
    Case((8192,) * 3, 128, 4, 2),
    Case((8192,), 512, 4, 2),
    Case((8192,) * 3, 512, 4, 2),
    Case((8192,), 128, 128, 1),
    Case((65536,), 512, 128, 2),
    Case((8192,) * 3, 512, 128, 1),
)

# SPEC section 6: measured on one H200 on 2026-11-30 (one run), microseconds. The "seed_*" columns are the seed's
# own CuTe-DSL kernels with their SM100 gate lifted; they are NOT re-measured by this benchmark, only quoted.
SPEC_H200: dict[str, dict[str, float]] = {
    "1x8192-d128-r4-c2": dict(seed_fwd_cold=6.9, seed_bwd_cold=17.1, seed_wall_fwd=47, seed_wall_bwd=68,
                              compile_fwd=19.5, compile_fwdbwd=52.1, eager_fwd=118, eager_fwdbwd=311),
    "3x8192-d128-r4-c2": dict(seed_fwd_cold=14.3, seed_bwd_cold=27.6, seed_wall_fwd=51, seed_wall_bwd=81,
                              compile_fwd=55.3, compile_fwdbwd=131.6, eager_fwd=255, eager_fwdbwd=659),
    "1x8192-d512-r4-c2": dict(seed_fwd_cold=17.5, seed_bwd_cold=29.6, seed_wall_fwd=51, seed_wall_bwd=84,
                              compile_fwd=68.1, compile_fwdbwd=164.1, eager_fwd=297, eager_fwdbwd=805),
    "3x8192-d512-r4-c2": dict(seed_fwd_cold=43.3, seed_bwd_cold=76.0, seed_wall_fwd=95, seed_wall_bwd=151,
                              compile_fwd=196.7, compile_fwdbwd=476.4, eager_fwd=825, eager_fwdbwd=2228),
    "1x8192-d128-r128-c1": dict(seed_fwd_cold=11.8, seed_bwd_cold=12.7, seed_wall_fwd=50, seed_wall_bwd=75,
                                compile_fwd=10.4, compile_fwdbwd=23.7, eager_fwd=94, eager_fwdbwd=208),
    "1x65536-d512-r128-c2": dict(seed_fwd_cold=98.1, seed_bwd_cold=260.0, seed_wall_fwd=132, seed_wall_bwd=324,
                                 compile_fwd=447.7, compile_fwdbwd=1150, eager_fwd=2564, eager_fwdbwd=6148),
    "3x8192-d512-r128-c1": dict(seed_fwd_cold=28.6, seed_bwd_cold=57.1, seed_wall_fwd=83, seed_wall_bwd=118,
                                compile_fwd=72.9, compile_fwdbwd=179.1, eager_fwd=331, eager_fwdbwd=742),
}  # fmt: skip

_CASE_RE = re.compile(r"^(?P<b>\d+)x(?P<l>\d+)[\s_-]*d(?P<d>\d+)[\s_-]*r(?P<r>\d+)[\s_-]*c(?P<c>\d+)$")


def parse_case(text: str) -> Case:
    """A case from its name, e.g. ``"3x8192-d512-r4-c2"`` (spaces or underscores also separate)."""
    m = _CASE_RE.match(text.strip().lower())
    if m is None:
        raise ValueError(
            f"cannot parse case {text!r}; expected e.g. '3x8192-d512-r4-c2' (B x seqlen, head_dim, ratio, coff)"
        )
    b, seqlen, d, r, c = (int(m[k]) for k in ("b", "l", "d", "r", "c"))
    if b < 1 or seqlen < 1 or d < 1 or r < 1:
        raise ValueError(f"case {text!r}: batch, seqlen, head_dim and ratio must be >= 1")
    if c not in (1, 2):
        raise ValueError(f"case {text!r}: coff must be 1 or 2, got {c}")
    return Case((seqlen,) * b, d, r, c)


def select_cases(tokens: Iterable[str] | None) -> list[Case]:
    """Cases from ``--cases`` tokens: indices into ``CASES`` (0-based, as ``--list`` shows) or case names.

    A name outside the SPEC matrix is accepted too (it has no SPEC reference numbers). ``None``/empty: all cases.
    """
    out: list[Case] = []
    for raw in tokens or ():
        for tok in str(raw).split(","):
            tok = tok.strip()
            if not tok:
                continue
            if tok.isdigit():
                i = int(tok)
                if i >= len(CASES):
                    raise ValueError(f"case index {i} out of range; there are {len(CASES)} cases (0..{len(CASES) - 1})")
                case = CASES[i]
            else:
                case = parse_case(tok)
            if case not in out:
                out.append(case)
    return out or list(CASES)


def select_backends(tokens: Iterable[str] | None, available: Sequence[str]) -> tuple[list[str], list[str]]:
    """``(chosen, skipped_messages)`` from ``--backends`` tokens; ``None``/"all": available kernel backends + baselines.

    Order: kernel backends in ``KERNEL_BACKENDS`` order, then the baselines.
    """
    aliases = {"compile": "torch.compile", "torch_compile": "torch.compile", "inductor": "torch.compile"}
    wanted: list[str] = []
    for raw in tokens or ("all",):
        for tok in str(raw).split(","):
            tok = aliases.get(tok.strip().lower(), tok.strip().lower())
            if not tok:
                continue
            if tok == "all":
                wanted.extend(list(available) + list(BASELINES))
            elif tok in KERNEL_BACKENDS or tok in BASELINES:
                wanted.append(tok)
            else:
                raise ValueError(
                    f"unknown backend {tok!r}; choose from {', '.join(KERNEL_BACKENDS + BASELINES)} or all"
                )
    skipped = [
        f"backend {b!r} is not available on this device (available: {', '.join(available) or 'none'}); skipped"
        for b in dict.fromkeys(wanted)
        if b in KERNEL_BACKENDS and b not in available
    ]
    order = [b for b in KERNEL_BACKENDS if b in available] + list(BASELINES)
    chosen = [b for b in order if b in wanted]
    return chosen, skipped


def select_directions(tokens: Iterable[str] | None) -> list[str]:
    out: list[str] = []
    for raw in tokens or DIRECTIONS:
        for tok in str(raw).split(","):
            tok = tok.strip().lower()
            if not tok:
                continue
            if tok not in DIRECTIONS:
                raise ValueError(f"unknown direction {tok!r}; choose from fwd, bwd")
            if tok not in out:
                out.append(tok)
    return [d for d in DIRECTIONS if d in out]


def measured_direction(backend: str, direction: str) -> str:
    """What a direction means for a backend: baselines time "bwd" as forward plus backward."""
    return "fwd+bwd" if backend in BASELINES and direction == "bwd" else direction


# --------------------------------------------------------------------------------------------------------------------
# Floor arithmetic (SPEC section 6)


def floor_bytes(case: Case, direction: str) -> int:
    """Bytes that must cross DRAM.

    Forward reads kv and score once and writes out: ``2*T*coff*d*2 + N*d*2``. Backward reads kv, score and
    grad_out and writes grad_kv and grad_score: ``4*T*coff*d*2 + N*d*2``. ``"fwd+bwd"`` is their sum.
    T and N are the real token and row counts (no padding); elements are bf16 (2 bytes).
    """
    width = case.coff * case.head_dim
    rows = case.total_comp * case.head_dim * 2
    if direction == "fwd":
        return 2 * case.total_tokens * width * 2 + rows
    if direction == "bwd":
        return 4 * case.total_tokens * width * 2 + rows
    if direction == "fwd+bwd":
        return floor_bytes(case, "fwd") + floor_bytes(case, "bwd")
    raise ValueError(f"unknown direction {direction!r}")


def floor_us(case: Case, direction: str, copy_bytes_per_s: float) -> float:
    """Floor in microseconds at a copy rate counted as read + write bytes per second."""
    if not copy_bytes_per_s > 0:
        raise ValueError(f"copy rate must be positive, got {copy_bytes_per_s}")
    return floor_bytes(case, direction) / copy_bytes_per_s * 1e6


def copy_rate(nbytes: int, seconds: Sequence[float]) -> float:
    """Copy rate in bytes/s from timings of copying ``nbytes`` (read + write = ``2*nbytes`` moved), median."""
    return 2 * nbytes / statistics.median(seconds)


# --------------------------------------------------------------------------------------------------------------------
# Profiler arithmetic (pure, so that it is unit-tested on the CPU)


@dataclass(frozen=True)
class DeviceActivity:
    """One device-side profiler event: a kernel, memset, memcpy or a GPU user annotation span."""

    name: str
    duration_us: float
    is_user_annotation: bool = False


def kernel_us_per_call(activities: Iterable[DeviceActivity], calls: int, flush_us_total: float = 0.0) -> float:
    """Mean device time per call: all device activities except annotation spans, minus the flushes.

    Annotation spans (``record_function`` ranges mirrored on the GPU timeline, "Torch-Compiled Region", ...)
    overlap the kernels they contain, so counting them would double count; the profiler's own table skips
    them the same way.
    """
    if calls <= 0:
        raise ValueError("calls must be positive")
    total = sum(a.duration_us for a in activities if not a.is_user_annotation)
    if flush_us_total > total + 1e-6:
        raise ValueError(f"flush time {flush_us_total:.3f} us exceeds the total device time {total:.3f} us")
    return max(total - flush_us_total, 0.0) / calls


# --------------------------------------------------------------------------------------------------------------------
# Report formatting (pure)


def _fmt_us(x: float | None) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "—"
    return f"{x:.1f}" if x < 1000 else f"{x:.0f}"


def _fmt_ratio(num: float | None, den: float | None) -> str:
    if num is None or den is None or den <= 0 or num <= 0:
        return "—"
    return f"{num / den:.2f}x"


def _index(records: Iterable[dict]) -> dict[tuple[str, str, str], dict]:
    return {(r["case"], r["backend"], r["direction"]): r for r in records}


def _combined(idx: dict, case: str, backend: str) -> dict | None:
    """fwd+bwd of a kernel backend from its fwd and bwd records (sums), or the baseline's measured record."""
    if backend in BASELINES:
        return idx.get((case, backend, "fwd+bwd"))
    f, b = idx.get((case, backend, "fwd")), idx.get((case, backend, "bwd"))
    if f is None or b is None:
        return None
    out = {}
    for key in ("kernel_us_cold", "kernel_us_warm", "wall_us", "floor_us"):
        out[key] = None if f.get(key) is None or b.get(key) is None else f[key] + b[key]
    return out


def _ordered(values: Iterable[str], order: Sequence[str]) -> list[str]:
    vals = list(dict.fromkeys(values))
    return sorted(vals, key=lambda v: (order.index(v) if v in order else len(order), vals.index(v)))


def format_markdown(records: Sequence[dict], meta: dict | None = None) -> str:
    """Markdown report: forward, backward and forward+backward tables with ratios to the floor and speedups.

    ``records`` are the JSON records; ``meta`` (device, date, commit, copy rate, repetitions) heads the report.
    "seed" numbers come from SPEC section 6 (``SPEC_H200``) and are labelled as such.
    """
    meta = meta or {}
    idx = _index(records)
    case_order = [c.name for c in CASES]
    cases = _ordered((r["case"] for r in records), case_order)
    backends = _ordered((r["backend"] for r in records), KERNEL_BACKENDS + BASELINES)
    kernel_backends = [b for b in backends if b in KERNEL_BACKENDS]
    lines: list[str] = []
    if meta:
        lines.append(
            f"Device: {meta.get('device', '?')}; date: {meta.get('date', '?')}; commit: {meta.get('commit')}"
            + (f" (source digest {meta['source_digest']})" if meta.get("source_digest") else "")
        )
        if meta.get("copy_tb_s") is not None:
            lines.append(
                f"Floor = bytes that must move / device-to-device copy rate measured in this run "
                f"({meta['copy_tb_s']:.2f} TB/s, read + write)."
            )
        if meta.get("reps"):
            cold, warm, wall = meta["reps"]
            lines.append(
                f"Kernel time = sum of device activity per call (torch.profiler), mean of {cold} cold "
                f"(L2 flushed) / {warm} warm calls; wall = CUDA events around one call on an idle device, median of "
                f"{wall}, measured before the run's first profiler session. Microseconds."
            )
        host = meta.get("host_wall_us")
        if host:
            lines.append(
                "The same wall on this host: "
                + "; ".join(f"{k} {v:.1f} us" for k, v in host.items())
                + " (the events' own cost, and one eager elementwise op)."
            )
        lines.append(
            '"wall - warm" approximates the host overhead of one call (SPEC 6 target: at most 10 us forward, '
            "15 us backward)."
        )
        lines.append(
            '"seed" columns quote SPEC section 6 (the seed\'s kernels on an H200, measured 2026-11-30); '
            "they are not re-measured here."
        )
        lines.append("")

    def seed(case: str, key: str) -> float | None:
        return SPEC_H200.get(case, {}).get(key)

    def kernel_table(direction: str, title: str, rows_for: list[str], seed_keys: tuple[str, str], with_compile: bool):
        head = ["case", "floor", "backend", "cold", "warm", "wall", "cold / floor"]
        clean = any(r.get("kernel_us_cold_clean") is not None for r in records)
        if clean:
            head += ["cold, clean L2", "clean / floor"]
        if with_compile:
            head.append("vs torch.compile (cold)")
        head += ["seed cold (SPEC)", "vs seed (cold)", "wall - warm", "seed wall (SPEC)"]
        body = []
        for case in cases:
            ref_compile = idx.get((case, "torch.compile", direction))
            for backend in rows_for:
                rec = idx.get((case, backend, direction))
                if rec is None:
                    continue
                cold = rec.get("kernel_us_cold")
                row = [case, _fmt_us(rec.get("floor_us")), backend, _fmt_us(cold), _fmt_us(rec.get("kernel_us_warm")),
                       _fmt_us(rec.get("wall_us")), _fmt_ratio(cold, rec.get("floor_us"))]  # fmt: skip
                if clean:
                    cc = rec.get("kernel_us_cold_clean")
                    row += [_fmt_us(cc), _fmt_ratio(cc, rec.get("floor_us")) if cc is not None else "—"]
                if with_compile:
                    row.append(_fmt_ratio(ref_compile.get("kernel_us_cold") if ref_compile else None, cold))
                s_cold, s_wall = (seed(case, k) for k in seed_keys)
                wall, warm = rec.get("wall_us"), rec.get("kernel_us_warm")
                row += [
                    _fmt_us(s_cold),
                    _fmt_ratio(s_cold, cold) if backend in KERNEL_BACKENDS else "—",
                    _fmt_us(wall - warm) if wall is not None and warm is not None else "—",
                    _fmt_us(s_wall),
                ]
                body.append(row)
        if not body:
            return
        lines.append(f"### {title}")
        lines.append("")
        lines.append("| " + " | ".join(head) + " |")
        lines.append("|" + "---|" * len(head))
        lines.extend("| " + " | ".join(r) + " |" for r in body)
        lines.append("")

    kernel_table("fwd", "Forward", backends, ("seed_fwd_cold", "seed_wall_fwd"), with_compile=True)
    kernel_table(
        "bwd", "Backward (the backward call alone)", kernel_backends, ("seed_bwd_cold", "seed_wall_bwd"), False
    )

    # Forward + backward: kernel backends as the sum of their two calls, baselines as measured.
    head = ["case", "floor", "backend", "cold", "warm", "wall", "cold / floor", "vs torch.compile (cold)",
            "vs eager (cold)", "vs seed (SPEC, cold)"]  # fmt: skip
    body = []
    for case in cases:
        comp = _combined(idx, case, "torch.compile")
        eager = _combined(idx, case, "eager")
        s_f, s_b = seed(case, "seed_fwd_cold"), seed(case, "seed_bwd_cold")
        seed_sum = s_f + s_b if s_f is not None and s_b is not None else None
        for backend in backends:
            rec = _combined(idx, case, backend)
            if rec is None:
                continue
            cold = rec.get("kernel_us_cold")
            body.append([
                case, _fmt_us(rec.get("floor_us")), backend, _fmt_us(cold), _fmt_us(rec.get("kernel_us_warm")),
                _fmt_us(rec.get("wall_us")), _fmt_ratio(cold, rec.get("floor_us")),
                _fmt_ratio(comp.get("kernel_us_cold") if comp else None, cold),
                _fmt_ratio(eager.get("kernel_us_cold") if eager else None, cold),
                _fmt_ratio(seed_sum, cold) if backend in KERNEL_BACKENDS else "—",
            ])  # fmt: skip
    if body:
        lines.append("### Forward + backward (kernel backends: sum of the two calls)")
        lines.append("")
        lines.append("| " + " | ".join(head) + " |")
        lines.append("|" + "---|" * len(head))
        lines.extend("| " + " | ".join(r) + " |" for r in body)
        lines.append("")
    errors = [(r, key) for r in records for key in ("error", "wall_error") if r.get(key)]
    if errors:
        lines.append("### Failed measurements")
        lines.append("")
        lines.extend(
            f"- {r['case']} {r['backend']} {r['direction']}{' (wall)' if key == 'wall_error' else ''}: {r[key]}"
            for r, key in errors
        )
        lines.append("")
    return "\n".join(lines)


def draw_chart(records: Sequence[dict], path: Path) -> str | None:
    """PNG of floor / cold kernel time per case and backend (1.0 = at the floor). Returns a message when skipped."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed; chart skipped (pip install matplotlib)"
    idx = _index(records)
    cases = _ordered((r["case"] for r in records), [c.name for c in CASES])
    backends = _ordered((r["backend"] for r in records), KERNEL_BACKENDS + BASELINES)
    panels = [("forward", "fwd"), ("backward call", "bwd"), ("forward + backward", "fwd+bwd")]
    fig, axes = plt.subplots(1, len(panels), figsize=(13, 3.6), sharey=True)
    width = 0.8 / max(len(backends), 1)
    for ax, (title, direction) in zip(axes, panels, strict=True):
        for i, backend in enumerate(backends):
            vals = []
            for case in cases:
                rec = _combined(idx, case, backend) if direction == "fwd+bwd" else idx.get((case, backend, direction))
                cold = rec.get("kernel_us_cold") if rec else None
                fl = rec.get("floor_us") if rec else None
                vals.append(fl / cold if cold and fl else 0.0)
            if any(vals):
                xs = [k + (i - (len(backends) - 1) / 2) * width for k in range(len(cases))]
                ax.bar(xs, vals, width, label=backend)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.axhline(0.8, color="gray", linewidth=0.8, linestyle="--")
        ax.set_title(title, fontsize=9)
        ax.set_xticks(range(len(cases)))
        ax.set_xticklabels(cases, rotation=35, ha="right", fontsize=7)
        ax.tick_params(axis="y", labelsize=7)
        ax.set_ylim(0, 1.05)
    axes[0].set_ylabel("floor / kernel time (cold)", fontsize=8)
    handles, labels = [], []
    for ax in axes:
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    fig.legend(handles, labels, loc="upper right", fontsize=7, ncol=len(labels))
    fig.suptitle("Achieved fraction of the DRAM floor (dashed: 1/1.25)", fontsize=9, x=0.25)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return None


# --------------------------------------------------------------------------------------------------------------------
# Environment facts


def source_digest(package: Path | None = None) -> str:
    """First 12 hex digits of a SHA-256 over the package's ``.py`` files (relative path and content, in path
    order). Unlike the commit it cannot go stale in a copy of the tree: the same sources give the same digest,
    so a result can be matched to a commit by checking it out and recomputing (``--source-digest``)."""
    package = package or Path(__file__).resolve().parent
    h = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        h.update(path.relative_to(package).as_posix().encode() + b"\0")
        h.update(path.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def git_commit(repo: Path | None = None) -> str | None:
    """``git rev-parse HEAD`` of the checkout holding this package (``-dirty`` if it has changes), or None."""
    repo = repo or Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return None
        commit = head.stdout.strip()
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=repo,
            capture_output=True,
            text=True,
            timeout=10,
        )
        return commit + ("-dirty" if status.returncode == 0 and status.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def versions() -> dict[str, str | None]:
    import torch

    out: dict[str, str | None] = {"torch": torch.__version__, "cuda": torch.version.cuda}
    try:
        import triton

        out["triton"] = triton.__version__
    except Exception:  # a broken triton install should not stop a benchmark of the other backends
        out["triton"] = None
    out["cutlass-dsl"] = None
    try:
        from importlib.metadata import PackageNotFoundError, version

        for dist in ("nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-base"):
            try:
                out["cutlass-dsl"] = version(dist)
                break
            except PackageNotFoundError:
                continue
    except ImportError:
        pass
    if out["cutlass-dsl"] is None and "cutlass" in sys.modules:
        out["cutlass-dsl"] = getattr(sys.modules["cutlass"], "__version__", None)
    out["driver"] = None
    try:
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        if smi.returncode == 0 and smi.stdout.strip():
            out["driver"] = smi.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError):
        pass
    return out


# --------------------------------------------------------------------------------------------------------------------
# Measurement (needs a GPU)


@dataclass
class BenchResult:
    records: list[dict]
    markdown: str
    meta: dict
    paths: dict[str, Path] = field(default_factory=dict)


RECORD_FIELDS = (
    "device", "date", "commit", "versions", "case", "seqlens", "head_dim", "ratio", "coff", "backend", "direction",
    "kernel_us_cold", "kernel_us_warm", "wall_us", "floor_us",
)  # fmt: skip


def make_record(meta: dict, case: Case, backend: str, direction: str, copy_bytes_per_s: float) -> dict:
    """A JSON record with the timings unset (None); extra fields: copy_tb_s, reps, and later note/error."""
    return {
        "device": meta.get("device"),
        "date": meta.get("date"),
        "commit": meta.get("commit"),
        "source_digest": meta.get("source_digest"),
        "versions": meta.get("versions"),
        "case": case.name,
        "seqlens": list(case.seqlens),
        "head_dim": case.head_dim,
        "ratio": case.ratio,
        "coff": case.coff,
        "backend": backend,
        "direction": direction,
        "kernel_us_cold": None,
        "kernel_us_warm": None,
        "wall_us": None,
        "floor_us": floor_us(case, direction, copy_bytes_per_s),
        "copy_tb_s": copy_bytes_per_s / 1e12,
        "reps": meta.get("reps"),
        "host_wall_us": meta.get("host_wall_us"),  # the same wall of events alone and of one eager op, this run
    }


def _short_error(exc: BaseException, limit: int = 300) -> str:
    """``Type: first line of the message`` (truncated), for records and progress lines."""
    first = next((line for line in str(exc).splitlines() if line.strip()), "")
    return f"{type(exc).__name__}: {first[:limit]}".rstrip(": ")


def _progress(enabled: bool, msg: str) -> None:
    if enabled:
        print(msg, file=sys.stderr, flush=True)


def flush_device_us(range_event, skip_names: Iterable[str] = (FLUSH_RANGE,)) -> float:
    """Device time of the kernels launched under one profiler range (a CPU ``FunctionEvent``), recursively.

    The profiler attaches each kernel to the CPU op that launched it (``kernels``) and nests ops under the
    range (``cpu_children``). Entries named like the range itself (its GPU-timeline mirror) are skipped.
    """
    skip = set(skip_names)
    total = 0.0
    stack = [range_event]
    while stack:
        ev = stack.pop()
        total += sum(k.duration for k in getattr(ev, "kernels", ()) if k.name not in skip)
        stack.extend(getattr(ev, "cpu_children", ()))
    return total


def _is_annotation(event) -> bool:
    """True for GPU-timeline mirrors of ``record_function`` ranges (they overlap real kernels)."""
    if getattr(event, "is_user_annotation", False):
        return True
    kind = getattr(event, "activity_type", None)
    return isinstance(kind, str) and "annotation" in kind.lower()


class _Timer:
    """Cold/warm kernel time and wall time of a callable on one CUDA device."""

    def __init__(self, device, reps: tuple[int, int, int]):
        import torch

        self.torch = torch
        self.device = device
        self.reps = reps
        props = torch.cuda.get_device_properties(device)
        l2 = int(getattr(props, "L2_cache_size", 0) or 0)
        # Twice the L2 size and at least 128 MiB. float64 so that the flush kernel is unlike anything the
        # measured code launches.
        self.flush_bytes = max(2 * l2, 128 << 20) if l2 else 128 << 20
        self.flush_buf = torch.empty(self.flush_bytes // 8, dtype=torch.float64, device=device)
        self.read_buf = None
        self._flush_value = 0.0
        self._profiler_primed = False

    def prime_profiler(self) -> None:
        """The process's first profiler session, on the flush alone: it can lose device records while CUPTI
        starts up (seen on the H200: the first case's cold time came out below its warm time)."""
        if not self._profiler_primed:
            self._profiler_primed = True
            self.kernel_us(self.flush, 2, cold=False)

    def flush(self, clean: bool = False) -> None:
        self._flush_value = 1.0 - self._flush_value
        self.flush_buf.fill_(self._flush_value)
        if clean:
            # Then read another 2x-L2 buffer: L2 holds clean lines, so the timed call does not also pay for
            # writing the flush's dirty lines back to DRAM (the plain flush leaves up to one L2 of them).
            if self.read_buf is None:
                self.read_buf = self.torch.ones(self.flush_bytes // 4, dtype=self.torch.float32, device=self.device)
            self.read_buf.sum()

    def copy_rate(self, nbytes: int = 512 << 20, reps: int = 10) -> float:
        """Device-to-device copy rate, bytes/s counting read + write, median over ``reps`` copies."""
        torch = self.torch
        src = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        src.fill_(1)
        dst = torch.empty_like(src)
        for _ in range(3):
            dst.copy_(src)
        times = []
        for _ in range(reps):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            dst.copy_(src)
            e1.record()
            e1.synchronize()
            times.append(e0.elapsed_time(e1) / 1e3)
        del src, dst
        torch.cuda.empty_cache()
        return copy_rate(nbytes, times)

    def kernel_us(self, fn: Callable[[], object], calls: int, cold: bool, clean: bool = False) -> float:
        self.prime_profiler()
        activities, flush_us = self.device_activity(fn, calls, cold, clean)
        return kernel_us_per_call(activities, calls, flush_us)

    def device_activity(
        self, fn: Callable[[], object], calls: int, cold: bool, clean: bool = False
    ) -> tuple[list[DeviceActivity], float]:
        """The device activities of ``calls`` calls of ``fn`` (``cold``: each after the L2 flush) and the flushes'
        total device time within them."""
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile, record_function

        torch = self.torch
        if cold and clean and self.read_buf is None:
            # The clean flush's first use (its read buffer's allocation and fill, the reduction's first launch)
            # happens outside the profile: inside it, the first clean case of a run measured a flush longer
            # than the whole profile (T1909Z, T2051Z, T2057Z) and lost its clean time.
            self.flush(clean=True)
        torch.cuda.synchronize(self.device)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                if cold:
                    with record_function(FLUSH_RANGE):
                        self.flush(clean)
                fn()
            torch.cuda.synchronize(self.device)
        events = list(prof.events())
        # Names of CPU-side ranges (record_function, "Torch-Compiled Region", ...): a device event with one of
        # these names is the range mirrored on the GPU timeline, not work.
        range_names = {e.name for e in events if e.device_type != DeviceType.CUDA and _is_annotation(e)}
        range_names.add(FLUSH_RANGE)
        activities = []
        flush_us = 0.0
        for e in events:
            if e.device_type == DeviceType.CUDA:
                annotation = _is_annotation(e) or e.name in range_names
                activities.append(DeviceActivity(e.name, e.time_range.elapsed_us(), annotation))
            elif cold and e.name == FLUSH_RANGE:
                flush_us += flush_device_us(e)
        if not activities:
            raise RuntimeError("the profiler recorded no device activity (is CUPTI available?)")
        if cold and flush_us <= 0:
            # Fallback when the profiler did not attach kernels to the range: the flush is the only float64 fill.
            fills = [a for a in activities if not a.is_user_annotation and _FLUSH_KERNEL_HINT in a.name]
            if len(fills) != calls:
                raise RuntimeError("could not find the L2 flush kernels in the profile; cold time would include them")
            flush_us = sum(a.duration_us for a in fills)
        return activities, flush_us

    def wall_us(self, fn: Callable[[], object], calls: int) -> float:
        """Median of CUDA-event time around one call, the device idle before it (host overhead shows).

        ``run_bench`` measures every wall before the process's first profiler session: after one, CUPTI's callbacks
        stay on every CUDA API call (kineto does not tear CUPTI down by default) and the same calls measured
        +3-10 us on the H200 machine (``benchmarks/wall_profiler_probe.py``, events alone 7.1 -> 9.7 us, the cute
        1x8192 d128 r4 c2 backward 24.0 -> 32.2 us)."""
        torch = self.torch
        pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(calls)]
        for e0, e1 in pairs:
            torch.cuda.synchronize(self.device)
            e0.record()
            fn()
            e1.record()
        torch.cuda.synchronize(self.device)
        return statistics.median(e0.elapsed_time(e1) * 1e3 for e0, e1 in pairs)

    def warm_up(self, fn: Callable[[], object]) -> None:
        for _ in range(WARMUP_CALLS):
            fn()
        self.torch.cuda.synchronize(self.device)

    def kernel_times(self, fn: Callable[[], object]) -> tuple[float, float]:
        """(cold, warm) kernel us per call; profiler sessions (see ``wall_us`` for why those come first)."""
        cold, warm, _ = self.reps
        self.warm_up(fn)
        return self.kernel_us(fn, cold, cold=True), self.kernel_us(fn, warm, cold=False)


def _kernel_callables(backend: str, pack, case: Case):
    """fwd and bwd as autograd runs them: long windows (``uses_softmax_stats``) save the softmax statistics
    in the forward and hand them to the backward."""
    from . import api

    kw = dict(ratio=case.ratio, head_dim=case.head_dim, coff=case.coff, total_comp=pack.total_comp, backend=backend)
    inputs = (pack.kv, pack.score, pack.ape, pack.cu_seqlens, pack.cu_seqlens_comp)
    stats = api.autograd_uses_stats(pack.kv, case.ratio, case.coff, backend)
    saved = (
        api.csa_compressor_forward_wrapper(*inputs, return_softmax_stats=True, **kw)["softmax_stats"] if stats else None
    )

    def fwd():
        return api.csa_compressor_forward_wrapper(*inputs, return_softmax_stats=stats, **kw)

    def bwd():
        return api.csa_compressor_backward_wrapper(*inputs, pack.grad_out, softmax_stats=saved, **kw)

    return {"fwd": fwd, "bwd": bwd}


def _baseline_callables(backend: str, pack, case: Case, progress: bool):
    """fwd and fwd+bwd callables of the eager region or its torch.compile, plus a note (compile mode)."""
    import torch

    from .reference import eager_region

    ratio, coff, total_comp = case.ratio, case.coff, pack.total_comp

    def region(kv, score, ape, cu_seqlens, cu_seqlens_comp):
        return eager_region(kv, score, ape, cu_seqlens, cu_seqlens_comp, ratio=ratio, coff=coff, total_comp=total_comp)

    inputs = (pack.kv, pack.score, pack.ape)
    leaves = tuple(t.detach().clone().requires_grad_(True) for t in inputs)
    offsets = (pack.cu_seqlens, pack.cu_seqlens_comp)
    grad_out = pack.grad_out

    def make(f):
        def fwd():
            with torch.no_grad():
                return f(*inputs, *offsets)

        def fwd_bwd():
            out = f(*leaves, *offsets)
            return torch.autograd.grad(out, leaves, grad_out)

        return {"fwd": fwd, "fwd+bwd": fwd_bwd}

    if backend == "eager":
        return make(region), None

    # Fresh dynamo state per case: recompiles across cases would otherwise hit the recompile limit and fall
    # back to eager silently. Static shapes, as a training step with fixed sizes would compile.
    notes = []
    for fullgraph in (True, False):
        torch._dynamo.reset()
        compiled = torch.compile(region, fullgraph=fullgraph, dynamic=False)
        calls = make(compiled)
        t0 = time.perf_counter()
        try:
            for fn in calls.values():
                fn()
            torch.cuda.synchronize()
        except Exception as exc:  # fullgraph may fail on some torch versions; the default mode is the fallback
            notes.append(f"fullgraph={fullgraph} failed: {_short_error(exc, 200)}")
            if not fullgraph:
                raise
            continue
        mode = "fullgraph" if fullgraph else "default (fullgraph failed)"
        _progress(progress, f"    torch.compile ({mode}) compiled in {time.perf_counter() - t0:.1f} s")
        return calls, "; ".join([f"torch.compile {mode}", *notes])
    raise AssertionError("unreachable")


def run_bench(
    cases: Iterable[str] | Sequence[Case] | None = None,
    backends: Iterable[str] | None = None,
    directions: Iterable[str] | None = None,
    *,
    quick: bool = False,
    reps: tuple[int, int, int] | None = None,
    out_dir: str | os.PathLike | None = DEFAULT_OUT,
    name: str | None = None,
    progress: bool = True,
    device=None,
    commit: str | None = None,
    clean_cold: bool = False,
) -> BenchResult:
    """Run the benchmark; returns the records, the markdown report and, if ``out_dir`` is set, the written paths.

    ``cases``: case names / indices (see ``CASES``) or ``Case`` objects; default all. ``backends``: names among
    cute, triton, reference, torch.compile, eager (default all available). ``directions``: "fwd", "bwd" (for
    the baselines "bwd" means forward+backward). ``reps``: (cold, warm, wall) timed calls per measurement.
    ``commit`` overrides ``git rev-parse HEAD`` (for copies of the tree without ``.git``). ``clean_cold``: also
    time the kernel backends cold after a flush that leaves L2 clean (``kernel_us_cold_clean``).
    Raises ``NoGPUError`` without a CUDA device.
    """
    import torch

    if not torch.cuda.is_available():
        raise NoGPUError("no CUDA device is available")
    device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    torch.cuda.set_device(device)

    from .dispatch import available_backends
    from .testing import make_pack

    cases = list(cases) if cases is not None else None
    case_list = cases if cases and all(isinstance(c, Case) for c in cases) else select_cases(cases)
    backend_list, skipped = select_backends(backends, available_backends(device))
    for msg in skipped:
        _progress(True, f"warning: {msg}")
    direction_list = select_directions(directions)
    reps = tuple(reps) if reps is not None else (QUICK_REPS if quick else FULL_REPS)

    props = torch.cuda.get_device_properties(device)
    timer = _Timer(device, reps)
    t_start = time.perf_counter()
    rate = timer.copy_rate(reps=5 if quick else 10)
    meta = {
        "device": f"{props.name} (sm_{props.major}{props.minor})",
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit or git_commit(),
        "source_digest": source_digest(),
        "versions": versions(),
        "copy_tb_s": rate / 1e12,
        "reps": list(reps),
        "l2_flush_bytes": timer.flush_bytes,
    }
    _progress(progress, f"device {meta['device']}, copy rate {rate / 1e12:.2f} TB/s (read + write), reps {reps}")

    def each_call():
        """``(case, backend, direction, callable or None, note, setup error)`` over the matrix, one pack alive at a
        time (both passes build the same packs and callables: seed 0)."""
        for case in case_list:
            pack = make_pack(case.seqlens, case.head_dim, case.ratio, case.coff, device=device, seed=0)
            for backend in backend_list:
                calls, note, setup_error = {}, None, None
                try:
                    if backend in BASELINES:
                        calls, note = _baseline_callables(backend, pack, case, progress)
                    else:
                        calls = _kernel_callables(backend, pack, case)
                except Exception as exc:  # one broken backend must not lose the rest of the run
                    setup_error = _short_error(exc)
                for direction in direction_list:
                    what = measured_direction(backend, direction)
                    yield case, backend, what, calls.get(what), note, setup_error
                del calls
            del pack
            torch.cuda.empty_cache()

    # Pass 1, walls: before any profiler session in this process (``_Timer.wall_us`` says why); the host's own
    # figures first: the two events around nothing (what the method costs here) and one eager elementwise op.
    walls: dict[tuple[str, str, str], float | str] = {}  # the wall, or why it failed
    x = torch.zeros(1, device=device)
    meta["host_wall_us"] = {
        "events only": timer.wall_us(lambda: None, 50),
        "x.add_(1)": timer.wall_us(lambda: x.add_(1), 50),
    }
    host_walls = ", ".join(f"{k} {v:.1f} us" for k, v in meta["host_wall_us"].items())
    _progress(progress, f"walls (before any profiler session): {host_walls}")
    for case, backend, what, fn, _, setup_error in each_call():
        if setup_error or fn is None:
            continue  # pass 2 records the error
        try:
            timer.warm_up(fn)
            walls[(case.name, backend, what)] = timer.wall_us(fn, reps[2])
        except Exception as exc:  # recorded with the call's kernel times in pass 2
            walls[(case.name, backend, what)] = _short_error(exc)
    _progress(progress, f"walls measured ({time.perf_counter() - t_start:.0f} s total)")

    # Pass 2, kernel times (profiler).
    records: list[dict] = []
    total = len(case_list) * len(backend_list) * len(direction_list)
    for done, (case, backend, what, fn, note, setup_error) in enumerate(each_call(), 1):
        rec = make_record(meta, case, backend, what, rate)
        if note:
            rec["note"] = note
        t0 = time.perf_counter()
        try:
            if setup_error:
                raise RuntimeError(setup_error)
            if fn is None:
                raise RuntimeError(f"{backend} has no {what} callable")
            cold, warm = timer.kernel_times(fn)
            wall = walls.get((case.name, backend, what), "not measured")
            if isinstance(wall, str):
                rec["wall_error"], wall = wall, None
            rec.update(kernel_us_cold=cold, kernel_us_warm=warm, wall_us=wall)
            if clean_cold and backend not in BASELINES:
                try:  # an extra figure: its failure leaves the measured ones standing
                    rec["kernel_us_cold_clean"] = timer.kernel_us(fn, reps[0], cold=True, clean=True)
                except Exception as exc:
                    rec["clean_error"] = _short_error(exc)
            status = (
                f"cold {cold:.1f} us, warm {warm:.1f} us, "
                + (f"wall {wall:.1f} us, " if wall is not None else f"wall failed ({rec['wall_error']}), ")
                + f"floor {rec['floor_us']:.1f} us ({rec['floor_us'] / cold:.2f} of floor)"
            )
        except Exception as exc:  # record the failure and keep going
            rec["error"] = _short_error(exc)
            status = f"FAILED: {rec['error']}"
        records.append(rec)
        _progress(
            progress,
            f"[{done}/{total}] {case.name} {backend} {what}: {status} "
            f"({time.perf_counter() - t0:.1f} s, {time.perf_counter() - t_start:.0f} s total)",
        )

    meta["elapsed_s"] = round(time.perf_counter() - t_start, 1)
    markdown = format_markdown(records, meta)
    result = BenchResult(records=records, markdown=markdown, meta=meta)
    if out_dir is not None:
        result.paths = write_outputs(result, Path(out_dir), name or default_name(props.name, meta["date"]))
    return result


def default_name(device_name: str, date_iso: str) -> str:
    """File stem for a run, e.g. ``bench_nvidia-h200_20261130T1412Z``."""
    slug = re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-") or "gpu"
    stamp = re.sub(r"[^0-9T]", "", date_iso.split("+")[0])[:13]
    return f"bench_{slug}_{stamp}Z"


def write_outputs(result: BenchResult, out_dir: Path, stem: str) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / f"{stem}.json", "markdown": out_dir / f"{stem}.md", "chart": out_dir / f"{stem}.png"}
    paths["json"].write_text(json.dumps(result.records, indent=1) + "\n")
    paths["markdown"].write_text(result.markdown + "\n")
    msg = draw_chart(result.records, paths["chart"])
    if msg:
        print(msg, file=sys.stderr)
        del paths["chart"]
    return paths


# --------------------------------------------------------------------------------------------------------------------
# Command line


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m csa_compressor bench",
        description="Benchmark the compressor pooling kernels against the eager region and torch.compile "
        "(SPEC section 6 case matrix). Needs a CUDA GPU.",
    )
    p.add_argument("--cases", nargs="*", help="case names (e.g. 3x8192-d512-r4-c2) or 0-based indices; default all")
    p.add_argument(
        "--backends",
        nargs="*",
        help="among cute, triton, reference, torch.compile, eager, all (default: all available)",
    )
    p.add_argument("--directions", nargs="*", help="fwd and/or bwd (baselines: bwd = forward+backward); default both")
    p.add_argument("--quick", action="store_true", help="3 cold / 5 warm / 5 wall calls instead of 10 / 20 / 20")
    p.add_argument("--reps", type=int, nargs=3, metavar=("COLD", "WARM", "WALL"), help="timed calls per measurement")
    p.add_argument("--out", default=str(DEFAULT_OUT), help="directory for JSON, markdown and PNG (default %(default)s)")
    p.add_argument("--no-write", action="store_true", help="print the table only, write no files")
    p.add_argument("--name", help="file stem of the outputs (default bench_<device>_<UTC time>)")
    p.add_argument("--commit", help="commit id to record when the tree has no .git (default: git rev-parse HEAD)")
    p.add_argument("--list", action="store_true", help="list the cases and exit")
    p.add_argument(
        "--source-digest",
        action="store_true",
        help="print the package's source digest (recorded by every run) and exit",
    )
    p.add_argument(
        "--clean-cold",
        action="store_true",
        help="also time kernel backends cold after a flush that leaves L2 clean (write, then read 2x L2)",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.source_digest:
        print(source_digest())
        return 0
    if args.list:
        for i, case in enumerate(CASES):
            print(f"{i}: {case.name}  (T={case.total_tokens}, N={case.total_comp})")
        return 0
    try:
        # Validate the selections before touching the GPU so that typos fail fast and identically everywhere.
        select_cases(args.cases)
        select_directions(args.directions)
        select_backends(args.backends, KERNEL_BACKENDS)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        print("csa_compressor bench: no CUDA GPU found. The benchmark times CUDA kernels with the CUDA profiler and")
        print("needs a GPU; nothing was measured. (On a CPU, `python -m csa_compressor` runs the self-check.)")
        return 0
    try:
        result = run_bench(
            args.cases,
            args.backends,
            args.directions,
            quick=args.quick,
            reps=tuple(args.reps) if args.reps else None,
            out_dir=None if args.no_write else args.out,
            name=args.name,
            progress=not args.quiet,
            commit=args.commit,
            clean_cold=args.clean_cold,
        )
    except NoGPUError as exc:
        print(f"csa_compressor bench: {exc}; nothing was measured.")
        return 0
    print(result.markdown)
    for kind, path in result.paths.items():
        print(f"wrote {kind}: {path}", file=sys.stderr)
    return 1 if any(r.get("error") for r in result.records) else 0


if __name__ == "__main__":
    sys.exit(main())
