"""``run_bench``: the bench's two passes over the case matrix, and its output files.

Pass 1 builds every case's callables (compiling what needs it) and times the walls and host times, before the
process's first profiler session (``timer`` says why); pass 2 times the kernels with the profiler. The
callables of pass 1 are kept for pass 2, so nothing compiles twice.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import re
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .calls import Skip, callables, make_tail, short_error
from .cases import (
    Case,
    case_backends,
    is_baseline,
    measured_direction,
    resolve_backends,
    select_cases,
    select_directions,
)
from .chart import draw_chart
from .env import git_commit, source_digest, versions
from .report import compact_records, format_markdown, make_record
from .timer import Timer

__all__ = ["FULL_REPS", "QUICK_REPS", "BenchResult", "Method", "NoGPUError", "default_name", "run_bench"]

# (cold, warm, wall) timed calls per measurement; warm-up calls are extra and untimed.
FULL_REPS = (10, 20, 20)
QUICK_REPS = (3, 5, 5)
# Pass 1 (compiling and walls) starts no new case after this share of the time budget.
_PASS1_SHARE = 0.6
# --timing-probe: how long the device idles before each call of the "warm after idle" figure, and the spin kernel
# before each call of "warm after spin" (about the flush's length, so that the call follows a kernel as a cold one).
PROBE_IDLE_US = 50.0
PROBE_SPIN_US = 40.0
BUDGET_SKIP = "past the time budget"


class NoGPUError(RuntimeError):
    """Raised by ``run_bench`` when no CUDA device is present."""


@dataclass(frozen=True)
class Method:
    """How the bench measures: timed calls per measurement, extra figures, and a time budget in seconds after
    which it starts no new measurement (the ones left are recorded as skipped). ``compile_only``: build and call
    every row once and time nothing (it fills the compile caches on disk for a later run)."""

    reps: tuple[int, int, int] = FULL_REPS
    clean_cold: bool = False
    timing_probe: bool = False
    budget_s: float | None = None
    compile_only: bool = False


@dataclass
class BenchResult:
    records: list[dict]
    markdown: str
    meta: dict
    paths: dict[str, Path] = field(default_factory=dict)


@dataclass
class Job:
    """One row x direction of the matrix: its callable, or why it has none; pass 1's wall and host time."""

    case: Case
    backend: str
    direction: str
    fn: Callable[[], object] | None = None
    note: str | None = None
    error: str | None = None
    skipped: str | None = None
    wall: float | None = None
    wall_error: str | None = None
    host: float | None = None


def _log(enabled: bool) -> Callable[[str], None]:
    return (lambda msg: print(msg, file=sys.stderr, flush=True)) if enabled else (lambda msg: None)


def _build_jobs(case: Case, backends: Sequence[str], directions: Sequence[str], device, log) -> list[Job]:
    """The jobs of one case on one pack (seed 0); a backend that fails to set up fails its directions only."""
    from ..testing import make_pack

    pack = make_pack(case.seqlens, case.head_dim, case.ratio, case.coff, device=device, seed=0)
    tail = make_tail(case, pack) if case.tail else None
    jobs = []
    for backend in case_backends(case, backends):
        calls, note, error, skipped = {}, None, None, None
        try:
            calls, note = callables(backend, pack, case, tail, log)
        except Skip as exc:
            skipped = str(exc)
        except Exception as exc:  # one broken backend must not lose the rest of the run
            error = short_error(exc)
        for direction in directions:
            what = measured_direction(backend, direction)
            jobs.append(Job(case, backend, what, calls.get(what), note, error, skipped))
    return jobs


def _pass_walls(case_list, backends, directions, timer: Timer, reps, budget, device, log) -> list[Job]:
    """Pass 1: build each case's jobs and time their walls and host times; cases past the budget are skipped."""
    jobs: list[Job] = []
    for case in case_list:
        if budget.spent(_PASS1_SHARE):
            jobs += [Job(case, b, measured_direction(b, d), skipped=BUDGET_SKIP)
                     for b in case_backends(case, backends) for d in directions]  # fmt: skip
            continue
        t0 = time.perf_counter()
        built = _build_jobs(case, backends, directions, device, log)
        for job in built:
            if job.fn is None:
                continue
            try:
                timer.warm_up(job.fn)
                job.wall = timer.wall_us(job.fn, reps[2])
                job.host = timer.host_us(job.fn, reps[2])
            except Exception as exc:  # recorded with the call's kernel times in pass 2
                job.wall_error = short_error(exc)
        log(f"[walls] {case.name}: {len(built)} measurements in {time.perf_counter() - t0:.1f} s ({budget})")
        jobs += built
    return jobs


def _kernel_figures(rec: dict, job: Job, timer: Timer, method: Method) -> str:
    """Pass 2 for one job: cold and warm kernel time (and the optional figures) into ``rec``; a progress note."""
    cold_calls, warm_calls, _ = method.reps
    cold = timer.kernel(job.fn, cold_calls, cold=True, host_us=job.host)
    warm = timer.kernel(job.fn, warm_calls, cold=False, host_us=job.host)
    rec.update(kernel_us_cold=cold.us, kernel_us_warm=warm.us, idle_us_cold=cold.idle_us, idle_us_warm=warm.idle_us)
    rec.update(wall_us=job.wall, host_us=job.host)
    if job.wall_error:
        rec["wall_error"] = job.wall_error
    extras = []
    if method.clean_cold and not is_baseline(job.backend):
        extras.append(("kernel_us_cold_clean", lambda: timer.kernel(job.fn, cold_calls, cold=True, clean=True)))
    if method.timing_probe:
        extras += [
            ("kernel_us_cold_unqueued", lambda: timer.kernel(job.fn, cold_calls, cold=True, queued=False)),
            ("kernel_us_warm_unqueued", lambda: timer.kernel(job.fn, warm_calls, cold=False, queued=False)),
            ("kernel_us_warm_after_idle",
             lambda: timer.kernel(job.fn, warm_calls, cold=False, idle_before_us=PROBE_IDLE_US)),
            ("kernel_us_warm_after_spin",
             lambda: timer.kernel(job.fn, warm_calls, cold=False, host_us=job.host, spin_before_us=PROBE_SPIN_US)),
        ]  # fmt: skip
    for key, measure in extras:
        try:  # an extra figure: its failure leaves the measured ones standing
            extra = measure()
            rec[key] = extra.us
            rec[key.replace("kernel_us", "idle_us")] = extra.idle_us
        except Exception as exc:
            rec[key.replace("kernel_us", "error")] = short_error(exc)
    wall = f"wall {job.wall:.1f} us" if job.wall is not None else f"wall failed ({job.wall_error})"
    return f"cold {cold.us:.1f} us, warm {warm.us:.1f} us, {wall}, floor {rec['floor_us']:.1f} us"


def _pass_kernels(jobs: list[Job], meta: dict, rate: float, timer: Timer, method: Method, budget, log) -> list[dict]:
    """Pass 2: the kernel times of every job, one record each (failed and skipped ones included)."""
    records = []
    for done, job in enumerate(jobs, 1):
        rec = make_record(meta, job.case, job.backend, job.direction, rate)
        if job.note:
            rec["note"] = job.note
        t0 = time.perf_counter()
        skipped = job.skipped or (BUDGET_SKIP if budget.spent() else None)
        if skipped:
            rec["skipped"], status = skipped, f"skipped ({skipped})"
        elif job.error or job.fn is None:
            rec["error"] = job.error or f"{job.backend} has no {job.direction} callable"
            status = f"FAILED: {rec['error']}"
        else:
            try:
                status = _kernel_figures(rec, job, timer, method)
            except Exception as exc:  # record the failure and keep going
                rec["error"] = short_error(exc)
                status = f"FAILED: {rec['error']}"
        records.append(rec)
        log(f"[{done}/{len(jobs)}] {job.case.name} {job.backend} {job.direction}: {status} "
            f"({time.perf_counter() - t0:.1f} s; {budget})")  # fmt: skip
    return records


def _compile_pass(case_list, backends, directions, device, log) -> None:
    """Build and call every row once: what compiles is compiled (and kept in the caches on disk), nothing timed."""
    import torch

    for case in case_list:
        t0 = time.perf_counter()
        for job in _build_jobs(case, backends, directions, device, log):
            if job.fn is not None:
                job.fn()
        torch.cuda.synchronize(device)
        log(f"[compile] {case.name}: {time.perf_counter() - t0:.1f} s")


class _Budget:
    """Elapsed time of the run against its budget (None: no budget)."""

    def __init__(self, budget_s: float | None):
        self.start = time.perf_counter()
        self.budget_s = budget_s

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def spent(self, share: float = 1.0) -> bool:
        return self.budget_s is not None and self.elapsed() > self.budget_s * share

    def __str__(self) -> str:
        limit = f" of {self.budget_s:.0f}" if self.budget_s is not None else ""
        return f"{self.elapsed():.0f}{limit} s"


def _meta(device, rate: float, timer: Timer, method: Method, commit: str | None) -> dict:
    import torch

    props = torch.cuda.get_device_properties(device)
    x = torch.zeros(1, device=device)
    return {
        "device": f"{props.name} (sm_{props.major}{props.minor})",
        "device_name": props.name,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "commit": commit or git_commit(),
        "source_digest": source_digest(),
        "versions": versions(),
        "copy_tb_s": rate / 1e12,
        "reps": list(method.reps),
        "timer": "queued",
        "l2_flush_bytes": timer.flush_bytes,
        # Before any profiler session: the two events around nothing (what the wall method costs on this host)
        # and one eager elementwise op.
        "host_wall_us": {
            "events only": timer.wall_us(lambda: None, 50),
            "x.add_(1)": timer.wall_us(lambda: x.add_(1), 50),
        },
    }


def run_bench(
    cases: Iterable[str] | Sequence[Case] | None = None,
    backends: Iterable[str] | None = None,
    directions: Iterable[str] | None = None,
    *,
    tail: str = "on",
    method: Method | None = None,
    quick: bool = False,
    out_dir: str | os.PathLike | None = None,
    name: str | None = None,
    progress: bool = True,
    device=None,
    commit: str | None = None,
) -> BenchResult:
    """Run the bench; returns the records, the markdown report and, with ``out_dir``, the written paths.

    ``cases``: case names / indices (see ``CASES``) or ``Case`` objects, default all; ``tail``: "on" (also every
    case with the RMSNorm + RoPE tail), "off" or "only". ``backends``: names among cute, triton, reference,
    torch.compile, eager, all (default: the GPU backends and the baselines; ``select_backends``). ``directions``: "fwd", "bwd" (for the
    baselines "bwd" means forward+backward). ``method``: repetitions and extra figures (``quick``: fewer
    repetitions). ``commit`` overrides ``git rev-parse HEAD``. Raises ``NoGPUError`` without a CUDA device.
    """
    import torch

    from ..dispatch import available_backends

    if not torch.cuda.is_available():
        raise NoGPUError("no CUDA device is available")
    device = torch.device(device) if device is not None else torch.device("cuda")
    if device.type == "cuda" and device.index is None:  # the current device, by index as set_device needs
        device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.set_device(device)
    method = method or Method(reps=QUICK_REPS if quick else FULL_REPS)
    cases = list(cases) if cases is not None else None
    case_list = cases if cases and all(isinstance(c, Case) for c in cases) else select_cases(cases, tail)
    backend_list = resolve_backends(backends, available_backends(device))
    direction_list = select_directions(directions)
    log = _log(progress)
    budget = _Budget(method.budget_s)
    if method.compile_only:
        _compile_pass(case_list, backend_list, direction_list, device, log)
        return BenchResult(records=[], markdown="", meta={})
    timer = Timer(device)
    rate = timer.copy_rate(reps=5 if quick else 10)
    meta = _meta(device, rate, timer, method, commit)
    meta["sm_clock_mhz"] = [timer.sm_clock_mhz()]
    if method.timing_probe:
        meta["spin_wakeup_us"] = dict(zip(("after idle", "queued"), timer.spin_wakeup_us(), strict=True))
    log(f"{meta['device']}: copy rate {rate / 1e12:.2f} TB/s, SM clock {meta['sm_clock_mhz'][0]:.0f} MHz, "
        f"reps {method.reps}, {len(case_list)} cases x {', '.join(backend_list)}")  # fmt: skip
    jobs = _pass_walls(case_list, backend_list, direction_list, timer, method.reps, budget, device, log)
    records = _pass_kernels(jobs, meta, rate, timer, method, budget, log)
    meta["sm_clock_mhz"].append(timer.sm_clock_mhz())
    meta["elapsed_s"] = round(budget.elapsed(), 1)
    result = BenchResult(records=records, markdown=format_markdown(records, meta), meta=meta)
    if out_dir is not None:
        result.paths = write_outputs(result, Path(out_dir), name or default_name(meta["device_name"], meta["date"]))
    return result


def default_name(device_name: str, date_iso: str) -> str:
    """File stem for a run, e.g. ``bench_nvidia-h200_20261130T1412Z``."""
    slug = re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-") or "gpu"
    stamp = re.sub(r"[^0-9T]", "", date_iso.split("+")[0])[:13]
    return f"bench_{slug}_{stamp}Z"


def _rounded(value):
    """Floats to six significant digits: more than any timing in a record resolves."""
    if isinstance(value, float):
        return float(f"{value:.6g}")
    if isinstance(value, dict):
        return {key: _rounded(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_rounded(item) for item in value]
    return value


def records_json(records: list[dict]) -> str:
    """The records in ``compact_records``'s form, one run, case or row per line: small in git, and a diff names
    the rows that moved."""
    data = compact_records(_rounded(records))

    def dump(value) -> str:
        return json.dumps(value, separators=(",", ":"))

    def block(key: str, lines: Iterable[str], brackets: str) -> str:
        return f"{dump(key)}:{brackets[0]}\n" + ",\n".join(lines) + f"\n{brackets[1]}"

    runs = block("runs", (f"{dump(k)}:{dump(v)}" for k, v in data["runs"].items()), "{}")
    cases = block("cases", (f"{dump(k)}:{dump(v)}" for k, v in data["cases"].items()), "{}")
    rows = block("rows", (dump(row) for row in data["rows"]), "[]")
    return "{" + ",\n".join((runs, cases, rows)) + "}\n"


def write_outputs(result: BenchResult, out_dir: Path, stem: str, records_too: bool = True) -> dict[str, Path]:
    """``stem``.json (the records, unless not ``records_too``), .md (the report) and .png (the chart)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / f"{stem}.json", "markdown": out_dir / f"{stem}.md", "chart": out_dir / f"{stem}.png"}
    if records_too:
        paths["json"].write_text(records_json(result.records))
    else:
        del paths["json"]
    paths["markdown"].write_text(result.markdown + "\n")
    msg = draw_chart(result.records, paths["chart"])
    if msg:
        print(msg, file=sys.stderr)
        del paths["chart"]
    return paths
