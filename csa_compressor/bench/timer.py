"""The one timer of the project: the bench and every script in ``benchmarks/`` measure with it.

- Kernel time: the device time one call causes (kernels, memsets, memcpys, from ``torch.profiler``, as nsys
  reports it; kernels that overlap, a programmatic dependent launch and its predecessor, count once over their
  common span), the mean over the profiled calls. *Cold* writes a buffer of at least twice the L2 size before each
  call (the flush's own device time is not counted); *warm* runs the calls one after another. Both are timed
  *queued*: a spin kernel ahead of the calls holds the device while the host enqueues them, so every call's first
  kernel starts right behind other device work, as in a training step whose host runs ahead. Without the spin a
  call whose host time exceeds its device time starts on an idle device each time (``Timer.kernel`` says what
  that costs), while a cold call still starts queued behind its flush.
- Wall time: CUDA events around one call, the device idle before it: what a caller waits, host overhead
  included. Time walls before the process's first profiler session: after one, CUPTI's callbacks stay on every
  CUDA API call and slow it.
- Host time: ``perf_counter`` around one call, calls back to back (no synchronisation inside).

Everything here but ``Timer`` is pure arithmetic on profiler events, tested on the CPU.
"""

from __future__ import annotations

import dataclasses
import itertools
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

__all__ = [
    "FLUSH_RANGE",
    "SPIN_RANGE",
    "DeviceActivity",
    "KernelTime",
    "Timer",
    "busy_us",
    "copy_rate",
    "device_idle",
    "kernel_us_per_call",
    "range_device_us",
]

FLUSH_RANGE = "csa_bench.l2_flush"
SPIN_RANGE = "csa_bench.queue_spin"
# ATen's kernel for a float64 fill_, which only the flush launches; and the kernel of torch.cuda._sleep.
_FLUSH_KERNEL_HINT = "FillFunctor<double>"
_SPIN_KERNEL_HINT = "spin_kernel"
WARMUP_CALLS = 3
# A gap between two device activities longer than this means the host fell behind the queue.
DRY_GAP_US = 4.0
# Queue spin per call: this many times the call's host time (the profiler slows the host), plus a margin.
_QUEUE_HOST_FACTOR = 2.5
_QUEUE_MARGIN_US = 30.0
_MAX_SPIN_US = 2e6


@dataclass(frozen=True)
class DeviceActivity:
    """One device-side profiler event: a kernel, memset, memcpy, or a GPU mirror of an annotation range."""

    name: str
    duration_us: float
    is_user_annotation: bool = False
    start_us: float = 0.0

    @property
    def end_us(self) -> float:
        return self.start_us + self.duration_us


@dataclass(frozen=True)
class _Loop:
    """What a profiled loop does around the calls: the flush (``cold``, ``clean``), a spin ahead of them all
    (``queue_us``), and before every call a wait on an idle device or a spin kernel."""

    cold: bool
    clean: bool = False
    queue_us: float = 0.0
    idle_before_us: float | None = None
    spin_before_us: float | None = None


@dataclass(frozen=True)
class KernelTime:
    """Kernel time per call (``us``), the device's idle time per call between the profiled activities (``idle_us``)
    and its longest single gap (``max_gap_us``); ``queued``: the calls were enqueued behind a spin kernel."""

    us: float
    idle_us: float
    max_gap_us: float
    queued: bool


def copy_rate(nbytes: int, seconds: Sequence[float]) -> float:
    """Copy rate in bytes/s from timings of copying ``nbytes`` (read + write = ``2*nbytes`` moved), median."""
    return 2 * nbytes / statistics.median(seconds)


def _busy_spans(activities: Iterable[DeviceActivity]) -> list[tuple[float, float]]:
    """The disjoint (start, end) spans, in order, during which at least one activity (annotation spans aside) ran."""
    merged: list[list[float]] = []
    for start, end in sorted((a.start_us, a.end_us) for a in activities if not a.is_user_annotation):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def busy_us(activities: Iterable[DeviceActivity]) -> float:
    """The time during which at least one of the activities (annotation spans aside) ran: the sum of their
    durations, less what overlapping activities share (a programmatic dependent launch overlaps its predecessor)."""
    return sum(e - s for s, e in _busy_spans(activities))


def kernel_us_per_call(activities: Iterable[DeviceActivity], calls: int, excluded_us: float = 0.0) -> float:
    """Mean device time per call: the busy time of every device activity except annotation spans (``busy_us``),
    minus the timer's own work (flushes and spins, which overlap nothing).

    Annotation spans (``record_function`` ranges mirrored on the GPU timeline, "Torch-Compiled Region", ...)
    overlap the kernels they contain, so counting them would count twice; the profiler's own table skips them too.
    """
    if calls <= 0:
        raise ValueError("calls must be positive")
    total = busy_us(activities)
    if excluded_us > total + 1e-6:
        raise ValueError(f"the timer's own device time {excluded_us:.3f} us exceeds the total {total:.3f} us")
    return max(total - excluded_us, 0.0) / calls


def device_idle(activities: Iterable[DeviceActivity]) -> tuple[float, float]:
    """``(idle, longest gap)`` in us: the time between the first start and the last end of the activities
    (annotation spans aside) during which none of them ran."""
    spans = _busy_spans(activities)
    gaps = [start - end for (_, end), (start, _) in itertools.pairwise(spans)]
    return sum(gaps), max(gaps, default=0.0)


def range_device_us(range_event, skip_names: Iterable[str] = (FLUSH_RANGE,)) -> float:
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


def is_annotation(event) -> bool:
    """True for GPU-timeline mirrors of ``record_function`` ranges (they overlap real kernels)."""
    if getattr(event, "is_user_annotation", False):
        return True
    kind = getattr(event, "activity_type", None)
    return isinstance(kind, str) and "annotation" in kind.lower()


def split_profile(events, calls: int, cold: bool) -> tuple[list[DeviceActivity], float, list[DeviceActivity]]:
    """``(device activities, flush us, spins)`` of a profile: the flush's device time by its range (by its kernel's
    name where the profiler attached no kernel to the range), the timer's spin kernels by their name."""
    from torch.autograd import DeviceType

    range_names = {e.name for e in events if e.device_type != DeviceType.CUDA and is_annotation(e)}
    range_names |= {FLUSH_RANGE, SPIN_RANGE}
    activities, flush_us = [], 0.0
    for e in events:
        if e.device_type == DeviceType.CUDA:
            annotation = is_annotation(e) or e.name in range_names
            activities.append(DeviceActivity(e.name, e.time_range.elapsed_us(), annotation, e.time_range.start))
        elif cold and e.name == FLUSH_RANGE:
            flush_us += range_device_us(e)
    if not activities:
        raise RuntimeError("the profiler recorded no device activity (is CUPTI available?)")
    if cold and flush_us <= 0:
        fills = [a for a in activities if not a.is_user_annotation and _FLUSH_KERNEL_HINT in a.name]
        if len(fills) != calls:
            raise RuntimeError("could not find the L2 flush kernels in the profile; cold time would include them")
        flush_us = sum(a.duration_us for a in fills)
    spins = [a for a in activities if _SPIN_KERNEL_HINT in a.name and not a.is_user_annotation]
    return activities, flush_us, spins


def _busy_wait(us: float) -> None:
    end = time.perf_counter() + us * 1e-6
    while time.perf_counter() < end:
        pass


class Timer:
    """Cold / warm kernel time, wall time and host time of a callable on one CUDA device."""

    def __init__(self, device, flush_bytes: int | None = None):
        import torch

        self.torch = torch
        self.device = device
        l2 = int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 0)
        # Twice the L2 and at least 128 MiB; float64 so that the flush kernel is unlike anything the measured
        # code launches.
        self.flush_bytes = flush_bytes or max(2 * l2, 128 << 20)
        self.flush_buf = torch.empty(self.flush_bytes // 8, dtype=torch.float64, device=device)
        self.read_buf = None
        self._flush_value = 0.0
        self._profiler_primed = False
        self._cycles_per_us: float | None = None

    # ---------------------------------------------------------------- the timer's own device work

    def flush(self, clean: bool = False) -> None:
        self._flush_value = 1.0 - self._flush_value
        self.flush_buf.fill_(self._flush_value)
        if clean:
            # Then read another 2x-L2 buffer: L2 holds clean lines, so the timed call does not also pay for
            # writing the flush's dirty lines back to DRAM (the plain flush leaves up to one L2 of them).
            if self.read_buf is None:
                self.read_buf = self.torch.ones(self.flush_bytes // 4, dtype=self.torch.float32, device=self.device)
            self.read_buf.sum()

    def sm_clock_mhz(self, cycles: int = 2_000_000) -> float:
        """The SM clock while a spin kernel runs (its cycles over its CUDA-event time), in MHz."""
        torch = self.torch
        # An untimed spin first: the first launch loads the kernel's module (lazy loading), and an idle GPU needs
        # load to raise its clock; either inside the events reads as a low clock.
        torch.cuda._sleep(cycles)
        torch.cuda.synchronize(self.device)
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        torch.cuda._sleep(cycles)
        e1.record()
        e1.synchronize()
        return cycles / (e0.elapsed_time(e1) * 1e3)

    def spin(self, us: float) -> None:
        """Hold the device for about ``us`` microseconds with one kernel (no memory traffic)."""
        if self._cycles_per_us is None:
            self._cycles_per_us = self.sm_clock_mhz()
        self.torch.cuda._sleep(max(int(min(us, _MAX_SPIN_US) * self._cycles_per_us), 1))

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

    # ---------------------------------------------------------------- wall and host (before any profiler session)

    def warm_up(self, fn: Callable[[], object], calls: int = WARMUP_CALLS) -> None:
        for _ in range(calls):
            fn()
        self.torch.cuda.synchronize(self.device)

    def wall_us(self, fn: Callable[[], object], calls: int) -> float:
        """Median of CUDA-event time around one call, the device idle before it (host overhead shows)."""
        torch = self.torch
        pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(calls)]
        for e0, e1 in pairs:
            torch.cuda.synchronize(self.device)
            e0.record()
            fn()
            e1.record()
        torch.cuda.synchronize(self.device)
        return statistics.median(e0.elapsed_time(e1) * 1e3 for e0, e1 in pairs)

    def host_us(self, fn: Callable[[], object], calls: int) -> float:
        """Median host time of one call, calls back to back: what the caller's thread spends per call."""
        self.torch.cuda.synchronize(self.device)
        times = []
        for _ in range(calls):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
        self.torch.cuda.synchronize(self.device)
        return statistics.median(times)

    # ---------------------------------------------------------------- kernel time (profiler sessions)

    def _prime_profiler(self) -> None:
        """The process's first profiler session, on the flush alone: it can lose device records while CUPTI
        starts up (the first case's cold time then came out below its warm time)."""
        if not self._profiler_primed:
            self._profiler_primed = True
            self._profile(self.flush, 2, _Loop(cold=False))

    def _profile(self, fn, calls: int, loop: _Loop):
        from torch.profiler import ProfilerActivity, profile, record_function

        torch = self.torch
        torch.cuda.synchronize(self.device)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            if loop.queue_us > 0:
                with record_function(SPIN_RANGE):
                    self.spin(loop.queue_us)
            for _ in range(calls):
                if loop.idle_before_us is not None:
                    torch.cuda.synchronize(self.device)
                    _busy_wait(loop.idle_before_us)
                if loop.spin_before_us is not None:
                    self.spin(loop.spin_before_us)
                if loop.cold:
                    with record_function(FLUSH_RANGE):
                        self.flush(loop.clean)
                fn()
            torch.cuda.synchronize(self.device)
        return list(prof.events())

    def device_activity(self, fn: Callable[[], object], calls: int, cold: bool = False):
        """(device activities, flush us) of ``calls`` calls of ``fn``, unqueued: for callers that pick kernels by
        name (the NCCL kernels of a collective, the launches of one call)."""
        self._prime_profiler()
        activities, flush_us, _spins = split_profile(self._profile(fn, calls, _Loop(cold)), calls, cold)
        return activities, flush_us

    def kernel(
        self,
        fn: Callable[[], object],
        calls: int,
        cold: bool,
        *,
        clean: bool = False,
        queued: bool = True,
        host_us: float | None = None,
        idle_before_us: float | None = None,
        spin_before_us: float | None = None,
    ) -> KernelTime:
        """Kernel time of ``calls`` calls of ``fn``, cold (each after the L2 flush; ``clean``: a flush that leaves
        clean lines) or warm.

        ``queued``: a spin kernel ahead of the calls, sized from ``host_us`` (the call's host time; measured here
        when not given), so that the host has enqueued the calls before the device reaches them; if the device
        still ran dry, the calls are timed once more behind a longer spin. A kernel that starts on an idle device
        measures longer than one queued behind other work, by a fixed amount per call: timed unqueued, warm calls
        of a host-bound callable carry that cost and cold ones (queued behind their flush) do not.
        For the timing probe instead: ``idle_before_us`` synchronises and leaves the device idle that long before
        every call; ``spin_before_us`` puts a spin kernel of that length (no memory traffic) before every call.
        """
        self._prime_profiler()
        if cold and clean and self.read_buf is None:
            self.flush(clean=True)  # the read buffer's allocation and first reduction stay outside the profile
        loop = _Loop(cold, clean, 0.0, idle_before_us, spin_before_us)
        if queued and idle_before_us is None:
            per_call = self.host_us(fn, 3) if host_us is None else host_us
            queue_us = calls * (per_call * _QUEUE_HOST_FACTOR + (_QUEUE_MARGIN_US if cold else 0.0))
            loop = dataclasses.replace(loop, queue_us=queue_us)
        result = self._kernel_once(fn, calls, loop)
        if loop.queue_us > 0 and result.max_gap_us > DRY_GAP_US:
            result = self._kernel_once(fn, calls, dataclasses.replace(loop, queue_us=4 * loop.queue_us))
        return result

    def _kernel_once(self, fn, calls: int, loop: _Loop) -> KernelTime:
        activities, flush_us, spins = split_profile(self._profile(fn, calls, loop), calls, loop.cold)
        if loop.queue_us > 0 and not spins:
            raise RuntimeError("could not find the queue's spin kernel in the profile")
        # The sum leaves out every spin; the idle time counts the per-call spins as busy, the queue's lead-in not.
        queue_spin = min(spins, key=lambda a: a.start_us) if loop.queue_us > 0 else None
        idle, longest = device_idle([a for a in activities if a is not queue_spin])
        measured = [a for a in activities if all(a is not s for s in spins)]
        return KernelTime(kernel_us_per_call(measured, calls, flush_us), idle / calls, longest, loop.queue_us > 0)

    def spin_wakeup_us(self, cycles: int = 20_000, idle_us: float = 200.0, reps: int = 7) -> tuple[float, float]:
        """CUDA-event time of one short spin kernel started on a device idle for ``idle_us``, and of the same
        spin queued behind another: a difference is a device-side cost of starting after idleness (clocks, power
        state), seen without the profiler. Medians, us."""
        torch = self.torch
        after_idle, queued = [], []
        for _ in range(reps):
            for record in (after_idle, queued):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize(self.device)
                if record is after_idle:
                    _busy_wait(idle_us)
                else:
                    self.spin(100.0)  # the events below queue behind this spin
                e0.record()
                torch.cuda._sleep(cycles)
                e1.record()
                e1.synchronize()
                record.append(e0.elapsed_time(e1) * 1e3)
        return statistics.median(after_idle), statistics.median(queued)

    def kernel_us(self, fn: Callable[[], object], calls: int, cold: bool, clean: bool = False) -> float:
        """``kernel(...).us`` with the default (queued) method."""
        return self.kernel(fn, calls, cold, clean=clean).us
