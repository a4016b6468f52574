"""The bench's records (one JSON object per case x backend x direction) and its markdown report."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from .cases import CASES, CUDNN_FRONTEND_H200, KERNEL_BACKENDS, TORCH_TAIL, Case, floor_us, is_baseline

__all__ = [
    "RECORD_FIELDS",
    "combined",
    "compact_records",
    "expand_records",
    "format_markdown",
    "make_record",
    "meta_of",
    "ours_backend",
]

RECORD_FIELDS = (
    "device", "date", "commit", "versions", "case", "seqlens", "head_dim", "ratio", "coff", "tail", "rope_dim",
    "backend", "direction", "kernel_us_cold", "kernel_us_warm", "wall_us", "host_us", "floor_us",
)  # fmt: skip
_SUMMED = ("kernel_us_cold", "kernel_us_warm", "wall_us", "host_us", "floor_us")
# Targets of the fused tail: its forward and backward against the pooling-only kernels of the same case.
TAIL_TARGETS = {"fwd": 1.05, "bwd": 1.10}
# Optional per-record figures of --timing-probe, in the order the probe table shows them.
PROBE_FIELDS = (
    ("kernel_us_cold", "cold"),
    ("kernel_us_cold_unqueued", "cold unqueued"),
    ("kernel_us_warm", "warm"),
    ("kernel_us_warm_unqueued", "warm unqueued"),
    ("kernel_us_warm_after_idle", "warm after idle"),
    ("kernel_us_warm_after_spin", "warm after spin"),
    ("idle_us_cold_unqueued", "idle / call, cold unqueued"),
    ("idle_us_warm_unqueued", "idle / call, warm unqueued"),
)


def make_record(meta: dict, case: Case, backend: str, direction: str, copy_bytes_per_s: float) -> dict:
    """A JSON record with the timings unset (None); later: note, error, wall_error, skipped and optional figures."""
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
        "tail": case.tail,
        "rope_dim": case.rope_dim,
        "backend": backend,
        "direction": direction,
        "kernel_us_cold": None,
        "kernel_us_warm": None,
        "wall_us": None,
        "host_us": None,
        "floor_us": floor_us(case, direction, copy_bytes_per_s),
        "copy_tb_s": copy_bytes_per_s / 1e12,
        "reps": meta.get("reps"),
        "timer": meta.get("timer"),
        "host_wall_us": meta.get("host_wall_us"),  # the same wall of events alone and of one eager op, this run
        **({"spin_wakeup_us": meta["spin_wakeup_us"]} if meta.get("spin_wakeup_us") else {}),
    }


# The compact JSON form of a record: each run's facts once ("runs", by id), each case's shape once ("cases", by
# name; a case whose records disagree stays in its rows), and rows of the rest, each naming its run.
RUN_FIELDS = (
    "device", "date", "commit", "source_digest", "versions", "copy_tb_s", "reps", "timer", "host_wall_us",
    "spin_wakeup_us",
)  # fmt: skip
CASE_FIELDS = ("seqlens", "head_dim", "ratio", "coff", "tail", "rope_dim")
# The key order of make_record, which expand_records restores (keys after these keep their row's order).
_KEY_ORDER = tuple(make_record({"spin_wakeup_us": 1.0}, CASES[0], "", "fwd", 1.0))


def _run_id(run: dict, taken: dict) -> str:
    """The run's UTC minute (``20261130T1412Z``), with a suffix where two runs share it."""
    date = str(run.get("date") or "")
    stamp = "".join(c for c in date.split("+")[0] if c.isdigit() or c == "T")[:13]
    base = name = stamp + "Z" if stamp else "run"
    suffix = 1
    while name in taken:
        suffix += 1
        name = f"{base}-{suffix}"
    return name


def compact_records(records: Sequence[dict]) -> dict:
    """``{"runs": {id: facts}, "cases": {name: shape}, "rows": [...]}``; ``expand_records`` gives ``records`` back."""
    runs: dict[str, dict] = {}
    shapes: dict[str, dict | None] = {}
    for rec in records:
        shape = {k: rec[k] for k in CASE_FIELDS if k in rec}
        if "case" in rec and shapes.setdefault(rec["case"], shape) != shape:
            shapes[rec["case"]] = None  # records of one name with different shapes: each row keeps its own
    cases = {name: shape for name, shape in shapes.items() if shape}
    rows = []
    for rec in records:
        run = {k: rec[k] for k in RUN_FIELDS if k in rec}
        run_id = next((i for i, r in runs.items() if r == run), None) or _run_id(run, runs)
        runs.setdefault(run_id, run)
        shared = set(run) | (set(cases.get(rec.get("case"), ())))
        rows.append({"run": run_id, **{k: v for k, v in rec.items() if k not in shared}})
    return {"runs": runs, "cases": cases, "rows": rows}


def expand_records(data: list | dict) -> list[dict]:
    """The records of a JSON record in either form: a list of records (older runs), or ``compact_records``'s."""
    if isinstance(data, list):
        return data
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
        raise ValueError("a bench record is a list of records or an object with runs and rows")
    runs, cases = data.get("runs", {}), data.get("cases", {})
    records = []
    for row in data["rows"]:
        rest = {k: v for k, v in row.items() if k != "run"}
        merged = {**runs[row["run"]], **cases.get(row.get("case"), {}), **rest}
        head = {k: merged[k] for k in _KEY_ORDER if k in merged}
        records.append({**head, **{k: v for k, v in merged.items() if k not in head}})
    return records


def meta_of(records: Sequence[dict]) -> dict:
    """The run's facts as the records carry them (to render a report again from a JSON record)."""
    first = records[0] if records else {}
    keys = ("device", "date", "commit", "source_digest", "copy_tb_s", "reps", "timer", "host_wall_us", "spin_wakeup_us")
    return {k: first[k] for k in keys if first.get(k) is not None}


# --------------------------------------------------------------------------------------------------------------------
# Lookups


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


def combined(idx: dict, case: str, backend: str) -> dict | None:
    """fwd+bwd of a kernel backend from its fwd and bwd records (sums), or the baseline's measured record."""
    if is_baseline(backend):
        return idx.get((case, backend, "fwd+bwd"))
    f, b = idx.get((case, backend, "fwd")), idx.get((case, backend, "bwd"))
    if f is None or b is None:
        return None
    return {key: None if f.get(key) is None or b.get(key) is None else f[key] + b[key] for key in _SUMMED}


def _value(idx: dict, case: str, backend: str, direction: str, key: str = "kernel_us_cold") -> float | None:
    """The record's ``key`` (its cold kernel time unless named); ``fwd+bwd`` of a kernel backend sums its two calls."""
    rec = combined(idx, case, backend) if direction == "fwd+bwd" else idx.get((case, backend, direction))
    return rec.get(key) if rec else None


def ordered(values: Iterable[str], order: Sequence[str]) -> list[str]:
    vals = list(dict.fromkeys(values))
    return sorted(vals, key=lambda v: (order.index(v) if v in order else len(order), vals.index(v)))


def backend_order() -> list[str]:
    kernels = [b for b in KERNEL_BACKENDS if b != "reference"]
    return [*KERNEL_BACKENDS, *(b + TORCH_TAIL for b in kernels), "torch.compile", "eager"]


def case_order(records: Iterable[dict]) -> list[str]:
    names = [c.name for c in CASES]
    return ordered((r["case"] for r in records), names + [n + "-tail" for n in names])


def cudnn_frontend(case: str, direction: str) -> float | None:
    """cudnn-frontend's quoted cold kernel time of a pooling case (fwd, bwd, or their sum)."""
    fig = CUDNN_FRONTEND_H200.get(case)
    if fig is None:
        return None
    return fig["fwd"] + fig["bwd"] if direction == "fwd+bwd" else fig.get(direction)


def ours_backend(records: Iterable[dict]) -> str | None:
    """The fastest measured GPU backend of the record: cute, else triton."""
    present = {r["backend"] for r in records if r.get("kernel_us_cold") is not None}
    return next((b for b in ("cute", "triton") if b in present), None)


def _table(lines: list[str], title: str, head: Sequence[str], body: Sequence[Sequence[str]]) -> None:
    if not body:
        return
    lines += [f"### {title}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(row) + " |" for row in body]
    lines.append("")


# --------------------------------------------------------------------------------------------------------------------
# Sections


def _header(meta: dict) -> list[str]:
    lines = [
        f"Device: {meta.get('device', '?')}; date: {meta.get('date', '?')}; commit: {meta.get('commit')}"
        + (f" (source digest {meta['source_digest']})" if meta.get("source_digest") else "")
    ]
    if meta.get("copy_tb_s") is not None:
        lines.append(
            f"Floor = bytes that must move / device-to-device copy rate measured in this run "
            f"({meta['copy_tb_s']:.2f} TB/s, read + write)."
        )
    if meta.get("reps"):
        cold, warm, wall = meta["reps"]
        # Records of the earlier method carry no "timer": their calls were timed as the host issued them.
        queued = "queued behind other device work" if meta.get("timer") == "queued" else "unqueued"
        lines.append(
            f"Kernel time = device time per call (torch.profiler), mean of {cold} cold (L2 flushed) / {warm} warm "
            f"calls, {queued}; wall = CUDA events around one call on an idle device, median of {wall}, and host = "
            "the caller's time per call back to back, both measured before the run's first profiler session. "
            "Microseconds."
        )
    if meta.get("sm_clock_mhz"):
        clocks = " / ".join(f"{mhz:.0f}" for mhz in meta["sm_clock_mhz"])
        lines.append(f"SM clock under a spin kernel at the start / end of the run: {clocks} MHz.")
    wake = meta.get("spin_wakeup_us")
    if wake:
        lines.append(
            f"Timing probe: one short spin kernel takes {wake['after idle']:.2f} us (CUDA events) on a device idle "
            f"before it and {wake['queued']:.2f} us queued behind another."
        )
    host = meta.get("host_wall_us")
    if host:
        lines.append(
            "The same wall on this host: "
            + "; ".join(f"{k} {v:.1f} us" for k, v in host.items())
            + " (the events' own cost, and one eager elementwise op)."
        )
    lines.append(
        '"cudnn-frontend" columns quote cudnn-frontend 1.32\'s CuTe-DSL kernels measured on an H200 with this '
        "profiler method, cold, unqueued; they are not re-measured here."
    )
    return [*lines, ""]


def _summary(lines: list[str], idx: dict, cases: list[str], ours: str | None) -> None:
    """The README table: ours, cudnn-frontend and torch.compile per pooling case, cold, and ours over the floor."""
    if ours is None:
        return
    head = ["case"]
    for what in ("fwd", "fwd+bwd"):
        head += [f"{what} ours ({ours})", f"{what} cudnn-frontend", f"{what} torch.compile", f"{what} x floor"]
    body = []
    for case in (c for c in cases if not c.endswith("-tail")):
        if _value(idx, case, ours, "fwd") is None and _value(idx, case, ours, "fwd+bwd") is None:
            continue
        row = [case]
        for what in ("fwd", "fwd+bwd"):
            cold, floor = _value(idx, case, ours, what), _value(idx, case, ours, what, "floor_us")
            compile_cold = _value(idx, case, "torch.compile", what)
            row += [_fmt_us(cold), _fmt_us(cudnn_frontend(case, what)), _fmt_us(compile_cold), _fmt_ratio(cold, floor)]
        body.append(row)
    _table(lines, "Summary (cold kernel time, us)", head, body)


def _direction_table(lines, idx, cases, backends, records, direction: str, title: str) -> None:
    """Forward or backward: every row of that direction, against torch.compile (forward) and cudnn-frontend."""
    with_compile = direction == "fwd"
    clean = any(r.get("kernel_us_cold_clean") is not None for r in records)
    head = ["case", "floor", "backend", "cold", "warm", "wall", "host", "cold / floor"]
    head += ["cold, clean L2", "clean / floor"] if clean else []
    head += ["vs torch.compile (cold)"] if with_compile else []
    head += ["cudnn-frontend cold", "vs cudnn-frontend (cold)", "wall - warm", "cudnn-frontend wall"]
    body = []
    for case in cases:
        compile_cold = _value(idx, case, "torch.compile", direction)
        fig = CUDNN_FRONTEND_H200.get(case, {})
        for backend in backends:
            rec = idx.get((case, backend, direction))
            if rec is None:
                continue
            cold, warm, wall = rec.get("kernel_us_cold"), rec.get("kernel_us_warm"), rec.get("wall_us")
            row = [case, _fmt_us(rec.get("floor_us")), backend, _fmt_us(cold), _fmt_us(warm), _fmt_us(wall),
                   _fmt_us(rec.get("host_us")), _fmt_ratio(cold, rec.get("floor_us"))]  # fmt: skip
            if clean:
                cc = rec.get("kernel_us_cold_clean")
                row += [_fmt_us(cc), _fmt_ratio(cc, rec.get("floor_us"))]
            row += [_fmt_ratio(compile_cold, cold)] if with_compile else []
            row += [
                _fmt_us(fig.get(direction)),
                _fmt_ratio(fig.get(direction), cold) if backend in KERNEL_BACKENDS else "—",
                _fmt_us(wall - warm) if wall is not None and warm is not None else "—",
                _fmt_us(fig.get(f"wall_{direction}")),
            ]
            body.append(row)
    _table(lines, title, head, body)


def _combined_table(lines, idx, cases, backends) -> None:
    head = ["case", "floor", "backend", "cold", "warm", "wall", "cold / floor", "vs torch.compile (cold)",
            "vs eager (cold)", "vs cudnn-frontend (cold)"]  # fmt: skip
    body = []
    for case in cases:
        compile_cold, eager_cold = (_value(idx, case, b, "fwd+bwd") for b in ("torch.compile", "eager"))
        for backend in backends:
            rec = combined(idx, case, backend)
            if rec is None:
                continue
            cold = rec.get("kernel_us_cold")
            body.append([
                case, _fmt_us(rec.get("floor_us")), backend, _fmt_us(cold), _fmt_us(rec.get("kernel_us_warm")),
                _fmt_us(rec.get("wall_us")), _fmt_ratio(cold, rec.get("floor_us")),
                _fmt_ratio(compile_cold, cold), _fmt_ratio(eager_cold, cold),
                _fmt_ratio(cudnn_frontend(case, "fwd+bwd"), cold) if backend in KERNEL_BACKENDS else "—",
            ])  # fmt: skip
    _table(lines, "Forward + backward (kernel backends: sum of the two calls)", head, body)


def _ratio_range(run_indexes, case: str, pooling: str, backend: str, direction: str) -> str:
    """`` (lo-hi over n runs)`` of fused / pooling alone where several runs of the record have both, else ""."""
    ratios = []
    for ix in run_indexes:
        fused, alone = _value(ix, case, backend, direction), _value(ix, pooling, backend, direction)
        if fused and alone and alone > 0:
            ratios.append(fused / alone)
    if len(ratios) < 2:
        return ""
    return f" ({min(ratios):.2f}-{max(ratios):.2f}x over {len(ratios)} runs)"


def _tail_tables(lines, run_indexes, cases, backends) -> None:
    """The fused tail against the pooling alone (its targets, the floors' ratio, the bytes the tail adds; with
    several ``run_indexes``, the ratio's range over the runs too) and against the unfused chains (a) and (b), from
    the first run's index."""
    idx = run_indexes[0]
    tails = [c for c in cases if c.endswith("-tail")]
    kernels = [b for b in backends if b in KERNEL_BACKENDS and b != "reference"]
    cost, versus = [], []
    for case, backend in ((c, b) for c in tails for b in kernels):
        ours = [_value(idx, case, b, d) for b in (backend, backend + TORCH_TAIL) for d in ("fwd", "fwd+bwd")]
        if all(v is None for v in ours):
            continue  # this backend has no row in this case
        pooling = case[: -len("-tail")]
        row = [case, backend]
        for direction in ("fwd", "bwd"):
            fused, alone = _value(idx, case, backend, direction), _value(idx, pooling, backend, direction)
            spread = _ratio_range(run_indexes, case, pooling, backend, direction)
            floors = (_value(idx, c, backend, direction, "floor_us") for c in (case, pooling))
            row += [_fmt_us(fused), _fmt_us(alone), _fmt_ratio(fused, alone) + spread, _fmt_ratio(*floors)]
        cost.append(row)
        row = [case, backend]
        for direction in ("fwd", "fwd+bwd"):
            fused = _value(idx, case, backend, direction)
            unfused, compiled = (_value(idx, case, b, direction) for b in (backend + TORCH_TAIL, "torch.compile"))
            row += [_fmt_us(fused), _fmt_us(unfused), _fmt_us(compiled)]
            row += [_fmt_ratio(unfused, fused), _fmt_ratio(compiled, fused)]
        versus.append(row)
    head = ["case", "backend"]
    for direction in ("fwd", "bwd"):
        target = TAIL_TARGETS[direction]
        head += [f"{direction} fused", f"{direction} pooling alone", f"fused / pooling (target <= {target:.2f}x)"]
        head.append(f"{direction} floors fused / pooling")
    _table(lines, "Fused RMSNorm + RoPE tail: cost over the pooling alone (cold)", head, cost)
    head = ["case", "backend"]
    for d in ("fwd", "fwd+bwd"):
        head += [f"{d} fused", f"{d} (a) pooling + torch tail", f"{d} (b) torch.compile", f"{d} vs (a)", f"{d} vs (b)"]
    _table(lines, "Fused RMSNorm + RoPE tail: against the unfused chains (cold)", head, versus)


def _probe_table(lines, records, cases, backends) -> None:
    present = [(k, label) for k, label in PROBE_FIELDS if any(k in r for r in records)]
    extra = [k for k, _ in present if k not in ("kernel_us_cold", "kernel_us_warm")]
    if not extra:
        return
    idx = _index(records)
    body = []
    for case in cases:
        for backend in backends:
            for direction in ("fwd", "bwd", "fwd+bwd"):
                rec = idx.get((case, backend, direction))
                if rec is not None and any(rec.get(k) is not None for k in extra):
                    body.append([case, backend, direction, *(_fmt_us(rec.get(k)) for k, _ in present)])
    head = ["case", "backend", "dir", *(label for _, label in present)]
    _table(lines, "Timing probe (kernel us per call; idle: device idle between the profiled activities)", head, body)


def _problems(lines: list[str], records: Sequence[dict]) -> None:
    errors = [(r, key) for r in records for key in ("error", "wall_error") if r.get(key)]
    if errors:
        lines += ["### Failed measurements", ""]
        lines += [
            f"- {r['case']} {r['backend']} {r['direction']}{' (wall)' if key == 'wall_error' else ''}: {r[key]}"
            for r, key in errors
        ]
        lines.append("")
    skipped: dict[str, list[str]] = {}
    for r in records:
        if r.get("skipped"):
            skipped.setdefault(r["skipped"], []).append(f"{r['case']} {r['backend']} {r['direction']}")
    if skipped:
        lines += ["### Skipped", ""]
        lines += [f"- {why}: {len(rows)} measurements ({rows[0]}, ...)" for why, rows in skipped.items()]
        lines.append("")


def runs_of(records: Sequence[dict]) -> list[list[dict]]:
    """The records of each run (told apart by their date), in the order the runs first appear; one empty run for
    no records."""
    runs: dict = {}
    for rec in records:
        runs.setdefault(rec.get("date"), []).append(rec)
    return list(runs.values()) or [[]]


def format_markdown(records: Sequence[dict], meta: dict | None = None) -> str:
    """Markdown report: a summary, forward, backward and forward+backward tables, the fused tail's tables, the
    timing probe when it ran, and the failed and skipped measurements. ``meta`` heads the report. Of a record of
    several runs the tables are the first run's (``meta_of``'s), with the fused tail's ratios' range over all."""
    meta = meta or {}
    runs = runs_of(records)
    first = runs[0]
    run_indexes = [_index(run) for run in runs]
    idx = run_indexes[0]
    cases = case_order(first)
    backends = ordered((r["backend"] for r in first), backend_order())
    kernel_backends = [b for b in backends if b in KERNEL_BACKENDS]
    lines: list[str] = _header(meta) if meta else []
    if len(runs) > 1:
        lines += [f"This record holds {len(runs)} runs: the tables are the first's; the fused tail's ratios to the "
                  "pooling alone also give their range over the runs.", ""]  # fmt: skip
    _summary(lines, idx, cases, ours_backend(first))
    _direction_table(lines, idx, cases, backends, first, "fwd", "Forward")
    _direction_table(lines, idx, cases, kernel_backends, first, "bwd", "Backward (the backward call alone)")
    _combined_table(lines, idx, cases, backends)
    _tail_tables(lines, run_indexes, cases, backends)
    _probe_table(lines, first, cases, backends)
    _problems(lines, records)
    return "\n".join(lines)
